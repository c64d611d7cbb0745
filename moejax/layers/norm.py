"""RMSNorm, computed in float32 and cast back like the HF reference."""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


class RMSNorm(nn.Module):
    features: int
    eps: float = 1e-6
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        w = self.param("weight", nn.initializers.ones, (self.features,), self.dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return w * x32.astype(x.dtype)
