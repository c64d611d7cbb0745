"""What every decoder-only model here shares: pre-norm residual blocks and the
embed -> layers -> norm -> lm_head stack, with the prefill / decode / logits
interface the runner calls. A family subclasses both: its layer names its attention
class, its causal LM names its layer class. Parameter names are HF's (embed_tokens, layers_N/self_attn, ...)."""

from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from moejax.kernels import common
from moejax.layers.forward_batch import ForwardBatch
from moejax.layers.fp8_policy import NO_FP8, Fp8Policy
from moejax.layers.linear import Embedding, Linear
from moejax.layers.mlp import GatedMLP
from moejax.layers.norm import RMSNorm
from moejax.layers.paged_attention import query_rows
from moejax.models.moe import MoE
from moejax.parallel.dispatch import ExpertParallel


def scan_layers(ep: ExpertParallel) -> bool:
    """Whether CausalLM runs its identical MoE layers as one ``lax.scan`` (``CausalLM._scan``): on XLA:CPU
    only, where a step's compile time is its cost (the tiny default's start-up, tests, CI: its two MoE layers
    as one take 15-20% off a step's build, BENCHMARKS.md "2026-12-07f start-up (CPU)"), on XLA's own paths (not the Pallas
    kernels a test forces there: they take the layer as a static argument); experts local and no dual-batch
    overlap (one layer's computation a scan step). Elsewhere the layers stay unrolled: GPU programs, their
    numerics and speed, are unchanged."""
    return (common.platform() == "cpu" and common.current_mode() != "pallas" and ep.backend == "local"
            and ep.dbo != "on")


def _sow_tree(module, stats: dict) -> None:
    """Sows ``stats`` (a layer's "stats" collection: nested dicts down to tuples of sown values) into
    ``module``'s own submodules, value by value, as the module's own calls would have."""
    for name, sub in stats.items():
        if isinstance(sub, tuple):
            for value in sub:
                module.sow("stats", name, value)
        else:
            _sow_tree(getattr(module, name), sub)


def split_rows(n_rows: int, *arrays):
    """The arrays' leading rows in two micro-batches: [0, ceil(n/2)) and the rest (for DBO)."""
    m = -(-n_rows // 2)
    return [tuple(a[:m] for a in arrays), tuple(a[m:] for a in arrays)]


class PreNormDecoderLayer(nn.Module):
    """RMSNorm -> attention -> residual -> RMSNorm -> ffn -> residual. Subclasses set
    ``attention`` (a module class built as attention(cfg, layer, dtype)); the ffn is the MoE
    block on the config's MoE layers and a dense SiLU MLP elsewhere. A family with more in
    its ffn (Step3's shared expert) adds modules in ``setup_extra`` and overrides ``ffn``."""
    cfg: Any
    layer: int
    dtype: Any = jnp.float32
    ep: ExpertParallel = ExpertParallel()
    fp8: Fp8Policy = NO_FP8
    # The cache layer its attention writes and reads where that is not ``layer`` (a traced index: the layer
    # as a step of CausalLM's scan over identical layers); only attention classes with this field take it.
    cache_layer: Any = None
    attention: ClassVar[type]

    def setup(self):
        c = self.cfg
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)
        kw = {} if self.cache_layer is None else {"cache_layer": self.cache_layer}
        self.self_attn = self.attention(c, self.layer, self.dtype, self.fp8.scheme("attention"), **kw)
        if c.is_moe_layer(self.layer):
            self.mlp = MoE(c, self.dtype, self.ep, self.fp8)
        else:
            self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, self.dtype, self.fp8.scheme("dense_mlp"))
        self.setup_extra()

    def setup_extra(self):
        pass

    def ffn(self, x, valid):
        """valid: which tokens are real (padding is not routed to experts)."""
        return self.mlp(x, valid) if self.cfg.is_moe_layer(self.layer) else self.mlp(x)

    def prefill(self, x, batch: ForwardBatch, cache):
        a, cache = self.self_attn.prefill(self.input_layernorm(x), batch, cache)
        h = x + a
        valid = batch.real_tokens(cache, x.shape[0])
        n = self.post_attention_layernorm(h)
        shape = n.shape
        T = n.size // shape[-1]
        if not self.cfg.is_moe_layer(self.layer) or self.ep.micro_batches(T, "prefill") == 1:
            return h + self.ffn(n, valid), cache
        # Dual-batch overlap in prefill: the token-wise ffn in two halves of the flattened tokens, so one
        # half's dispatch/combine can run under the other's experts. Attention stays whole: a packed
        # stream cannot be cut without one half's prompts attending across the cut.
        valid = jnp.ones(shape[:-1], bool) if valid is None else valid
        parts = split_rows(T, n.reshape(T, shape[-1]), valid.reshape(T))
        y = jnp.concatenate([self.ffn(p, v) for p, v in parts]).reshape(shape)
        return h + y, cache

    def decode(self, x, batch: ForwardBatch, cache):
        a, cache = self.self_attn.decode(self.input_layernorm(x), batch, cache)
        h = x + a
        return h + self.ffn(self.post_attention_layernorm(h), batch.real_tokens(cache, x.shape[0])), cache

    def decode_micro(self, parts, cache):
        """Dual-batch overlap: ``parts`` = two micro-batches (x, their ForwardBatch).
        Written as two independent chains (the cache update orders their attention: micro-batch 0
        then 1), so XLA's latency-hiding scheduler can run micro-batch 1's attention and experts
        between micro-batch 0's all-to-all start and done, and the other way round, across layers
        too (vLLM's DBO / SGLang's two-batch overlap order)."""
        hs = []
        for x, batch in parts:
            a, cache = self.self_attn.decode(self.input_layernorm(x), batch, cache)
            hs.append(x + a)
        out = [(h + self.ffn(self.post_attention_layernorm(h), batch.real_tokens(cache, h.shape[0])), batch)
               for h, (_, batch) in zip(hs, parts)]
        return out, cache


