"""What every decoder-only model here shares: pre-norm residual blocks and the
embed -> layers -> norm -> lm_head stack, with the prefill / decode / logits
interface the runner calls. A model subclasses both and only builds its parts
in ``setup`` (attention, the MLP of each layer)."""

import flax.linen as nn
import jax.numpy as jnp


def real_tokens(cache, slots):
    """Padding rows write to an out-of-range slot; those tokens are not routed to experts."""
    return None if cache is None else slots < cache.shape[1]


class PreNormDecoderLayer(nn.Module):
    """Subclasses set input_layernorm, post_attention_layernorm, self_attn and define
    ``ffn(normed_hidden, valid)``."""

    def prefill(self, x, positions, seq_lens, cache, slots, block_tables=None, ctx_lens=None, block_size=None):
        a, cache = self.self_attn.prefill(self.input_layernorm(x), positions, seq_lens, cache, slots, block_tables,
                                          ctx_lens, block_size)
        h = x + a
        return h + self.ffn(self.post_attention_layernorm(h), real_tokens(cache, slots)), cache

    def decode(self, x, positions, cache, slots, block_tables, seq_lens, block_size):
        a, cache = self.self_attn.decode(self.input_layernorm(x), positions, cache, slots, block_tables,
                                         seq_lens, block_size)
        h = x + a
        return h + self.ffn(self.post_attention_layernorm(h), real_tokens(cache, slots)), cache


class CausalLM(nn.Module):
    """Subclasses set embed_tokens, layers, norm and lm_head."""

    def prefill(self, tokens, positions, seq_lens, cache=None, slots=None, block_tables=None, ctx_lens=None,
                block_size: int | None = None):
        """tokens [B, S] -> final hidden states [B, S, H] (before the last norm), cache.

        With ``block_tables`` [B, nb] (and ``block_size``): a chunk of a longer prompt, the last
        seq_lens[b] positions of a context of ctx_lens[b] tokens whose earlier rows are already
        in the cache; attention reads the whole context from the cache (layers/prefill_attention.py)."""
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h, cache = layer.prefill(h, positions, seq_lens, cache, slots, block_tables, ctx_lens, block_size)
        return h, cache

    def decode(self, tokens, positions, cache, slots, block_tables, seq_lens, block_size: int):
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h, cache = layer.decode(h, positions, cache, slots, block_tables, seq_lens, block_size)
        return h, cache

    def logits(self, h):
        return self.lm_head(self.norm(h)).astype(jnp.float32)

    def __call__(self, tokens):
        """Used only to create parameters (init)."""
        B, S = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(S), (B, S))
        h, _ = self.prefill(tokens, pos, jnp.full((B,), S))
        return self.logits(h)
