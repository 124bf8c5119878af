"""The Anthropic Messages API (/v1/messages, count_tokens) over the OpenAI chat path."""
