"""lm-evaluation-harness 0.4.13 end to end against the server: ``local-completions`` detects the server's
tokenizer endpoints (/tokenizer_info, /tokenize: its "remote" backend), runs a multiple-choice task made
here from local data (a task YAML over a JSON-lines file in a tmp dir: nothing from the hub) at batch
size 1 and 4 (a list of prompts a request), and every loglikelihood it gets equals the sum of the
continuation tokens' logprobs from a float64 log-softmax of ``moejax.score``'s float32 logits of the same
token ids (lm-eval's own split: context and context + continuation tokenised apart), is_greedy too."""

import json

import numpy as np
import pytest

import moejax
from moejax.tiny.checkpoint import make_random_checkpoint

from conftest import log_softmax, serving, v3_tiny_two_layers

NAME = "tiny-lm-eval"
TASK = "moejax_local_mc"
SCORE_LEN = 96  # longer than any context + continuation the task makes
WORDS = ["red", "green", "blue", "cat", "dog", "sun", "moon", "tree", "river", "stone", "bird", "fish"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_random_checkpoint(str(tmp_path_factory.mktemp("lmeval")), v3_tiny_two_layers(), seed=13, std=0.1)
    return moejax.load(path, dtype="float32", max_model_len=128, max_num_seqs=8, progress=False)


@pytest.fixture(scope="module")
def server(model):
    with serving(model, NAME) as srv:
        yield srv


def _task_dir(tmp_path, rng) -> str:
    """A multiple-choice task over local JSON lines (random questions of 3-4 choices)."""
    docs = []
    for _ in range(4):
        q = " ".join(rng.choice(WORDS, size=int(rng.integers(2, 6))))
        choices = [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 3)))) for _ in range(int(rng.integers(3, 5)))]
        docs.append({"question": f"Question: {q}\nAnswer:", "choices": [" " + c for c in choices],
                     "answer": int(rng.integers(len(choices)))})
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / f"{TASK}.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    return str(tmp_path)


def _reference(model, context: str, continuation: str) -> tuple[float, bool]:
    """lm-eval's split (api/model.py _encode_pair, the remote tokenizer: no special tokens), then the
    continuation's logprob sum and whether each of its tokens is the argmax, from score()'s logits."""
    tok = model.tokenizer
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    ctx = tok.encode(context, add_special_tokens=False)
    whole = tok.encode(context + continuation, add_special_tokens=False)
    # padded at the end to one length (one score program): causal, so the logits before the padding are unchanged
    lsm = log_softmax(model.score([whole + [0] * (SCORE_LEN - len(whole))])[0, :len(whole)])
    pos, ids = np.arange(len(ctx), len(whole)), np.array(whole)
    assert len(whole) <= SCORE_LEN and len(pos) > 0
    return float(lsm[pos - 1, ids[pos]].sum()), bool(np.all(lsm[pos - 1].argmax(-1) == ids[pos]))


@pytest.mark.parametrize("batch_size", [1, 4])
def test_lm_eval_local_completions_matches_score(server, model, tmp_path, monkeypatch, batch_size):
    lm_eval = pytest.importorskip("lm_eval", minversion="0.4.13")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    task_dir = _task_dir(tmp_path, np.random.default_rng())
    lm = LocalCompletionsAPI(base_url=server.url + "/v1/completions", model=NAME, num_concurrent=1, max_retries=1,
                             max_length=128, batch_size=batch_size)
    assert lm.tokenizer_backend == "remote"  # found /tokenizer_info and /tokenize
    tasks = TaskManager(include_path=task_dir, include_defaults=False)  # lm-eval's own thousands not indexed
    out = lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=tasks, log_samples=True, batch_size=batch_size)
    samples = out["samples"][TASK]
    assert len(samples) == 4
    n = 0
    for s in samples:
        for args, resp in zip(s["arguments"], s["resps"]):
            context, continuation = (args["arg_0"], args["arg_1"]) if isinstance(args, dict) else args
            ll, greedy = resp[0]
            want_ll, want_greedy = _reference(model, context, continuation)
            np.testing.assert_allclose(ll, want_ll, atol=1e-4)
            assert greedy == want_greedy
            n += 1
    assert n == sum(len(s["doc"]["choices"]) for s in samples)
    assert 0 <= out["results"][TASK]["acc,none"] <= 1
