"""Structured output: constrain sampling to a JSON schema, regex, choice or grammar.

* `spec.py`: `StructuredOutputs`, the constraint as it travels in `SamplingParams`
  (no heavy imports: the wire module and the front-end load it);
* `grammar.py`: validating a spec (API server, before anything is sent) and
  compiling it for a tokenizer (xgrammar);
* `manager.py`: the engine's side: compiling off the busy loop with a cache,
  requests waiting for their grammar, one matcher per request, the token bitmasks
  the sampler applies.
"""

from dpserve.structured.spec import StructuredOutputs

__all__ = ["StructuredOutputs"]
