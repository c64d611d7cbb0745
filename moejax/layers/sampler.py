"""Token sampling inside the compiled step: greedy, temperature, top-k, top-p, per-request seed,
and the top log-probabilities of the raw distribution.

Each row gets its own PRNG key from (seed, position), so a seeded request
samples the same tokens whatever else shares its batch.

What the batch needs (any row sampling at temperature > 0, any row asking for top logprobs) is a
static ``SampleMode`` the host knows, not a ``lax.cond`` on the device: XLA:GPU reads a
conditional's predicate back to the host before it launches the branch, which made every step's
dispatch wait for the step itself (measured on the H200: the decode call returned only after the
device had run it, so the host could not build the next step meanwhile). A batch's mode picks one
of six small compiled sampler variants, seven with the controls one below (model_runner.py runs
sampling as its own program):
greedy-only batches skip the random draw, and batches where no row truncates (top-k off, top-p 1)
skip the vocabulary sort: their draw is the same Gumbel-max over the vocabulary in token order that
the truncating path makes with nothing dropped, so the tokens are identical either way.

The sampling controls (vLLM's: a vocabulary mask, bad words, logit bias, presence / frequency /
repetition penalties, min_p; min_tokens is a mask) run only in the one ``controls`` variant, picked
for a batch where some row uses one; a batch where none does runs the variants above, unchanged. The
controls variant is the general one (random, top logprobs, truncation: greedy rows still take the
argmax, and a row with neither top-k nor top-p drops nothing), so it adds one program a rows bucket;
its cost over the plain sampling variant is mostly the vocabulary sort, which a batch with top-p
(DeepSeek's generation_config.json default 0.95) makes anyway.
vLLM's order: mask, bad words, bias, penalties (the greedy argmax is taken here), temperature, min_p,
top-k / top-p.

The vocabulary mask (``SampleControls.mask``) is the interface structured outputs feed: int32 [B, W],
W = ceil(V / 32), bit ``t % 32`` of word ``t // 32`` set where token t may be sampled, the layout of
xgrammar's token bitmask (``xgrammar.allocate_token_bitmask(B, V)``, filled row by row by
``GrammarMatcher.fill_next_token_bitmask``). The host ANDs every mask a row has (its
allowed_token_ids, min_tokens' stop tokens, a grammar's) into that one array
(engine/sample_controls.py: ``ControlBuilder.step``'s ``row_masks`` hook); the sampler sets masked
logits to -inf before anything else, as xgrammar's ``apply_token_bitmask_inplace`` does.

Penalties read a row of the token history (``history_row``: int32 [B, V], 2 x output count + 1 if
in the prompt) and bad words its last tokens (``recent``); the runner keeps both on the device, one
row a sequence, and the controls variant records each sampled token there in the same program
(``record``), so a token still in flight (async scheduling) is counted without the host seeing it.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for (vLLM's and OpenAI's limit)
MAX_LOGIT_BIAS = 300  # logit_bias entries a request may give (static: the bias arrays' width)
MAX_BAD_WORDS = 32  # token sequences of bad_words a request may have (each word tokenised both ways)
MAX_BAD_WORD_TOKENS = 16  # tokens of one bad word (its last is banned after the others)
RECENT = MAX_BAD_WORD_TOKENS - 1  # last output tokens a history row keeps for bad words
MASK_BITS = 32  # tokens per word of the vocabulary mask


def mask_words(vocab_size: int) -> int:
    """Words of a row of the vocabulary mask."""
    return -(-vocab_size // MASK_BITS)


def _sample_rows(logits, temperature, top_p, top_k, keys, min_p=None):
    V = logits.shape[-1]
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    if min_p is not None:  # vLLM's: after the temperature, tokens below min_p x the top probability go
        probs = jax.nn.softmax(scaled, axis=-1)
        scaled = jnp.where(probs < min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True), -jnp.inf, scaled)
    sorted_logits, sorted_idx = jax.lax.sort_key_val(-scaled, jnp.broadcast_to(jnp.arange(V), scaled.shape))
    sorted_logits = -sorted_logits
    rank = jnp.arange(V)[None, :]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    drop = rank >= k[:, None]
    probs = jax.nn.softmax(jnp.where(drop, -jnp.inf, sorted_logits), axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    drop |= (jnp.cumsum(probs, axis=-1) - probs) >= top_p[:, None]
    # The draw (Gumbel-max) runs over the vocabulary in token order, the kept set mapped back: each
    # token's noise is its own, not its sort rank's, so two near-equal logits whose order a last-bit
    # difference swaps (another parallel layout, another batch) do not swap their draws.
    drop_vocab = jnp.zeros_like(drop).at[jnp.arange(drop.shape[0])[:, None], sorted_idx].set(drop)
    return jax.vmap(jax.random.categorical)(keys, jnp.where(drop_vocab, -jnp.inf, scaled))


class SampleMode(NamedTuple):
    """What a batch's sampling needs, known on the host (static: one compiled variant each)."""
    random: bool = True  # some row samples (temperature > 0); else every row is greedy
    top: bool = True  # some row asks for top logprobs
    truncate: bool = True  # some sampling row has top-k or top-p (the vocabulary sort); only with random
    controls: bool = False  # some row uses a sampling control: the one general variant (CONTROLS)

    @classmethod
    def of_request(cls, p) -> "SampleMode":
        """What one request's SamplingParams need without controls (SamplingParams.sample_mode keeps it)."""
        random = p.temperature > 0
        return cls(random, bool(p.top_logprobs), random and (p.top_k > 0 or p.top_p < 1.0))

    @classmethod
    def of(cls, params) -> "SampleMode":
        """The mode of a batch of SamplingParams: what any of them needs (one pass over a set of few modes)."""
        modes = {p.sample_mode for p in params}
        if CONTROLS in modes:
            return CONTROLS
        return cls(*(any(m[i] for m in modes) for i in range(3)))

    @classmethod
    def all(cls) -> list["SampleMode"]:
        """Every distinct mode (what start-up compilation builds)."""
        return [cls(r, t, c) for r in (False, True) for t in (False, True)
                for c in ((False, True) if r else (False,))] + [CONTROLS]


