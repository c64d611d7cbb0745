"""Token sampling inside the compiled step: greedy, temperature, top-k, top-p, per-request seed,
and the top log-probabilities of the raw distribution.

Each row gets its own PRNG key from (seed, position), so a seeded request
samples the same tokens whatever else shares its batch.
"""

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
    choice = jax.vmap(jax.random.categorical)(keys, jnp.where(drop, -jnp.inf, sorted_logits))
    return jnp.take_along_axis(sorted_idx, choice[:, None], axis=-1)[:, 0]


def _top_logprobs(logprobs, num_top):
    """The MAX_TOP_LOGPROBS (or vocabulary-size) best (logprob, token id) of each row, descending; zeros
    when no row asks (num_top all 0), so a batch without top-logprob requests skips the top-k."""
    B, V = logprobs.shape
    K = min(MAX_TOP_LOGPROBS, V)
    return jax.lax.cond(
        jnp.any(num_top > 0),
        lambda: tuple(jax.lax.top_k(logprobs, K)),
        lambda: (jnp.zeros((B, K), logprobs.dtype), jnp.zeros((B, K), jnp.int32)),
    )


def sample(logits, temperature, top_p, top_k, seeds, num_top, positions):
    """logits [B, V] float32; temperature/top_p float32 [B]; top_k int32 [B] (0 = off);
    seeds uint32 [B]; num_top int32 [B] (top logprobs a row asks for, 0 = none); positions int32 [B].
    Returns (tokens int32 [B], logprob float32 [B], top logprobs float32 [B, K], top ids int32 [B, K])
    with K = min(MAX_TOP_LOGPROBS, V): the host keeps the first num_top of a row.

    temperature == 0 means greedy. Logprobs are those of the model's raw distribution
    (log_softmax of the logits: vLLM's default ``raw_logprobs``), whatever the sampling settings."""
    greedy = jnp.argmax(logits, axis=-1)
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)
    sampled = jax.lax.cond(
        jnp.any(temperature > 0),
        lambda: _sample_rows(logits, temperature, top_p, top_k, keys),
        lambda: greedy,  # skip the vocabulary sort when the whole batch is greedy
    )
    tokens = jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    top_lps, top_ids = _top_logprobs(logprobs, num_top)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0], top_lps, top_ids.astype(jnp.int32)
