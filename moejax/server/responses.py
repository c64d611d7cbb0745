"""The response side of the OpenAI API: whole bodies, stream chunks and the logprobs layouts (OpenAI's
legacy completions and chat forms; vLLM's echo and prompt_logprobs, which lm-eval's loglikelihood reads).
protocol.py parses the request these answer."""

from __future__ import annotations

import dataclasses
import time
import uuid

from moejax.server.chat_output import ChatOutput
from moejax.server.parsed_request import ParsedRequest


def new_id(chat: bool, base: str | None = None) -> str:
    """The response's id: the client's request_id (body) or X-Request-Id (header) when given, as vLLM."""
    return ("chatcmpl-" if chat else "cmpl-") + (base or uuid.uuid4().hex)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


LOGPROB_FLOOR = -9999.0  # JSON has no -Infinity: OpenAI's and vLLM's stand-in for it


def token_str(tokenizer, token_id: int, as_id: bool = False) -> str:
    return f"token_id:{token_id}" if as_id else tokenizer.decode([token_id], skip_special_tokens=False)


def _logprob(x: float) -> float:
    return max(x, LOGPROB_FLOOR)


def _top_dict(alts: list[tuple[str, float]]) -> dict[str, float]:
    """{token string: logprob}, most likely first. Distinct ids can render alike (byte tokens of a partial
    UTF-8 character all show U+FFFD): the most likely of them keeps the key."""
    d: dict[str, float] = {}
    for t, lp in alts:
        d.setdefault(t, _logprob(lp))
    return d


def completion_logprobs(tokens: list[str], lps: list[float], alts: list[list[tuple[str, float]]],
                        offset0: int = 0) -> dict:
    """The legacy completions form; ``alts``: each token's alternatives (token string, logprob), descending
    (empty lists for logprobs: 0); a None logprob and alternatives: an echoed prompt's first token."""
    offsets, o = [], offset0
    for t in tokens:
        offsets.append(o)
        o += len(t)
    return {"tokens": tokens, "token_logprobs": [None if lp is None else _logprob(lp) for lp in lps],
            "top_logprobs": [None if a is None else _top_dict(a) for a in alts], "text_offset": offsets}


def _chat_entry(t: str, lp: float) -> dict:
    return {"token": t, "logprob": _logprob(lp), "bytes": list(t.encode("utf-8"))}


def chat_logprobs(tokens: list[str], lps: list[float], alts: list[list[tuple[str, float]]]) -> dict:
    return {"content": [{**_chat_entry(t, lp), "top_logprobs": [_chat_entry(a, alp) for a, alp in alt]}
                        for t, lp, alt in zip(tokens, lps, alts)]}


def logprobs_object(req: ParsedRequest, tokenizer, token_ids: list[int], lps: list[float],
                    tops: list | None, text_offset: int = 0) -> dict:
    """The choice's ``logprobs`` for these tokens; ``tops``: each token's (token id, logprob) alternatives
    from the engine (None for a token when the request asks for none)."""
    def render(t):
        return token_str(tokenizer, t, req.tokens_as_ids)
    toks = [render(t) for t in token_ids]
    alts = [[(render(i), lp) for i, lp in top] if top else [] for top in (tops or [None] * len(token_ids))]
    return chat_logprobs(toks, lps, alts) if req.chat else completion_logprobs(toks, lps, alts, text_offset)


@dataclasses.dataclass
class Output:
    """One prompt's finished generation."""
    text: str
    token_ids: list[int]
    lps: list[float] | None
    tops: list | None
    finish_reason: str
    cumulative_logprob: float | None = None  # of its tokens (None: the engine gives none): best_of keeps the highest
    prompt_logprobs: list | None = None  # engine/prompt_logprobs.PromptLogprob of prompt tokens 1.., when asked