CONTROLS = SampleMode(True, True, True, True)


class SampleControls(NamedTuple):
    """The controls of a batch's rows (the controls variant's input; a JAX pytree). B rows."""
    mask: jax.Array  # int32 [B, mask_words(V)]: the vocabulary mask (module docstring), all ones = no mask
    bias_ids: jax.Array  # int32 [B, MAX_LOGIT_BIAS]: logit_bias tokens, V where unused
    bias: jax.Array  # float32 [B, MAX_LOGIT_BIAS]: added to those logits
    bad_words: jax.Array  # int32 [B, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS]: each right-aligned, -1 before it
    presence: jax.Array  # float32 [B]: presence_penalty (0 off)
    frequency: jax.Array  # float32 [B]: frequency_penalty (0 off)
    repetition: jax.Array  # float32 [B]: repetition_penalty (1 off)
    min_p: jax.Array  # float32 [B] (0 off)
    rows: jax.Array  # int32 [B]: the row's history row (History), -1: none (no penalty, no bad-word prefix)


class History(NamedTuple):
    """The token history of the sequences using penalties or multi-token bad words, one row each (the
    device state of the controls variant: the runner keeps it, ``record`` updates it)."""
    counts: jax.Array  # int32 [S, V]: 2 x the output count of each token + 1 if it is in the prompt
    recent: jax.Array  # int32 [S, RECENT]: the last output tokens, right-aligned, -1 before the first


def unpack_mask(mask, vocab_size: int):
    """The vocabulary mask [B, W] -> bool [B, V], True where a token may be sampled."""
    bits = (mask[:, :, None] >> jnp.arange(MASK_BITS, dtype=jnp.int32)) & 1
    return bits.reshape(mask.shape[0], -1)[:, :vocab_size].astype(bool)


def apply_controls(logits, c: SampleControls, history_row, recent):
    """vLLM's processing of the logits before the temperature: the mask (-inf), bad words (a word's last
    token -inf where the row's last output tokens are the rest of it), logit bias (added), then the
    penalties over ``history_row`` [B, V] (History.counts' rows): repetition divides a positive logit
    of a token seen in the prompt or the output by the penalty and multiplies a negative one, then
    frequency x the output count and presence x (count > 0) are subtracted."""
    B, V = logits.shape
    rows = jnp.arange(B)[:, None]
    x = jnp.where(unpack_mask(c.mask, V), logits, -jnp.inf)
    prefix, last = c.bad_words[:, :, :-1], c.bad_words[:, :, -1]
    hit = jnp.all((prefix < 0) | (prefix == recent[:, None, :]), axis=-1) & (last >= 0)
    x = x.at[rows, jnp.where(hit, last, V)].set(-jnp.inf, mode="drop")
    x = x.at[rows, c.bias_ids].add(c.bias, mode="drop")
    out_count = (history_row >> 1).astype(jnp.float32)
    seen = history_row > 0
    penalty = jnp.where(seen, c.repetition[:, None], 1.0)
    x = jnp.where(x > 0, x / penalty, x * penalty)
    return x - c.frequency[:, None] * out_count - c.presence[:, None] * (out_count > 0)


