"""TRL's own ``VLLMClient`` (TRL 1.16, unchanged but for its "vLLM installed" gate, patched here
only) against ``python -m polynya.client.server``: every call that needs no NCCL, with content
checked against a local forward of the same tiny model."""
from __future__ import annotations

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
    with pytest.raises(Exception, match="prompt_logprobs"):
        trl_client.get_sequence_logprobs([PROMPTS[0] + [5, 6]], [len(PROMPTS[0])])
    with pytest.raises(RuntimeError, match="weight-transfer engine"):
        trl_client.init_communicator(device="cpu")  # TRL's own check reads /server_info
