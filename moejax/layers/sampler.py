"""Token sampling inside the compiled step: greedy, temperature, top-k, top-p, per-request seed,
and the top log-probabilities of the raw distribution.

Each row gets its own PRNG key from (seed, position), so a seeded request
samples the same tokens whatever else shares its batch.

What the batch needs (any row sampling at temperature > 0, any row asking for top logprobs) is a
static ``SampleMode`` the host knows, not a ``lax.cond`` on the device: XLA:GPU reads a
conditional's predicate back to the host before it launches the branch, which made every step's
dispatch wait for the step itself (measured on the H200: the decode call returned only after the
device had run it, so the host could not build the next step meanwhile). A batch's mode picks one
of six small compiled sampler variants (model_runner.py runs sampling as its own program):
greedy-only batches skip the random draw, and batches where no row truncates (top-k off, top-p 1)
skip the vocabulary sort: their draw is the same Gumbel-max over the vocabulary in token order that
the truncating path makes with nothing dropped, so the tokens are identical either way.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for (vLLM's and OpenAI's limit)


def _sample_rows(logits, temperature, top_p, top_k, keys):
    V = logits.shape[-1]
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    sorted_logits, sorted_idx = jax.lax.sort_key_val(-scaled, jnp.broadcast_to(jnp.arange(V), scaled.shape))
    sorted_logits = -sorted_logits
    rank = jnp.arange(V)[None, :]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    drop = rank >= k[:, None]
    probs = jax.nn.softmax(jnp.where(drop, -jnp.inf, sorted_logits), axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    drop |= (jnp.cumsum(probs, axis=-1) - probs) >= top_p[:, None]
    # The draw (Gumbel-max) runs over the vocabulary in token order, the kept set mapped back: each
    # token's noise is its own, not its sort rank's, so two near-equal logits whose order a last-bit
    # difference swaps (another parallel layout, another batch) do not swap their draws.
    drop_vocab = jnp.zeros_like(drop).at[jnp.arange(drop.shape[0])[:, None], sorted_idx].set(drop)
    return jax.vmap(jax.random.categorical)(keys, jnp.where(drop_vocab, -jnp.inf, scaled))


class SampleMode(NamedTuple):
    """What a batch's sampling needs, known on the host (static: one compiled variant each)."""
    random: bool = True  # some row samples (temperature > 0); else every row is greedy
    top: bool = True  # some row asks for top logprobs
    truncate: bool = True  # some sampling row has top-k or top-p (the vocabulary sort); only with random

    @classmethod
    def of(cls, params) -> "SampleMode":
        """The mode of a batch of SamplingParams."""
        params = list(params)
        random = any(p.temperature > 0 for p in params)
        truncate = random and any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1.0) for p in params)
        return cls(random, any(p.top_logprobs for p in params), truncate)

    @classmethod
    def all(cls) -> list["SampleMode"]:
        """Every distinct mode (what start-up compilation builds)."""
        return [cls(r, t, c) for r in (False, True) for t in (False, True) for c in ((False, True) if r else (False,))]


def _top_logprobs(logprobs, want: bool):
    """The MAX_TOP_LOGPROBS (or vocabulary-size) best (logprob, token id) of each row, descending; zeros
    when no row asks (``want`` False), so such a batch skips the top-k."""
    B, V = logprobs.shape
    K = min(MAX_TOP_LOGPROBS, V)
    if want:
        return jax.lax.top_k(logprobs, K)
    return jnp.zeros((B, K), logprobs.dtype), jnp.zeros((B, K), jnp.int32)


def sample(logits, temperature, top_p, top_k, seeds, positions, mode: SampleMode = SampleMode()):
    """logits [B, V] float32; temperature/top_p float32 [B]; top_k int32 [B] (0 = off);
    seeds uint32 [B]; positions int32 [B].
    Returns (tokens int32 [B], logprob float32 [B], top logprobs float32 [B, K], top ids int32 [B, K])
    with K = min(MAX_TOP_LOGPROBS, V): the host keeps the first ``top_logprobs`` of a row.

    temperature == 0 means greedy; ``mode`` (static) may skip what no row needs. Logprobs are those of the model's raw distribution
    (log_softmax of the logits: vLLM's default ``raw_logprobs``), whatever the sampling settings."""
    greedy = jnp.argmax(logits, axis=-1)
    if mode.random:
        keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)
        if mode.truncate:
            sampled = _sample_rows(logits, temperature, top_p, top_k, keys)
        else:  # nothing to drop: the same draw without the sort
            scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
            sampled = jax.vmap(jax.random.categorical)(keys, scaled)
        tokens = jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)
    else:  # the whole batch is greedy: no vocabulary sort
        tokens = greedy.astype(jnp.int32)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    top_lps, top_ids = _top_logprobs(logprobs, mode.top)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0], top_lps, top_ids.astype(jnp.int32)
