"""Bias-free linear layer and embedding, weights in HF layout ([out, in])."""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

INIT_STD = 0.02  # HF's initializer_range default; used for random (tiny) models only


class Linear(nn.Module):
    in_features: int
    out_features: int
    dtype: Any = jnp.float32

    def setup(self):
        # Exposed as an attribute so MLA's absorbed decode can reshape kv_b_proj.
        self.weight = self.param("weight", nn.initializers.normal(INIT_STD),
                                 (self.out_features, self.in_features), self.dtype)

    def __call__(self, x):
        return jnp.einsum("...i,oi->...o", x.astype(self.dtype), self.weight)


class Embedding(nn.Module):
    num_embeddings: int
    features: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, ids):
        w = self.param("weight", nn.initializers.normal(INIT_STD), (self.num_embeddings, self.features), self.dtype)
        return jnp.take(w, ids, axis=0)


def einsum_f32(spec: str, a, b):
    """einsum with float32 accumulation and result.

    XLA:CPU's batched dot has no bf16 x bf16 -> f32 kernel, so on CPU the
    operands are widened instead; on GPU the MXU/tensor-core path keeps bf16 inputs.
    """
    if jax.default_backend() == "cpu" and (a.dtype != jnp.float32 or b.dtype != jnp.float32):
        return jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32))
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
