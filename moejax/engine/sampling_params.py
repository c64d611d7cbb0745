"""Per-request sampling parameters, validated with errors that name the field."""

from __future__ import annotations

import dataclasses
import math

from moejax.layers.sampler import CONTROLS, MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SampleMode
from moejax.structured_output import Constraint

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
    # The sampling controls (vLLM's definitions; layers/sampler.py applies them, engine/sample_controls.py
    # checks what needs the vocabulary or the tokenizer when the request is added)
    presence_penalty: float = 0.0  # subtracted from the logit of each token the output has
    frequency_penalty: float = 0.0  # x the token's count in the output, subtracted
    repetition_penalty: float = 1.0  # divides (positive) / multiplies (negative) a prompt or output token's logit
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_tokens: int = 0  # EOS and stop_token_ids are masked until the output has this many tokens
    min_p: float = 0.0  # tokens below min_p x the most likely's probability are dropped (sampling rows)
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] = dataclasses.field(default_factory=list)  # never generated (vLLM's tokenisation rule)
    structured_outputs: Constraint | None = None  # the output matches it (moejax/structured_output.py's mask)

    @property
    def uses_controls(self) -> bool:
        """Whether the batch needs the sampler's controls variant for this request."""
        return self.sample_mode.controls

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
        self._check_controls(check_num)

    def _check_controls(self, check_num):
        """vLLM's ranges; token ids against the vocabulary are checked when the request is added."""
        check_num("presence_penalty", self.presence_penalty, -2.0, 2.0)
        check_num("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        check_num("repetition_penalty", self.repetition_penalty, 0.0)
        if self.repetition_penalty == 0:
            raise ValueError("repetition_penalty must be greater than zero, got 0")
        check_num("min_p", self.min_p, 0.0, 1.0)
        check_num("min_tokens", self.min_tokens, 0, INT32_MAX, integer=True)
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_new_tokens ({self.max_new_tokens}), "
                             f"got {self.min_tokens}")

        def token_id(t) -> bool:
            return isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX

        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a mapping of token ids to numbers, got {self.logit_bias!r}"[:300])
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are taken")
            bias = {}
            for t, b in self.logit_bias.items():
                # a decimal string too: the key as JSON carries it (OpenAI's body, a handoff's params)
                k = int(t) if isinstance(t, str) and t.isdigit() else t
                if not token_id(k):
                    raise ValueError(f"logit_bias keys must be token ids (integers in [0, {INT32_MAX}]), got {t!r}")
                check_num("logit_bias", b, -100.0, 100.0)
                bias[k] = float(b)
            self.logit_bias = bias
        if self.allowed_token_ids is not None:
            if (not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids
                    or not all(token_id(t) for t in self.allowed_token_ids)):
                raise ValueError("allowed_token_ids must be a non-empty list of token ids (integers in "
                                 f"[0, {INT32_MAX}]), got {self.allowed_token_ids!r}"[:300])
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is None:
            self.bad_words = []
        if not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) and w.strip()
                                                                    for w in self.bad_words):
            raise ValueError(f"bad_words must be a list of non-blank strings, got {self.bad_words!r}"[:300])
        self.bad_words = list(self.bad_words)
        self.structured_outputs = Constraint.of(self.structured_outputs)
        controls = bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                        or self.logit_bias or self.min_tokens or self.min_p
                        or self.allowed_token_ids is not None or self.bad_words
                        or self.structured_outputs is not None)
        # what the sampler needs for this request, decided once: every step asks it of every sequence
        self.sample_mode = CONTROLS if controls else SampleMode.of_request(self)
        if self.prompt_logprobs is not None:
            check_num("prompt_logprobs", self.prompt_logprobs, 0, MAX_TOP_LOGPROBS, integer=True)