def full_response(req: ParsedRequest, rid: str, outputs: list[Output], tokenizer) -> dict:
    """The non-streaming body: one choice an output (``sample_outputs``': req.n a prompt, in prompt order)."""
    choices = []
    for i, o in enumerate(outputs):
        lp_obj = _choice_logprobs(req, tokenizer, o, i) if req.logprobs else None
        if req.chat:
            out = req.parsing.new() if req.parsing is not None else None
            message = out.message(o.text) if out is not None else {"role": "assistant", "content": o.text}
            if req.echo:  # vLLM's: the last message's content before the answer's
                message["content"] = req.prompt_texts[0] + (message.get("content") or "")
            choice = {"index": i, "message": message, "logprobs": lp_obj,
                      "finish_reason": out.finish_reason(o.finish_reason) if out is not None else o.finish_reason}
        else:
            text = req.prompt_texts[i // req.n] + o.text if req.echo else o.text
            choice = {"index": i, "text": text, "logprobs": lp_obj, "finish_reason": o.finish_reason}
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _vllm_prompt_logprobs(req, tokenizer, o, i)
        if req.return_token_ids:
            choice["token_ids"] = list(o.token_ids)
            if len(outputs) > 1:
                choice["prompt_token_ids"] = list(req.prompts[i // req.n])
        choices.append(choice)
    n_prompt, n_out = sum(len(p) for p in req.prompts), sum(len(o.token_ids) for o in outputs)
    out = {"id": rid, "object": "chat.completion" if req.chat else "text_completion", "created": int(time.time()),
           "model": req.model, "choices": choices, "usage": usage(n_prompt, n_out)}
    if req.return_token_ids and len(outputs) == 1:
        out["prompt_token_ids"] = list(req.prompt_ids)
    if req.chat and req.prompt_logprobs is not None:  # vLLM's chat: beside the choices
        out["prompt_logprobs"] = _vllm_prompt_logprobs(req, tokenizer, outputs[0], 0)
    return out


def echo_chunk(req: ParsedRequest, rid: str, created: int, tokenizer, prompt_logprobs, index: int = 0) -> dict:
    """A streamed echo's first chunk of a choice (after chat's role chunk): its prompt's text (chat: the last
    message's, as content) and, on completions with logprobs, the prompt tokens' (None first, as in the whole
    response), with vLLM's prompt_logprobs when asked; the completion's chunks follow."""
    o = Output("", [], [], [], None, prompt_logprobs=prompt_logprobs)
    lp = _choice_logprobs(req, tokenizer, o, 0) if req.logprobs and not req.chat else None
    if req.chat:
        choice = {"index": index, "delta": {"content": req.prompt_texts[0]}, "logprobs": None, "finish_reason": None}
    else:
        choice = {"index": index, "text": req.prompt_texts[0], "logprobs": lp, "finish_reason": None}
    return _with_prompt_logprobs(req, tokenizer, prompt_logprobs, {
        "id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion", "created": created,
        "model": req.model, "choices": [choice],
        "usage": usage(len(req.prompt_ids), 0) if req.continuous_usage else None})


def _with_prompt_logprobs(req: ParsedRequest, tokenizer, prompt_logprobs, chunk: dict) -> dict:
    """A stream's first chunk of a choice with vLLM's prompt_logprobs when asked (completions: on the choice,
    chat: beside the choices, as in the whole response)."""
    if req.prompt_logprobs is not None and prompt_logprobs is not None:
        entries = _vllm_prompt_logprobs(req, tokenizer, Output("", [], [], [], None, prompt_logprobs=prompt_logprobs), 0)
        (chunk if req.chat else chunk["choices"][0])["prompt_logprobs"] = entries
    return chunk


def stream_chunk(req: ParsedRequest, rid: str, created: int, delta_text: str | None, token_ids: list[int],
                 lps: list[float] | None, finish_reason: str | None, tokenizer, first: bool = False,
                 text_offset: int = 0, tops: list | None = None, completion_tokens: int | None = None,
                 parser: ChatOutput | None = None, index: int = 0, prompt_logprobs: list | None = None) -> dict:
    """``completion_tokens``: the tokens so far, for stream_options.continuous_usage_stats (usage: null else);
    ``parser``: the stream's ChatOutput (req.parsing.new()), which makes the chat delta; ``index``: the choice's;
    ``prompt_logprobs``: the choice's prompt's (its first chunk of tokens, when the request asks for them)."""
    lp_obj = None
    if req.logprobs and token_ids:
        lp_obj = logprobs_object(req, tokenizer, token_ids, lps or [], tops, text_offset)
    if req.chat:
        if first:
            delta = {"role": "assistant", "content": ""}
        elif parser is not None:
            delta = parser.feed(delta_text or "", final=finish_reason is not None)
            finish_reason = parser.finish_reason(finish_reason)
        else:
            delta = {"content": delta_text} if delta_text or finish_reason is None else {}
        choice = {"index": index, "delta": delta, "logprobs": lp_obj, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": delta_text or "", "logprobs": lp_obj, "finish_reason": finish_reason}
    if req.return_token_ids:
        choice["token_ids"] = list(token_ids)
    return _with_prompt_logprobs(req, tokenizer, prompt_logprobs, {
        "id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion", "created": created,
        "model": req.model, "choices": [choice],
        "usage": usage(len(req.prompt_ids), completion_tokens) if req.continuous_usage else None})


def usage_chunk(req: ParsedRequest, rid: str, created: int, completion_tokens: int) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion", "created": created,
            "model": req.model, "choices": [], "usage": usage(len(req.prompt_ids), completion_tokens)}


def _choice_logprobs(req: ParsedRequest, tokenizer, o: Output, i: int) -> dict:
    """Choice i's logprobs; with a completion's echo its prompt's first, None for the prompt's first token
    (vLLM's layout, which lm-eval's loglikelihood reads)."""
    if not (req.echo and not req.chat):
        return logprobs_object(req, tokenizer, o.token_ids, o.lps or [], o.tops)

    def render(t):
        return token_str(tokenizer, t, req.tokens_as_ids)
    prompt, entries = req.prompts[i // req.n], o.prompt_logprobs or []
    lps = [None, *(e.logprob for e in entries), *(o.lps or [])]
    alts = [None, *([(render(t), lp) for t, lp in echoed_alternatives(t, e, req.top_logprobs)]
                    for t, e in zip(prompt[1:], entries)),
            *([(render(t), lp) for t, lp in top] if top else [] for top in (o.tops or [None] * len(o.token_ids)))]
    return completion_logprobs([render(t) for t in prompt + o.token_ids], lps, alts)


def echoed_alternatives(token: int, e, n: int) -> list[tuple[int, float]]:
    """An echoed prompt token's top_logprobs (vLLM's): the token itself first, then its n most likely without
    it, n + 1 entries at most: n when the token is among them, n + 1 when not (OpenAI's "up to logprobs + 1");
    ``e``: its engine/prompt_logprobs.PromptLogprob."""
    return [(token, e.logprob), *((a, lp) for a, lp in e.top[:n] if a != token)][:n + 1]


def _vllm_prompt_logprobs(req: ParsedRequest, tokenizer, o: Output, i: int) -> list:
    """vLLM's prompt_logprobs: None, then per prompt token {token id: {logprob, rank, decoded_token}}, the token
    first, then its req.prompt_logprobs most likely (ranks 1, 2, ...)."""
    def entry(t, lp, rank):
        return {"logprob": _logprob(lp), "rank": rank, "decoded_token": token_str(tokenizer, t, req.tokens_as_ids)}
    out: list = [None]
    for t, e in zip(req.prompts[i // req.n][1:], o.prompt_logprobs or []):
        d = {str(t): entry(t, e.logprob, e.rank)}
        for r, (a, lp) in enumerate(e.top[:req.prompt_logprobs], 1):
            d.setdefault(str(a), entry(a, lp, r))
        out.append(d)
    return out
