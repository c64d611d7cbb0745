"""SiLU-gated MLP (dense layers and the shared experts)."""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from moejax.layers.fp8_policy import Fp8Scheme
from moejax.layers.linear import Linear


class GatedMLP(nn.Module):
    hidden_size: int
    intermediate_size: int
    dtype: Any = jnp.float32
    fp8: Fp8Scheme | None = None

    def setup(self):
        self.gate_proj = Linear(self.hidden_size, self.intermediate_size, self.dtype, self.fp8)
        self.up_proj = Linear(self.hidden_size, self.intermediate_size, self.dtype, self.fp8)
        self.down_proj = Linear(self.intermediate_size, self.hidden_size, self.dtype, self.fp8)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
