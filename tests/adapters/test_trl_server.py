"""TRL's own ``VLLMClient`` (TRL 1.16, unchanged but for its "vLLM installed" gate, patched here
only) against ``python -m polynya.client.server``: every call that needs no NCCL, with content
checked against a local forward of the same tiny model."""
from __future__ import annotations

import math
import subprocess
import sys
import time

import httpx
import pytest
import torch

vllm_client = pytest.importorskip("trl.generation.vllm_client")

from polynya.distributed import free_port
from polynya.models import load_model, tiny_tokenizer

PROMPTS = [[40, 41, 42, 43], [5, 6, 7, 8, 9, 10]]


@pytest.fixture(scope="module")
def server():
    port = free_port()
    cfg = '{"train": {"zero_stage": 0}, "sampling": {"num_blocks": 128, "block_size": 8}}'
    proc = subprocess.Popen([sys.executable, "-m", "polynya.client.server", "--model", "tiny:qwen3",
                             "--dtype", "float32", "--port", str(port), "--config-json", cfg])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("polynya.client.server did not come up")
        time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def trl_client(server):
    mp = pytest.MonkeyPatch()
    mp.setattr(vllm_client, "is_vllm_available", lambda *a, **k: True)  # the test's only patch
    try:
        yield vllm_client.VLLMClient(base_url=server)
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def model():
    return load_model("tiny:qwen3", seed=0)  # the server's weights (same spec, same seed)


def _local_logprobs(model, prompt, completion):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def _local_scores(model, seq, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0, :-1].float()
    return torch.log_softmax(logits / temperature, dim=-1)  # row i scores seq[i + 1]


def test_get_sequence_logprobs_equals_local_forward(trl_client, model):
    """TRL's ``get_sequence_logprobs`` (its request and parsing, unchanged): top-k, ranks and the
    actual token's log-prob equal a local forward at the temperature, including a token far
    outside the top-k (vLLM reports it at its rank, so TRL gets its log-prob, not -inf)."""
    g = torch.Generator().manual_seed(3)
    temperature, k = 0.7, 4
    seqs, plens = [], []
    for prompt in PROMPTS:
        worst = int(_local_scores(model, prompt + [0], temperature)[-1].argmin())  # least likely next
        seqs.append(prompt + [worst] + torch.randint(0, 512, (5,), generator=g).tolist())
        plens.append(len(prompt))
    for chunk_size in (0, 1):  # one request, and one request per sequence sent concurrently
        out = trl_client.get_sequence_logprobs(seqs, plens, top_logprobs=k, temperature=temperature,
                                               chunk_size=chunk_size)
        for i, (seq, plen) in enumerate(zip(seqs, plens)):
            ref = _local_scores(model, seq, temperature)[plen - 1:]
            top = ref.topk(k, dim=-1)
            torch.testing.assert_close(torch.tensor(out["logprobs"][i]), top.values, atol=1e-5, rtol=0)
            assert out["logprob_token_ids"][i] == top.indices.tolist()
            actual = ref.gather(1, torch.tensor(seq[plen:])[:, None])
            torch.testing.assert_close(torch.tensor(out["actual_logprobs"][i]), actual, atol=1e-5, rtol=0)
            assert out["actual_token_ids"][i] == [[t] for t in seq[plen:]]
        assert all(math.isfinite(x[0]) for row in out["actual_logprobs"] for x in row)


