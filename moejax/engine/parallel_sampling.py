"""Several samples of one prompt (``n``, ``best_of``), vLLM's rules in one place: the checks, each sample's
parameters (sample j's seed is the request's + j; only the first asks for prompt logprobs, which are the
same for all), and which ``n`` of ``best_of`` samples are returned (the highest cumulative logprob of their
tokens). The engine prefills the prompt once: samples after the first wait for its blocks
(LLMEngine.add_request's ``after``)."""

from __future__ import annotations

import dataclasses

from moejax.engine.sampling_params import SamplingParams

MAX_SAMPLES = 128  # best_of (or n) per prompt: each is a sequence of the batch


def check(n, best_of) -> int:
    """Samples to run (best_of, default n); a ValueError names the field that is wrong."""
    for name, v in (("n", n), ("best_of", best_of)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_SAMPLES):
            raise ValueError(f"{name} must be an integer in [1, {MAX_SAMPLES}], got {v!r}")
    if n is None:
        raise ValueError("n must be an integer in [1, 128], got None")
    if best_of is not None and best_of < n:
        raise ValueError(f"best_of must be at least n ({n}), got {best_of}")
    return n if best_of is None else best_of


def sample_params(params: SamplingParams, j: int) -> SamplingParams:
    """Sample j's parameters: its own seed (the request's + j, vLLM's; none: the engine draws one each) and
    prompt logprobs on the first only (the rest share its cached prompt blocks)."""
    if j == 0:
        return params
    seed = None if params.seed is None else (params.seed + j) % 2**63
    return dataclasses.replace(params, seed=seed, prompt_logprobs=None)


def best(cumulative_logprobs: list[float], n: int) -> list[int]:
    """The indices of the n samples returned: the highest cumulative logprob first (vLLM's best_of); with
    as many samples as n, all of them in their order."""
    if len(cumulative_logprobs) == n:
        return list(range(n))
    return sorted(range(len(cumulative_logprobs)), key=lambda i: -cumulative_logprobs[i])[:n]