class CausalLM(nn.Module):
    """Subclasses set ``decoder_layer`` (their PreNormDecoderLayer)."""
    cfg: Any
    dtype: Any = jnp.float32
    ep: ExpertParallel = ExpertParallel()
    fp8: Fp8Policy = NO_FP8  # which layer types keep FP8 block-scaled weights
    decoder_layer: ClassVar[type]

    def setup(self):
        c = self.cfg
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, self.dtype)
        self.layers = [self.decoder_layer(c, i, self.dtype, self.ep, self.fp8) for i in range(c.num_hidden_layers)]
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, self.dtype, self.fp8.scheme("lm_head"))

    def prefill(self, tokens, batch: ForwardBatch, cache=None):
        """tokens -> final hidden states (before the last norm), cache; ``batch`` a prefill form
        (layers/forward_batch.py): dense [B, S] -> [B, S, H]; paged, a chunk of a longer prompt whose
        earlier rows are in the cache (attention reads the whole context from it,
        layers/prefill_attention.py); packed, whole prompts back to back [T] -> [T, H] (padding after
        cu_seqlens[B] writes to an out-of-range slot and is not routed to experts)."""
        h = self.embed_tokens(tokens)
        return self._run_layers("prefill", h, batch, cache)

    # ----- the layers in order, identical ones as one lax.scan where ``scan_layers`` says so
    def _layer_runs(self) -> list[list[int]]:
        """The decoder layers in runs to execute: a run of several is consecutive MoE layers whose variables
        have one structure and shapes (one scanned body); every other layer is a run of one."""
        c = self.cfg
        if not scan_layers(self.ep) or self.is_initializing() or not hasattr(self.decoder_layer.attention,
                                                                              "cache_layer"):
            return [[i] for i in range(len(self.layers))]

        def sig(i):
            v = self._layer_variables(i)
            return jax.tree.structure(v), tuple((x.shape, x.dtype) for x in jax.tree.leaves(v))

        runs = []
        for i in range(len(self.layers)):
            if (runs and c.is_moe_layer(i) and c.is_moe_layer(runs[-1][-1]) and i == runs[-1][-1] + 1
                    and sig(i) == sig(runs[-1][0])):
                runs[-1].append(i)
            else:
                runs.append([i])
        return runs

    def _layer_variables(self, i: int) -> dict:
        """Layer i's parameters and routing tables (not what it sows)."""
        return {k: v for k, v in self.layers[i].variables.items() if k != "stats"}

    def _run_layers(self, method: str, h, batch: ForwardBatch, cache):
        for run in self._layer_runs():
            if len(run) == 1:
                h, cache = getattr(self.layers[run[0]], method)(h, batch, cache)
            else:
                h, cache = self._scan(run, method, h, batch, cache)
        return h, cache

    def _scan(self, run: list[int], method: str, h, batch: ForwardBatch, cache):
        """The layers ``run`` (identical MoE layers) as one ``lax.scan`` over their stacked variables: XLA
        compiles one layer's body instead of len(run) copies. Each step is the layer itself (an unbound
        copy applied to that layer's variables) with its cache layer a traced index; the MoE statistics each
        sows are sown again under its own layer, as the unrolled layers would."""
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[self._layer_variables(i) for i in run])

        def body(carry, xs):
            x, kv = carry
            v, index = xs
            layer = self.decoder_layer(self.cfg, run[0], self.dtype, self.ep, self.fp8, cache_layer=index,
                                       parent=None)
            (x, kv), state = layer.apply(dict(v), x, batch, kv, method=method, mutable=["stats"])
            return (x, kv), state.get("stats", {})

        (h, cache), stats = jax.lax.scan(body, (h, cache), (stacked, jnp.asarray(run, jnp.int32)))
        if self.is_mutable_collection("stats"):
            for j, i in enumerate(run):
                _sow_tree(self.layers[i], jax.tree.map(lambda a: a[j], stats))
        return h, cache

    def decode(self, tokens, batch: ForwardBatch, cache):
        """One token a row: tokens [B] -> hidden states [B, H], cache; ``batch`` the decode form."""
        h = self.embed_tokens(tokens)
        B = h.shape[0]
        if self.ep.micro_batches(B, "decode") == 2:  # dual-batch overlap (ExpertParallel.micro_batches)
            # Micro-batches split rows, so each row takes its own table (rows a sequence: query_rows).
            tables = jnp.repeat(batch.block_tables, query_rows(B, batch.block_tables), axis=0)
            parts = [(x, batch.replace(positions=p, slots=s, block_tables=t, seq_lens=n))
                     for x, p, s, t, n in split_rows(B, h, batch.positions, batch.slots, tables, batch.seq_lens)]
            for layer in self.layers:
                parts, cache = layer.decode_micro(parts, cache)
            return jnp.concatenate([x for x, _ in parts]), cache
        return self._run_layers("decode", h, batch, cache)

    def logits(self, h):
        return self.lm_head(self.norm(h), jnp.float32)

    def __call__(self, tokens):
        """Used only to create parameters (init)."""
        B, S = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(S), (B, S))
        h, _ = self.prefill(tokens, ForwardBatch.prefill(pos, jnp.full((B,), S)))
        return self.logits(h)