def test_prompt_logprobs_response_shape_and_refusals(server, model):
    seq = PROMPTS[1] + [7, 300, 2]
    body = {"prompt": seq, "max_tokens": 1, "prompt_logprobs": 2, "n": 2, "return_tokens_as_token_ids": True}
    r = httpx.post(server + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2 and choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"]
    plp = choices[0]["prompt_logprobs"]
    assert len(plp) == len(seq) and plp[0] is None
    ref = _local_scores(model, seq, 1.0)
    for pos in range(1, len(seq)):
        entry = {int(t): v for t, v in plp[pos].items()}
        top = ref[pos - 1].topk(2)
        want = {int(t): r for r, t in enumerate(top.indices.tolist(), start=1)}
        tok = seq[pos]
        want.setdefault(tok, int((ref[pos - 1] > ref[pos - 1, tok]).sum()) + 1)
        assert {t: v["rank"] for t, v in entry.items()} == want
        assert all(v["decoded_token"] == f"token_id:{t}" for t, v in entry.items())
        got = torch.tensor([entry[t]["logprob"] for t in want])
        torch.testing.assert_close(got, ref[pos - 1, list(want)], atol=1e-5, rtol=0)
    bad = [({**body, "top_p": 0.5}, "filters"), ({**body, "prompt_logprobs": -2}, "prompt_logprobs"),
           ({**body, "prompt_logprobs": True}, "prompt_logprobs"),
           # an answer's size is bounded: k entries per prompt token, k <= 20 (vLLM's max_logprobs)
           ({**body, "prompt_logprobs": -1}, "prompt_logprobs must be an int in [0, 20]"),
           ({**body, "prompt_logprobs": 21}, "prompt_logprobs must be an int in [0, 20]")]
    for b, msg in bad:
        r = httpx.post(server + "/v1/completions", json=b, timeout=60)
        assert r.status_code == 400 and msg in r.json()["error"], r.text
    chat = {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1}
    r = httpx.post(server + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 400 and "/v1/completions" in r.json()["error"]


def test_a_request_chat_template_is_refused(server):
    """A template runs on the server with no bound on memory or time (vLLM refuses it by
    default, CVE-2025-61620): refused on both routes that render chats; the tokenizer's own
    template (with chat_template_kwargs) still renders."""
    messages = [{"role": "user", "content": "hi"}]
    bomb = "{% set x = 'a' * (400 * 1000 * 1000) %}{{ x|length }}"
    for route, body in (("/v1/chat/completions", {"messages": messages, "max_tokens": 1}),
                        ("/tokenize", {"messages": messages})):
        r = httpx.post(server + route, json={**body, "chat_template": bomb}, timeout=60)
        assert r.status_code == 400 and "chat_template is refused" in r.json()["error"], r.text
        r = httpx.post(server + route, json={**body, "chat_template": None,
                                             "chat_template_kwargs": {"enable_thinking": False}}, timeout=60)
        assert r.status_code == 200, r.text


def test_health_models_world_size_server_info(trl_client):
    assert trl_client.model == "tiny:qwen3"  # read from /v1/models in the constructor
    assert trl_client.get_world_size() == 1
    info = trl_client.get_server_info()
    assert info["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert info["weight_transfer_config"] is None


def test_generate_token_ids_with_trl_defaults(trl_client, model):
    out = trl_client.generate(PROMPTS, n=3, max_tokens=6)  # TRL's defaults: top_k=0, logprobs=0
    assert out["prompt_ids"] == PROMPTS
    assert len(out["completion_ids"]) == len(PROMPTS) * 3
    for i, (ids, lps, lp_ids) in enumerate(zip(out["completion_ids"], out["logprobs"], out["logprob_token_ids"])):
        assert 1 <= len(ids) <= 6 and len(lps) == len(ids)
        assert [t[0] for t in lp_ids] == ids and all(len(x) == 1 for x in lps)
        ref = _local_logprobs(model, PROMPTS[i // 3], ids)
        torch.testing.assert_close(torch.tensor([x[0] for x in lps]), ref, atol=1e-4, rtol=1e-4)
    assert len({tuple(c) for c in out["completion_ids"][:3]}) > 1  # top_k=0 is "off", not greedy


def test_top_k_one_is_greedy(trl_client, model):
    out = trl_client.generate([PROMPTS[0]], n=3, max_tokens=5, top_k=1)
    assert len({tuple(c) for c in out["completion_ids"]}) == 1
    ids = torch.tensor([PROMPTS[0]])
    greedy = model.generate(ids, max_new_tokens=5, do_sample=False)[0, len(PROMPTS[0]):].tolist()
    assert out["completion_ids"][0] == greedy[:len(out["completion_ids"][0])]


def test_text_prompts_and_completion_text(trl_client, server):
    tok = tiny_tokenizer()
    texts = ["How many apples did the farmer sell?", "SELECT name FROM"]
    out = trl_client.generate(texts, n=2, max_tokens=5)
    assert out["prompt_ids"] == [tok.encode(t) for t in texts]
    raw = httpx.post(server + "/v1/completions", json={"prompt": texts[0], "n": 2, "max_tokens": 5},
                     timeout=60).json()
    for c in raw["choices"]:
        assert c["text"] == tok.decode(c["token_ids"], skip_special_tokens=True)


def test_chat(trl_client):
    tok = tiny_tokenizer()
    convs = [[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 plus 2?"}],
             [{"role": "user", "content": "Name a river."}]]
    out = trl_client.chat(convs, n=2, max_tokens=4)
    for conv, got in zip(convs, out["prompt_ids"]):
        want = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        assert got == list(want["input_ids"] if hasattr(want, "keys") else want)
    assert len(out["completion_ids"]) == 4 and all(len(lp) == len(c) for lp, c in
                                                   zip(out["logprobs"], out["completion_ids"]))


def test_reset_close_and_what_is_refused(trl_client):
    trl_client.reset_prefix_cache()
    trl_client.close_communicator()  # nothing open: a no-op, as with vLLM
    with pytest.raises(Exception, match="repetition_penalty"):
        trl_client.generate(PROMPTS, repetition_penalty=1.3)
    with pytest.raises(RuntimeError, match="weight-transfer engine"):
        trl_client.init_communicator(device="cpu")  # TRL's own check reads /server_info


def test_prompt_logprobs_on_a_client_that_cannot_score_is_501_before_generating(tmp_path):
    """A client without prompt scoring (e.g. the Ray client): 501 naming the cause, and nothing
    was generated for the request."""
    from fastapi.testclient import TestClient
    from polynya.client.server import create_app

    class NoScoring:  # the client API minus prompt_logprobs_async; counts generate calls
        calls = 0

        async def generate_async(self, prompts, params):
            NoScoring.calls += 1
            raise AssertionError("generate must not run")

    app = create_app(NoScoring(), run_dir=tmp_path)
    with TestClient(app) as http:
        r = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1, "prompt_logprobs": 2})
    assert r.status_code == 501 and "cannot score prompts" in r.json()["error"], r.text
    assert NoScoring.calls == 0
