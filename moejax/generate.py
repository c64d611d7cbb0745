"""``moejax.generate``: offline batched generation through the engine."""

from __future__ import annotations

import dataclasses

from moejax.engine import parallel_sampling
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
    cumulative_logprob: float = 0.0  # of the generated tokens: best_of keeps the highest
    # when prompt_logprobs=N: None for the first prompt token, then per prompt token {token id: logprob} of
    # the token itself first, then its N most likely alternatives (vLLM's layout)
    prompt_logprobs: list[dict[int, float] | None] | None = None


def _prompt_ids(model, prompt, i: int) -> list[int]:
    if isinstance(prompt, str):
        return model.tokenizer.encode(prompt)
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise ValueError(f"prompts[{i}] must be a string or a list of token ids, got {type(prompt).__name__}")


def generate(model, prompts, max_new_tokens: int = 16, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, seed: int | None = None, stop=None, logprobs: bool = False,
             top_logprobs: int = 0, ignore_eos: bool = False, progress: bool = False, n: int = 1,
             best_of: int | None = None, prompt_logprobs: int | None = None, presence_penalty: float = 0.0,
             frequency_penalty: float = 0.0, repetition_penalty: float = 1.0, logit_bias: dict | None = None,
             min_tokens: int = 0, min_p: float = 0.0, allowed_token_ids: list[int] | None = None,
             bad_words: list[str] | None = None) -> list[GenerationResult]:
    """Generates for each prompt (a string or a list of token ids); returns one result per prompt, or n
    (prompt-major: results[i * n + j]).

    temperature 0 is greedy. With a seed, prompt i samples with seed + i, so
    results do not depend on batching. ``logprobs``: each generated token's logprob;
    ``top_logprobs`` (0-20): also the N most likely tokens of each position with theirs.
    Both are of the model's raw distribution (log-softmax of the logits). ``prompt_logprobs`` (0-20): each
    prompt token's logprob (and its N alternatives), from the prefill. ``n`` samples of each prompt (the
    prompt prefilled once), the best n of ``best_of`` by cumulative logprob; with a seed, sample j of prompt
    i samples with seed + i * best_of + j (engine/parallel_sampling.py). The sampling controls
    (presence_penalty ... bad_words) are SamplingParams' (vLLM's definitions; layers/sampler.py).

    A model whose mesh spans several processes (docs/multiprocess.md): every process makes this call
    with the same arguments and gets the same results.
    """
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of strings or token-id lists")
    runs = parallel_sampling.check(n, best_of)
    params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                             seed=None if seed is None else seed + i * runs, stop=stop or [], logprobs=logprobs,
                             top_logprobs=top_logprobs, ignore_eos=ignore_eos, prompt_logprobs=prompt_logprobs,
                             presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                             repetition_penalty=repetition_penalty, logit_bias=logit_bias, min_tokens=min_tokens,
                             min_p=min_p, allowed_token_ids=allowed_token_ids, bad_words=bad_words or [])
              for i in range(len(prompts))]
    ids = [_prompt_ids(model, p, i) for i, p in enumerate(prompts)]
    # Across processes every process runs this same call (its steps are collectives): check it is the same.
    check_same((ids, params), "moejax.generate's prompts and sampling arguments")
    engine = model.engine
    seqs = []
    try:
        for i, (p_ids, sp) in enumerate(zip(ids, params)):
            first = None
            for j in range(runs):
                try:
                    seqs.append(engine.add_request(p_ids, parallel_sampling.sample_params(sp, j), after=first))
                except ValueError as e:
                    raise ValueError(f"prompts[{i}]: {e}") from None
                first = first or seqs[-1]
        engine.run_to_completion(seqs, progress=progress)
    except BaseException:
        for s in seqs:
            engine.abort(s)
        raise
    out = []
    for i in range(len(prompts)):
        group = seqs[i * runs:(i + 1) * runs]
        prompt_lps = _prompt_logprobs(group[0]) if prompt_logprobs is not None else None
        for k in parallel_sampling.best([s.cumulative_logprob for s in group], n):
            s = group[k]
            out.append(GenerationResult(text=s.text, token_ids=s.output_ids, finish_reason=s.finish_reason,
                                        prompt_token_ids=s.token_ids[:s.num_prompt_tokens],
                                        logprobs=list(s.logprobs) if logprobs else None,
                                        top_logprobs=[dict(t) for t in s.top_logprobs] if top_logprobs else None,
                                        error=s.error, cumulative_logprob=s.cumulative_logprob,
                                        prompt_logprobs=prompt_lps))
    return out


def _prompt_logprobs(seq) -> list[dict[int, float] | None]:
    """vLLM's layout of a sequence's prompt logprobs: None, then {the token: its logprob, alternatives...}."""
    prompt = seq.token_ids[:seq.num_prompt_tokens]
    out: list[dict[int, float] | None] = [None]
    for t, e in zip(prompt[1:], seq.prompt_logprobs):
        d = {t: e.logprob}
        for i, lp in e.top:
            d.setdefault(i, lp)
        out.append(d)
    return out
