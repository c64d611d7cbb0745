"""Bias-free linear layer and embedding, weights in HF layout ([out, in])."""

from typing import Any

import flax.linen as nn
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
