"""OpenAI-compatible HTTP serving for moejax (aiohttp).

- ``async_engine``: drives the LLMEngine from one background thread, streams tokens to asyncio.
- ``protocol``: request validation -> SamplingParams, the tokenizer endpoints, errors.
- ``incremental_text``: a stream's text deltas from its token ids (stop strings held back).
- ``parsed_request``: a validated request (what the engine runs, what the answer holds).
- ``responses``: OpenAI response bodies, stream chunks and the logprobs layouts (echo, prompt_logprobs).
- ``metrics``: Prometheus text exposition with vLLM's metric names.
- ``app``: the aiohttp routes.
"""

from moejax.server.app import build_app, ServerThread  # noqa: F401
