"""What every decoder-only model here shares: pre-norm residual blocks and the
embed -> layers -> norm -> lm_head stack, with the prefill / decode / logits
interface the runner calls. A family subclasses both: its layer names its attention
class, its causal LM names its layer class. Parameter names are HF's (embed_tokens, layers_N/self_attn, ...)."""

from typing import Any, ClassVar

import flax.linen as nn
import jax.numpy as jnp

from moejax.layers.forward_batch import ForwardBatch
from moejax.layers.fp8_policy import NO_FP8, Fp8Policy
from moejax.layers.linear import Embedding, Linear
from moejax.layers.mlp import GatedMLP
from moejax.layers.norm import RMSNorm
from moejax.layers.paged_attention import query_rows
from moejax.models.moe import MoE
from moejax.parallel.dispatch import ExpertParallel


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
    attention: ClassVar[type]

    def setup(self):
        c = self.cfg
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)
        self.self_attn = self.attention(c, self.layer, self.dtype, self.fp8.scheme("attention"))
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
        for layer in self.layers:
            h, cache = layer.prefill(h, batch, cache)
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
        for layer in self.layers:
            h, cache = layer.decode(h, batch, cache)
        return h, cache

    def logits(self, h):
        return self.lm_head(self.norm(h), jnp.float32)

    def __call__(self, tokens):
        """Used only to create parameters (init)."""
        B, S = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(S), (B, S))
        h, _ = self.prefill(tokens, ForwardBatch.prefill(pos, jnp.full((B,), S)))
        return self.logits(h)
