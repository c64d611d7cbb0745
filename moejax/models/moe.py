"""The MoE block: router, routed experts (stacked weights) and shared experts (DeepSeek, Step3).

It stands over moejax/parallel/ (it picks the expert-parallel dispatch backend, whose backends run
moejax/layers/experts.py), so here beside decoder.py, its one user, not among the single-device
blocks of moejax/layers/."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from moejax.kernels import moe as moe_kernels
from moejax.layers.experts import ExpertWeights, SharedWeights
from moejax.layers.fp8_policy import NO_FP8, Fp8Policy, Fp8Scheme
from moejax.layers.linear import INIT_STD, fp8_param
from moejax.layers.mlp import GatedMLP
from moejax.layers.router import Router
from moejax.parallel import dispatch
from moejax.parallel.dispatch import ExpertParallel


class RoutedExperts(nn.Module):
    """Expert weights stacked on a leading physical-slot axis, laid out [slots, in, out]
    for grouped GEMMs; under expert parallelism each rank holds slots / ranks of them.
    The "routing" collection maps logical experts to physical slots (``expert_slots``
    [E, 1 + num_redundant], ``expert_replicas`` [E]), so a load balancer can move and
    replicate experts without changing the model or recompiling. The "stats"
    collection receives, per call, the tokens routed to each logical expert
    (``expert_counts``) and the (token, expert) pairs this rank computed (``dispatched``)."""
    cfg: Any  # a family config: n_routed_experts, hidden_size, moe_intermediate_size, n_shared_experts
    dtype: Any = jnp.float32
    ep: ExpertParallel = ExpertParallel()
    # FP8: weights in HF's per-expert [out, in] layout ([slots, out, in], K contiguous: what the FP8
    # fused MoE reads fastest, 1.5-1.8x the [in, out] layout on the H200, benchmarks/2026-12-03f),
    # block scales <proj>_scale_inv [slots, out/128, in/128]
    fp8: Fp8Scheme | None = None

    @nn.compact
    def __call__(self, x, topk_idx, topk_weight, valid=None, shared: SharedWeights | None = None):
        """shared: shared experts to compute in the same grouped computation (weight 1, this rank's tokens)."""
        c = self.cfg
        E, H, I = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
        here = (E + self.ep.num_redundant) // self.ep.n_ranks  # under shard_map Flax sees this rank's shard
        shapes = {"gate_proj": (here, H, I), "up_proj": (here, H, I), "down_proj": (here, I, H)}
        if self.fp8 is None:
            init = nn.initializers.normal(INIT_STD)
            w = ExpertWeights(*(self.param(n, init, shp, self.dtype) for n, shp in shapes.items()))
        else:
            (wg, sg), (wu, su), (wd, sd) = (fp8_param(self, n, (s[0], s[2], s[1]), self.fp8.block)
                                            for n, s in shapes.items())
            w = ExpertWeights(wg, wu, wd, sg, su, sd, self.fp8.variant)
        slots = self.variable("routing", "expert_slots",
                              lambda: jnp.tile(jnp.arange(E, dtype=jnp.int32)[:, None], (1, 1 + self.ep.num_redundant))).value
        replicas = self.variable("routing", "expert_replicas", lambda: jnp.ones((E,), jnp.int32)).value
        if valid is None:
            valid = jnp.ones(x.shape[:1], bool)
        self.sow("stats", "expert_counts",
                 jnp.zeros((E,), jnp.int32).at[topk_idx.reshape(-1)].add(jnp.repeat(valid, topk_idx.shape[1]).astype(jnp.int32)))
        if self.ep.backend == "local":
            y, n = dispatch.local_experts(x, topk_idx, topk_weight, valid, slots, replicas, w, shared)
        else:
            fn = dispatch.dispatch_fn(self.ep.backend)
            y, n = fn(x, topk_idx, topk_weight, valid, slots, replicas, w, self.ep.axis, self.ep.n_ranks, shared)
        self.sow("stats", "dispatched", n)
        return y


class MoE(nn.Module):
    """Router, routed experts and shared experts (DeepSeek's ``shared_experts``, or a shared MLP the
    caller owns: Step3's ``share_expert``). Where ``moejax.kernels.moe.fuse_shared_experts`` says so,
    the shared experts run inside the routed-expert computation as always-selected extra experts of
    weight 1 (``SharedWeights``); else beside it as their own MLP. Either way the parameters are the
    same (HF's names and layout)."""
    cfg: Any  # a family config: n_routed_experts, hidden_size, moe_intermediate_size, n_shared_experts
    dtype: Any = jnp.float32
    ep: ExpertParallel = ExpertParallel()
    fp8: Fp8Policy = NO_FP8

    def setup(self):
        c = self.cfg
        self.gate = Router(c)
        self.experts = RoutedExperts(c, self.dtype, self.ep, self.fp8.scheme("experts"))
        if c.n_shared_experts:
            self.shared_experts = GatedMLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts, self.dtype,
                                           self.fp8.scheme("shared_experts"))

    def _fused_shared(self, shared: GatedMLP | None) -> SharedWeights | None:
        """The shared MLP as SharedWeights when it runs inside the routed-expert kernel, else None:
        both bf16/f32 (an FP8 side keeps its own kernel) and its width a multiple of the routed width."""
        c = self.cfg
        I = c.moe_intermediate_size
        if (shared is None or shared.fp8 is not None or self.fp8.scheme("experts") is not None
                or shared.intermediate_size % I or jnp.dtype(shared.dtype) != jnp.dtype(self.dtype)
                or not moe_kernels.fuse_shared_experts(c.n_routed_experts, c.hidden_size, I, self.dtype)):
            return None
        return SharedWeights(shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight, I)

    def __call__(self, x, valid=None, shared: GatedMLP | None = None):
        """valid: which tokens are real (padding is neither counted nor dispatched). shared: a shared MLP
        of the caller's (Step3), added with weight 1 like DeepSeek's own shared experts."""
        if self.cfg.n_shared_experts:
            shared = self.shared_experts
        fused = self._fused_shared(shared)
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        idx, w = self.gate(flat)
        out = self.experts(flat, idx, w, None if valid is None else valid.reshape(-1), fused)
        out = out.astype(x.dtype).reshape(shape)
        if shared is not None and fused is None:
            out = out + shared(x)
        return out
