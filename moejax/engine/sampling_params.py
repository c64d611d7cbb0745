"""Per-request sampling parameters, validated with errors that name the field."""

from __future__ import annotations

import dataclasses
import math

from moejax.layers.sampler import MAX_TOP_LOGPROBS

INT32_MAX = 2**31 - 1  # top_k and token ids become int32 arrays of the compiled step


@dataclasses.dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False  # the sampled token's logprob
    top_logprobs: int = 0  # also the N most likely tokens of each position, with their logprobs
    # vLLM's: each prompt token's logprob (and its N most likely alternatives) from the prefill; None: off
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False  # the matched stop string ends the text (vLLM's)
    skip_special_tokens: bool = True  # the text leaves special tokens out (vLLM's)

    def __post_init__(self):
        def check_num(name, v, lo, hi=None, integer=False):
            ok_type = isinstance(v, int) if integer else isinstance(v, (int, float))
            if not ok_type or isinstance(v, bool):
                raise ValueError(f"{name} must be {'an integer' if integer else 'a number'}, got {v!r}")
            if not math.isfinite(v) or v < lo or (hi is not None and v > hi):
                raise ValueError(f"{name} must be in [{lo}, {hi if hi is not None else 'inf'}], got {v!r}")

        check_num("max_new_tokens", self.max_new_tokens, 1, INT32_MAX, integer=True)
        check_num("temperature", self.temperature, 0.0, 100.0)
        check_num("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0:
            raise ValueError("top_p must be in (0, 1], got 0")
        check_num("top_k", self.top_k, -1, INT32_MAX, integer=True)
        if self.top_k == -1:
            self.top_k = 0
        if self.seed is not None:
            check_num("seed", self.seed, 0, 2**63 - 1, integer=True)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop = list(self.stop)
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of integers in [0, {INT32_MAX}], "
                             f"got {self.stop_token_ids!r}"[:300])
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        for name in ("logprobs", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        check_num("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS, integer=True)
        if self.prompt_logprobs is not None:
            check_num("prompt_logprobs", self.prompt_logprobs, 0, MAX_TOP_LOGPROBS, integer=True)
