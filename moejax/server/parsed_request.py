"""ParsedRequest: a request as protocol.py validated it (the engine's prompts and SamplingParams) and what its
answer holds (responses.py lays it out)."""

from __future__ import annotations

import dataclasses

from moejax.engine.sampling_params import SamplingParams
from moejax.server.chat_output import OutputParsing


@dataclasses.dataclass
class ParsedRequest:
    chat: bool
    prompts: list[list[int]]  # one for chat; a completion's list of prompts (stream: false), one choice each
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: bool
    return_token_ids: bool
    model: str
    top_logprobs: int = 0  # alternatives per token (completions: logprobs N, chat: top_logprobs N)
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: tokens shown as "token_id:<id>"
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
    request_id: str | None = None  # the client's: the response's id
    parsing: OutputParsing | None = None  # chat: the answer's reasoning / tool calls taken out (chat_output.py)
    n: int = 1  # choices a prompt
    best_of: int = 1  # sequences a prompt (req.prompts[i]'s at i * best_of + j), the best n returned
    echo: bool = False  # completions: each choice starts with its prompt (text, logprobs); chat: prompt_texts[0]
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone
    prompt_logprobs: int | None = None  # vLLM's field: the prompt's logprobs with their top N
    prompt_texts: list[str] | None = None  # each prompt as echoed (chat: the last message's content or '')

    @property
    def prompt_ids(self) -> list[int]:
        """The prompt of a single-prompt request (every chat, every stream)."""
        return self.prompts[0]