def read_history(history: History, rows):
    """The history rows of a batch ([B, V] counts, [B, RECENT] recent tokens); a row -1 reads none."""
    at = jnp.maximum(rows, 0)
    have = (rows >= 0)[:, None]
    return jnp.where(have, history.counts[at], 0), jnp.where(have, history.recent[at], -1)


def record(history: History, rows, tokens) -> History:
    """``history`` with each row's sampled token counted (an output token) and appended to its recent
    tokens; rows -1 change nothing."""
    S = history.counts.shape[0]
    at = jnp.where(rows >= 0, rows, S)  # out of range: dropped
    counts = history.counts.at[at, tokens].add(2, mode="drop")
    recent = jnp.concatenate([history.recent[jnp.minimum(at, S - 1), 1:], tokens[:, None]], axis=1)
    return History(counts, history.recent.at[at].set(recent, mode="drop"))


def load_history(history: History, row, first, prompt, output, recent) -> History:
    """One row of ``history`` (re)built from the host's tokens, a chunk at a time: ``first`` clears it;
    ``prompt`` / ``output`` int32 [C] (V where unused) set the prompt flag / add to the output counts;
    ``recent`` [RECENT] its last output tokens. ``row`` -1 changes nothing."""
    S, V = history.counts.shape
    at = jnp.where(row >= 0, row, S)
    base = jnp.where(first, 0, history.counts[jnp.minimum(at, S - 1)])
    in_prompt = jnp.zeros((V,), jnp.int32).at[prompt].set(1, mode="drop")
    added = jnp.zeros((V,), jnp.int32).at[output].add(2, mode="drop")
    counts = (base | in_prompt) + added
    return History(history.counts.at[at].set(counts, mode="drop"), history.recent.at[at].set(recent, mode="drop"))


def _top_logprobs(logprobs, want: bool):
    """The MAX_TOP_LOGPROBS (or vocabulary-size) best (logprob, token id) of each row, descending; zeros
    when no row asks (``want`` False), so such a batch skips the top-k."""
    B, V = logprobs.shape
    K = min(MAX_TOP_LOGPROBS, V)
    if want:
        return jax.lax.top_k(logprobs, K)
    return jnp.zeros((B, K), logprobs.dtype), jnp.zeros((B, K), jnp.int32)


def sample(logits, temperature, top_p, top_k, seeds, positions, mode: SampleMode = SampleMode(),
           controls: SampleControls | None = None, history_row=None, recent=None):
    """logits [B, V] float32; temperature/top_p float32 [B]; top_k int32 [B] (0 = off);
    seeds uint32 [B]; positions int32 [B]; with ``mode.controls``: ``controls`` and the rows' history
    (``read_history``).
    Returns (tokens int32 [B], logprob float32 [B], top logprobs float32 [B, K], top ids int32 [B, K])
    with K = min(MAX_TOP_LOGPROBS, V): the host keeps the first ``top_logprobs`` of a row.

    temperature == 0 means greedy; ``mode`` (static) may skip what no row needs. Logprobs are those of the model's raw distribution
    (log_softmax of the logits: vLLM's default ``raw_logprobs``), whatever the sampling settings."""
    raw = logits
    min_p = None
    if mode.controls:
        logits = apply_controls(logits, controls, history_row, recent)
        min_p = controls.min_p
    greedy = jnp.argmax(logits, axis=-1)
    if mode.random:
        keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)
        if mode.truncate:
            sampled = _sample_rows(logits, temperature, top_p, top_k, keys, min_p)
        else:  # nothing to drop: the same draw without the sort
            scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
            sampled = jax.vmap(jax.random.categorical)(keys, scaled)
        tokens = jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)
    else:  # the whole batch is greedy: no vocabulary sort
        tokens = greedy.astype(jnp.int32)
    logprobs = jax.nn.log_softmax(raw, axis=-1)
    top_lps, top_ids = _top_logprobs(logprobs, mode.top)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0], top_lps, top_ids.astype(jnp.int32)
