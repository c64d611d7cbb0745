"""Token sampling inside the compiled step: greedy, temperature, top-k, top-p, per-request seed.

Each row gets its own PRNG key from (seed, position), so a seeded request
samples the same tokens whatever else shares its batch.
"""

import jax
import jax.numpy as jnp


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


def sample(logits, temperature, top_p, top_k, seeds, positions):
    """logits [B, V] float32; temperature/top_p float32 [B]; top_k int32 [B] (0 = off);
    seeds uint32 [B]; positions int32 [B]. Returns (tokens int32 [B], logprob float32 [B]).

    temperature == 0 means greedy. The logprob is that of the chosen token under
    the model's raw distribution (vLLM's default ``raw_logprobs``)."""
    greedy = jnp.argmax(logits, axis=-1)
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)
    sampled = jax.lax.cond(
        jnp.any(temperature > 0),
        lambda: _sample_rows(logits, temperature, top_p, top_k, keys),
        lambda: greedy,  # skip the vocabulary sort when the whole batch is greedy
    )
    tokens = jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
