"""Through the server and the openai client (one tiny float32 server): an echoed prompt's top_logprobs in
vLLM's layout (the token itself first, then its N most likely: N + 1 entries when it is not among them)
against HF transformers' float32 log-softmax; chat's echo (vLLM's: the last message's content before the
answer, whole and streamed); prompt_logprobs 0 on a stream (each choice's first chunk, as the whole
response has them) and above 0 refused there, as vLLM does."""

import numpy as np
import openai
import pytest
import torch

import moejax

from conftest import log_softmax, openai_client, serving

NAME = "tiny-echo-stream"


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    from moejax.tiny.presets import preset
    from moejax.tiny.transformers_checkpoint import make_hf_checkpoint
    d = str(tmp_path_factory.mktemp("echo_stream"))
    return d, make_hf_checkpoint(d, preset("v3-tiny", initializer_range=0.1), seed=5)


@pytest.fixture(scope="module")
def model(hf_tiny):
    return moejax.load(hf_tiny[0], dtype="float32", max_model_len=128, max_num_seqs=4, progress=False)


@pytest.fixture(scope="module")
def client(model):
    with serving(model, NAME) as srv:
        yield openai_client(srv.url)


def test_echo_top_logprobs_hold_the_token(client, model, hf_tiny):
    """lm-eval's request (echo, logprobs N, token ids shown as "token_id:<id>"): each prompt token's
    top_logprobs is {the token: its logprob, then the N most likely but it}, cut at N + 1, so N entries when
    the token is among the N best and N + 1 when not; the values HF's (atol 1e-4)."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    V = model.config.model.vocab_size
    prompt = rng.integers(2, V, size=int(rng.integers(20, 40))).tolist()
    n = int(rng.integers(1, 4))
    r = client.completions.create(model=NAME, prompt=prompt, echo=True, logprobs=n, max_tokens=1, temperature=0,
                                  extra_body={"return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    with torch.no_grad():
        lsm = log_softmax(hf_tiny[1](torch.tensor([prompt])).logits.float().numpy()[0])
    assert lp.top_logprobs[0] is None and lp.token_logprobs[0] is None
    sizes = set()
    for pos in range(1, len(prompt)):
        tok, row = prompt[pos], lsm[pos - 1]
        items = [(int(k.removeprefix("token_id:")), v) for k, v in lp.top_logprobs[pos].items()]
        best = [int(i) for i in np.argsort(-row)[:n]]
        assert items[0][0] == tok, (seed, pos)
        assert [i for i, _ in items[1:]] == [i for i in best if i != tok][:n], (seed, pos)
        assert len(items) == (n if tok in best else n + 1), (seed, pos)
        np.testing.assert_allclose([v for _, v in items], row[[i for i, _ in items]], atol=1e-4)
        sizes.add(len(items))
    assert n + 1 in sizes, seed  # random tokens: most are not among the N best


def _content(client, stream: bool, **kw) -> str:
    r = client.chat.completions.create(model=NAME, max_tokens=4, temperature=0, stream=stream, **kw)
    if not stream:
        return r.choices[0].message.content
    return "".join(c.choices[0].delta.content or "" for c in r if c.choices)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_last_message(client, stream):
    """vLLM's chat echo: a final assistant message continued (add_generation_prompt false) comes back before
    the answer; after a user message (the generation prompt's assistant turn) nothing is echoed."""
    cont = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, here"}]
    plain = _content(client, False, messages=cont, extra_body={"add_generation_prompt": False})
    got = _content(client, stream, messages=cont, extra_body={"add_generation_prompt": False, "echo": True})
    assert got == "Sure, here" + plain
    user = [{"role": "user", "content": "hello there"}]
    assert _content(client, stream, messages=user, extra_body={"echo": True}) == _content(client, False, messages=user)


def test_stream_prompt_logprobs_zero(client):
    """prompt_logprobs 0 streamed: each choice's first chunk holds the prompt's (completions: on the choice,
    chat: beside the choices), equal to the whole response's; 1 on a stream is a 400 naming the field."""
    body = {"prompt_logprobs": 0}
    whole = client.completions.create(model=NAME, prompt="hello world", max_tokens=3, temperature=0, n=2,
                                      extra_body=body)
    want = whole.choices[0].model_extra["prompt_logprobs"]
    assert want[0] is None and len(want) > 2 and all(len(d) == 1 for d in want[1:])
    firsts = {}
    for c in client.completions.create(model=NAME, prompt="hello world", max_tokens=3, temperature=0, n=2,
                                       stream=True, extra_body=body):
        for ch in c.choices:
            firsts.setdefault(ch.index, (ch.model_extra or {}).get("prompt_logprobs"))
    assert set(firsts) == {0, 1}
    for got in firsts.values():
        assert got[0] is None and [list(d) for d in got[1:]] == [list(d) for d in want[1:]]
        np.testing.assert_allclose([v["logprob"] for d in got[1:] for v in d.values()],
                                   [v["logprob"] for d in want[1:] for v in d.values()], atol=1e-5)
    msgs = [{"role": "user", "content": "hello"}]
    chat_whole = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=2, temperature=0,
                                                extra_body=body).model_extra["prompt_logprobs"]
    chunks = [c for c in client.chat.completions.create(model=NAME, messages=msgs, max_tokens=2, temperature=0,
                                                         stream=True, extra_body=body)]
    carried = [c.model_extra["prompt_logprobs"] for c in chunks if (c.model_extra or {}).get("prompt_logprobs")]
    assert len(carried) == 1 and [list(d) if d else d for d in carried[0]] == [list(d) if d else d for d in chat_whole]
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=NAME, prompt="a", stream=True, extra_body={"prompt_logprobs": 1})
    assert ei.value.body["param"] == "prompt_logprobs"
