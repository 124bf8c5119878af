"""OpenAI's Responses API: /v1/responses over the chat path, its store and its stream events."""
