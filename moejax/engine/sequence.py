"""One request's state as it moves through the engine."""

from __future__ import annotations

import enum
import itertools

from moejax.engine.sampling_params import SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, seed: int, request_id=None):
        self.seq_id = next(_ids)
        self.request_id = request_id if request_id is not None else self.seq_id
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.params = params
        self.controls = None  # its sampling controls laid out for the sampler (engine/sample_controls.py), if any
        self.grammar = None  # its structured output's matcher (moejax/structured_output.py), if any
        self.seed = seed  # always set: drawn by the engine when the request gives none
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.dp_rank = 0  # the data-parallel rank (device) whose cache holds this sequence
        self.num_cached_tokens = 0  # tokens whose latents are in the cache (a prefix-cache hit included)
        self.num_new_tokens = 0  # tokens the scheduled prefill step computes (a chunk of the prompt)
        # Tokens sampled by dispatched decode steps, still on the device (not yet in token_ids):
        # 0, or 1 (2 for a moment, between dispatching step t+1 and reading step t) with async scheduling.
        self.num_pending_tokens = 0
        self.block_hashes: list[bytes] = []  # prefix-cache keys of its full token blocks (hashed once, lazily)
        self.num_keyed_blocks = 0  # of its blocks, how many are registered in the prefix cache (or hits)
        self.logprobs: list[float] = []  # of each output token, when params.logprobs
        # per output token, when params.top_logprobs: the most likely (token id, logprob), descending
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.cumulative_logprob = 0.0  # of the output tokens (raw distribution): best_of ranks by it
        # when params.prompt_logprobs: prompt tokens 1.. (engine/prompt_logprobs.py's PromptLogprob each)
        self.prompt_logprobs: list = []
        self.finish_reason: str | None = None
        self.error: str | None = None  # why it was given up (finish_reason "error")
        self.text = ""
        self.num_preemptions = 0

    def __len__(self):
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def ends_by_length(self, max_model_len: int) -> bool:
        """Its pending token will end it on length (max_new_tokens or max_model_len): known without its value."""
        n = len(self.token_ids) + self.num_pending_tokens
        return n - self.num_prompt_tokens >= self.params.max_new_tokens or n >= max_model_len

    @property
    def prefill_done(self) -> bool:
        return self.num_cached_tokens >= len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED
