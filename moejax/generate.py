"""``moejax.generate``: offline batched generation through the engine."""

from __future__ import annotations

import dataclasses

from moejax.engine.sampling_params import SamplingParams
from moejax.parallel.processes import check_same


@dataclasses.dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string/token), "length", or "error" (error says why)
    prompt_token_ids: list[int]
    logprobs: list[float] | None = None  # of each generated token, when asked
    # per generated token, when top_logprobs=N: {token id: logprob} of the N most likely, descending
    top_logprobs: list[dict[int, float]] | None = None
    error: str | None = None  # why a sequence was given up (finish_reason "error")


def _prompt_ids(model, prompt, i: int) -> list[int]:
    if isinstance(prompt, str):
        return model.tokenizer.encode(prompt)
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise ValueError(f"prompts[{i}] must be a string or a list of token ids, got {type(prompt).__name__}")


def generate(model, prompts, max_new_tokens: int = 16, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, seed: int | None = None, stop=None, logprobs: bool = False,
             top_logprobs: int = 0, ignore_eos: bool = False, progress: bool = False) -> list[GenerationResult]:
    """Generates for each prompt (a string or a list of token ids); returns one result per prompt.

    temperature 0 is greedy. With a seed, prompt i samples with seed + i, so
    results do not depend on batching. ``logprobs``: each generated token's logprob;
    ``top_logprobs`` (0-20): also the N most likely tokens of each position with theirs.
    Both are of the model's raw distribution (log-softmax of the logits).

    A model whose mesh spans several processes (docs/multiprocess.md): every process makes this call
    with the same arguments and gets the same results.
    """
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of strings or token-id lists")
    params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                             seed=None if seed is None else seed + i, stop=stop or [], logprobs=logprobs,
                             top_logprobs=top_logprobs, ignore_eos=ignore_eos) for i in range(len(prompts))]
    ids = [_prompt_ids(model, p, i) for i, p in enumerate(prompts)]
    # Across processes every process runs this same call (its steps are collectives): check it is the same.
    check_same((ids, params), "moejax.generate's prompts and sampling arguments")
    engine = model.engine
    seqs = []
    try:
        for i, (p_ids, sp) in enumerate(zip(ids, params)):
            try:
                seqs.append(engine.add_request(p_ids, sp))
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
        engine.run_to_completion(seqs, progress=progress)
    except BaseException:
        for s in seqs:
            engine.abort(s)
        raise
    return [GenerationResult(text=s.text, token_ids=s.output_ids, finish_reason=s.finish_reason,
                             prompt_token_ids=s.token_ids[:s.num_prompt_tokens],
                             logprobs=list(s.logprobs) if logprobs else None,
                             top_logprobs=[dict(t) for t in s.top_logprobs] if top_logprobs else None,
                             error=s.error) for s in seqs]
