"""Bias-free linear layer and embedding, weights in HF layout ([out, in]).

A Linear with an FP8 scheme keeps HF's FP8 layout: ``weight`` float8_e4m3fn [out, in] and
``weight_scale_inv`` float32 [ceil(out/128), ceil(in/128)], multiplied by the block-scaled
GEMM (moejax/layers/fp8_linear.py: Pallas on GPU, dequantise-and-dot in XLA elsewhere).
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from moejax.layers.fp8_linear import fp8_linear
from moejax.layers.fp8_policy import Fp8Scheme

INIT_STD = 0.02  # HF's initializer_range default; used for random (tiny) models only
SCALE_SUFFIX = "_scale_inv"  # an FP8 weight's block scales sit beside it under <name>_scale_inv


def fp8_param(module: nn.Module, name: str, shape: tuple[int, ...], block: tuple[int, int]):
    """An FP8 weight [..., rows, cols] and its block scales [..., ceil(rows/b0), ceil(cols/b1)]
    (initialised only for random models: values of INIT_STD's scale)."""
    scale_shape = (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
    codes = lambda k, s: jnp.clip(jax.random.normal(k, s) * 112.0, -448, 448).astype(jnp.float8_e4m3fn)  # noqa: E731
    w = module.param(name, codes, shape)
    s = module.param(name + SCALE_SUFFIX, lambda k, s: jnp.full(s, INIT_STD / 112.0, jnp.float32), scale_shape)
    return w, s


class Linear(nn.Module):
    in_features: int
    out_features: int
    dtype: Any = jnp.float32
    fp8: Fp8Scheme | None = None

    def setup(self):
        shape = (self.out_features, self.in_features)
        if self.fp8 is None:
            # Exposed as an attribute so MLA's absorbed decode can reshape kv_b_proj.
            self.weight = self.param("weight", nn.initializers.normal(INIT_STD), shape, self.dtype)
        else:
            self.weight, self.weight_scale_inv = fp8_param(self, "weight", shape, self.fp8.block)

    def __call__(self, x, out_dtype=None):
        """``out_dtype`` (default the weight's dtype): the GEMM's output dtype; float32 takes the f32
        accumulator as it is (for lm_head over 129k tokens of vocabulary at 512 rows, a bf16 result
        converted afterwards costs a pass over 400 MB)."""
        if self.fp8 is not None:
            return fp8_linear(x.astype(self.dtype), self.weight, self.weight_scale_inv, self.fp8.variant,
                              out_dtype=out_dtype)
        return jnp.einsum("...i,oi->...o", x.astype(self.dtype), self.weight, preferred_element_type=out_dtype)


class Embedding(nn.Module):
    num_embeddings: int
    features: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, ids):
        w = self.param("weight", nn.initializers.normal(INIT_STD), (self.num_embeddings, self.features), self.dtype)
        return jnp.take(w, ids, axis=0)
