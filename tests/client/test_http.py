"""The HTTP client and server: RL round trip (colocated and split), 4xx for malformed payloads
with the server staying up, bearer token, body limit, and the vLLM-style ecosystem routes."""

import json
import math
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import save as st_save

import polynya
from polynya import RolloutBatch, SamplingParams
from polynya.client.codec import encode_batch
from polynya.distributed import free_port
from polynya.sync import SyncGroup

from .common import PROMPTS, rl_round_trip, tiny_config

TOKEN = "s3cret"
LIMIT = 1 << 16


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("run")


@pytest.fixture(scope="module")
def client(run_dir):
    cfg = tiny_config("http", api_token=TOKEN, max_body_bytes=LIMIT, run_dir=str(run_dir))
    with polynya.create_rl_client(cfg) as c:
        yield c


@pytest.fixture()
def slow_decode(client):
    """Each sampler step >= 10 ms for one test: requests asked for 120-160 tokens are still
    decoding when the test acts on them, however late a loaded machine schedules it."""
    runner = client.server.client.samplers[0].backend.runner
    run_step = runner.run

    def slow_step(*args, **kwargs):
        time.sleep(0.01)
        return run_step(*args, **kwargs)

    runner.run = slow_step
    yield
    runner.run = run_step


@pytest.fixture()
def raw(client):
    with httpx.Client(
        base_url=client.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60
    ) as h:
        yield h


def test_http_round_trip_colocated(client):
    assert client.url.startswith("http://127.0.0.1:")
    rl_round_trip(client)


def test_http_round_trip_split():
    with polynya.create_rl_client(tiny_config("http", colocate=False)) as c:
        assert rl_round_trip(c)["version"] == 1
        # no api_token given: the embedded server still has one, which only this client knows
        assert c.server.token and len(c.server.token) >= 40
        assert httpx.post(c.url + "/rl/step", timeout=30).status_code == 401


def _batch_tensors(**override):
    t = {
        "prompt_ids": torch.tensor([1, 2, 3, 4, 5]),
        "prompt_lens": torch.tensor([3, 2]),
        "response_ids": torch.tensor([6, 7, 8]),
        "response_lens": torch.tensor([2, 1]),
        "advantages": torch.tensor([1.0, -1.0]),
    }
    t.update(override)
    return st_save({k: v for k, v in t.items() if v is not None})


@pytest.mark.parametrize(
    "path, kwargs, status, match",
    [
        ("/rl/generate", dict(content=b"{not json"), 400, "malformed JSON"),
        ("/rl/generate", dict(json=[1, 2]), 400, "object"),
        ("/rl/generate", dict(json={"prompts": "hello"}), 400, "token-id"),
        ("/rl/generate", dict(json={"prompts": [[1, 2]], "params": {"beams": 4}}), 400, "unknown"),
        ("/rl/generate", dict(json={"prompts": [[1, 2]], "sampling_params": {"max_tokens": 2}}), 400,
         "unknown field(s) ['sampling_params']"),
        ("/rl/generate", dict(json={"prompts": [[1, 2]], "params": {"n": 0}}), 400, "n must be"),
        ("/rl/generate", dict(json={"prompts": [[1, 9999]]}), 400, "vocab"),
        ("/rl/forward_backward", dict(content=b"\x00garbage"), 400, "safetensors"),
        (
            "/rl/forward_backward",
            dict(content=_batch_tensors(prompt_ids=torch.tensor([1.0, 2, 3, 4, 5]))),
            400,
            "dtype",
        ),
        (
            "/rl/forward_backward",
            dict(content=_batch_tensors(prompt_ids=torch.ones(5, 1, dtype=torch.long))),
            400,
            "dimension",
        ),
        (
            "/rl/forward_backward",
            dict(content=_batch_tensors(prompt_lens=torch.tensor([3, 3]))),
            400,
            "sum",
        ),
        (
            "/rl/forward_backward",
            dict(content=_batch_tensors(advantages=torch.ones(3))),
            400,
            "advantages",
        ),
        ("/rl/compute_logprobs", dict(content=_batch_tensors(response_lens=None)), 400, "missing"),
        ("/rl/sleep", dict(json={"engine": "gpu"}), 400, "engine"),
        ("/rl/save", dict(json={"path": 3}), 400, "path"),
        ("/v1/completions", dict(json={"prompt": [[5, 6], []]}), 400, "token ids"),
        ("/v1/completions", dict(json={"prompt": [5], "repetition_penalty": 1.2}), 400, "repetition_penalty"),
        ("/v1/completions", dict(json={"prompt": [5], "best_of": 2}), 400, "best_of"),
        # /inference/v1/generate refuses what its sampler would ignore, as /v1/completions does
        ("/inference/v1/generate", dict(json={"token_ids": [5], "sampling_params": {
            "repetition_penalty": 1.3}}), 400, "repetition_penalty=1.3 is not supported"),
        ("/inference/v1/generate", dict(json={"token_ids": [5], "sampling_params": {
            "stop": ["\n\n"]}}), 400, "'stop' is not supported"),
        ("/inference/v1/generate", dict(json={"token_ids": [5], "sampling_params": {
            "best_of": 2}}), 400, "unsupported request field(s) ['best_of']"),
        ("/inference/v1/generate", dict(json={"token_ids": [5], "sampling_params": {
            "min_tokens": 17}}), 400, "min_tokens must be in [0, max_tokens=16]"),
        ("/inference/v1/generate", dict(json={"token_ids": [5], "sampling_params": {
            "prompt_logprobs": 1}}), 400, "prompt_logprobs"),
        ("/init_weight_transfer_engine", dict(json={}), 400, "init_info"),
        ("/update_weights", dict(json={"update_info": {"names": []}}), 409, "start_weight_update"),
    ],
)
def test_malformed_requests_get_4xx(raw, path, kwargs, status, match):
    r = raw.post(path, **kwargs)
    assert r.status_code == status, r.text
    assert match in r.json()["error"]
    assert raw.get("/health").json() == {"status": "ok"}


def test_auth_and_body_limit(client, raw):
    assert httpx.post(client.url + "/rl/step", timeout=30).status_code == 401
    bad = httpx.post(client.url + "/rl/step", headers={"Authorization": "Bearer nope"}, timeout=30)
    assert bad.status_code == 401 and "token" in bad.json()["error"]
    assert httpx.get(client.url + "/health", timeout=30).status_code == 200  # health needs no token
    big = encode_batch(RolloutBatch([[1] * 5000] * 2, [[2] * 5000] * 2, advantages=torch.ones(2)))
    assert len(big) > LIMIT
    r = raw.post("/rl/forward_backward", content=big)
    assert r.status_code == 413 and "limit" in r.json()["error"]

    def chunks():
        for _ in range(4):
            yield b"x" * (LIMIT // 2)

    assert (
        raw.post("/rl/forward_backward", content=chunks()).status_code == 413
    )  # streamed, no length
    with pytest.raises(ValueError, match="413"):
        client.forward_backward(
            RolloutBatch([[1] * 5000] * 2, [[2] * 5000] * 2, advantages=torch.ones(2))
        )
    assert (
        client.generate([PROMPTS[0]], SamplingParams(max_tokens=2))[0][0].finish_reason == "length"
    )


def test_ecosystem_generation_routes(raw):
    r = raw.post(
        "/v1/completions",
        json={
            "model": "m",
            "prompt": [[5, 6, 7], [8, 9]],
            "max_tokens": 4,
            "temperature": 0,
            "n": 2,
            "logprobs": 0,
        },
    ).json()
    assert len(r["choices"]) == 4 and all(len(c["token_ids"]) == 4 for c in r["choices"])
    assert r["usage"]["prompt_tokens"] == 5 and isinstance(r["choices"][0]["text"], str)
    assert len(r["choices"][0]["logprobs"]["token_logprobs"]) == 4
    g = raw.post(
        "/inference/v1/generate",
        json={
            "model": "m",
            "token_ids": [5, 6, 7],
            "stream": False,
            "sampling_params": {"max_tokens": 3, "temperature": 0, "logprobs": 0},
        },
    ).json()
    assert g["choices"][0]["token_ids"] == r["choices"][0]["token_ids"][:3]  # greedy: same tokens
    assert len(g["choices"][0]["logprobs"]["content"]) == 3 and g["usage"]["prompt_tokens"] == 3
    assert raw.get("/get_world_size").json() == {"world_size": 1}
    assert raw.post("/reset_prefix_cache").status_code == 200
    assert raw.post("/sleep", params={"level": 1}).status_code == 200
    assert raw.post("/wake_up").status_code == 200
    assert raw.post("/pause").json() == {"status": "paused", "mode": "keep", "in_flight_at_pause": 0}
    result = {}
    t = threading.Thread(
        target=lambda: result.update(
            r=raw.post(
                "/inference/v1/generate",
                json={"token_ids": [5], "sampling_params": {"max_tokens": 2}},
            )
        )
    )
    t.start()
    t.join(1.0)
    assert t.is_alive()  # held while paused
    assert raw.post("/resume").status_code == 200
    t.join(30)
    assert result["r"].status_code == 200


def test_pause_abort_returns_partial_outputs(client, raw, slow_decode):
    """/pause?mode=abort with a /inference/v1/generate and an n=2 /v1/completions in flight:
    both answer at once with partial tokens (the greedy prefix, log-probs equal to a fresh
    greedy run of that length), finish_reason "abort"; new requests wait for /resume; the
    sampler holds no page and no request afterwards."""
    sampler = client.server.client.samplers[0]
    prompts, answers = [[5, 6, 7, 8], [40, 41, 42]], {}
    bodies = {
        "generate": ("/inference/v1/generate", {"token_ids": prompts[0], "sampling_params": {
            "max_tokens": 160, "temperature": 0, "logprobs": 0, "ignore_eos": True}}),
        "completions": ("/v1/completions", {"prompt": prompts[1], "max_tokens": 160, "n": 2,
                                            "temperature": 0, "logprobs": 0, "ignore_eos": True}),
    }

    def post(name):
        path, body = bodies[name]
        answers[name] = raw.post(path, json=body)

    def until(count, value: int) -> int:
        while (got := count(sampler.stats())) < value:
            assert all(t.is_alive() for t in threads)
            time.sleep(0.002)
        return got

    def prompt_tokens(st):
        return st["prefill_tokens"] + st["cache_hit_tokens"]

    def decode_steps(st):
        return st["decode_steps"]

    threads = [threading.Thread(target=post, args=(k,)) for k in bodies]
    start = prompt_tokens(sampler.stats())
    for t in threads:
        t.start()
    until(prompt_tokens, start + 7)  # both requests are in the engine,
    until(decode_steps, until(decode_steps, 0) + 3)  # and each sample has >= 4 tokens
    paused = raw.post("/pause", params={"mode": "abort"}).json()
    assert paused == {"status": "paused", "mode": "abort", "in_flight_at_pause": 2}
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    held = threading.Thread(target=post, args=("generate",))
    held.start()
    held.join(0.5)
    assert held.is_alive()  # paused: new requests wait
    stats = sampler.stats()
    assert stats["blocks_in_use"] == 0 and stats["aborted_requests"] >= 2
    gen = answers["generate"].json()["choices"][0]
    comp = answers["completions"].json()["choices"]
    assert gen["finish_reason"] == "abort" and [c["finish_reason"] for c in comp] == ["abort"] * 2
    assert raw.post("/resume").status_code == 200
    held.join(60)
    assert answers["generate"].json()["choices"][0]["finish_reason"] == "length"
    partial = [(prompts[0], gen["token_ids"], [c["logprob"] for c in gen["logprobs"]["content"]])]
    partial += [(prompts[1], c["token_ids"], c["logprobs"]["token_logprobs"]) for c in comp]
    for prompt, ids, lps in partial:
        assert 4 <= len(ids) < 160 and len(lps) == len(ids)
        ref = client.generate([prompt], SamplingParams(temperature=0, max_tokens=len(ids), logprobs=True,
                                                       stop_token_ids=()))[0][0]
        assert ids == ref.token_ids
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref.logprobs), rtol=0, atol=1e-5)


def test_pause_abort_stops_more_requests_than_the_server_has_threads(client, raw, slow_decode):
    """40 generate requests (more than the server's default executor threads, at most 32):
    /pause?mode=abort stops every one of them, the ones still queued for a thread included."""
    sampler = client.server.client.samplers[0]
    answers: list = []
    body = {"token_ids": [7, 8, 9], "sampling_params": {"max_tokens": 120, "temperature": 0,
                                                        "ignore_eos": True}}
    steps = sampler.stats()["decode_steps"]
    threads = [threading.Thread(target=lambda: answers.append(raw.post("/inference/v1/generate", json=body)))
               for _ in range(40)]
    for t in threads:
        t.start()
    while sampler.stats()["decode_steps"] < steps + 2:
        assert any(t.is_alive() for t in threads)
        time.sleep(0.002)
    assert raw.post("/pause", params={"mode": "abort"}).json()["status"] == "paused"
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    reasons = [a.json()["choices"][0]["finish_reason"] for a in answers]
    assert reasons == ["abort"] * 40 and sampler.stats()["blocks_in_use"] == 0
    assert raw.post("/resume").status_code == 200


def test_weight_transfer_routes(client, raw):
    local = client.server.client
    trainer, sampler = local.trainer, local.samplers[0]
    raw.post(
        "/rl/forward_backward",
        content=encode_batch(
            RolloutBatch([[5, 6, 7]] * 2, [[8, 9], [10]], advantages=torch.tensor([1.0, -1.0]))
        ),
    )
    raw.post("/rl/step")
    names = [n for n, _ in trainer.module.named_parameters()]
    params = [p.detach() for _, p in trainer.module.named_parameters()]
    flat = torch.cat([p.reshape(-1) for p in params])
    info = {
        "names": names,
        "dtype_names": ["float32"] * len(names),
        "shapes": [list(p.shape) for p in params],
        "packed": True,
    }
    port = free_port()
    out = {}
    t = threading.Thread(
        target=lambda: out.update(
            init=raw.post(
                "/init_weight_transfer_engine",
                json={
                    "init_info": {
                        "master_address": "127.0.0.1",
                        "master_port": port,
                        "rank_offset": 1,
                        "world_size": 2,
                    }
                },
            )
        )
    )
    t.start()
    group = SyncGroup("127.0.0.1", port, rank=0, world_size=2, device="cpu", timeout_s=60)
    t.join(60)
    assert out["init"].status_code == 200

    def push(checksum):
        assert (
            raw.post("/start_weight_update", json={"is_checkpoint_format": True}).status_code == 200
        )
        th = threading.Thread(
            target=lambda: out.update(upd=raw.post("/update_weights", json={"update_info": info}))
        )
        th.start()
        group.broadcast(flat.clone(), 0).wait()
        th.join(60)
        assert out["upd"].status_code == 200
        return raw.post("/finish_weight_update", json={"checksum": checksum})

    old_sum, old_version = sampler.weight_checksum(), sampler.stats()["weight_version"]
    bad = push("0" * 32)  # a mismatched sync is rejected, the old weights stay
    assert bad.status_code == 400 and "checksum mismatch" in bad.json()["error"]
    assert sampler.weight_checksum() == old_sum and sampler.stats()["weight_version"] == old_version
    good = push(trainer.weight_checksum())
    assert good.status_code == 200 and good.json()["version"] == old_version + 1
    assert sampler.weight_checksum() == trainer.weight_checksum() != old_sum


def test_http_async_api(client):
    import asyncio

    async def run():
        outs = await asyncio.gather(*(client.generate_async([p], SamplingParams(max_tokens=3, seed=2))
                                      for p in PROMPTS))
        batch = RolloutBatch(PROMPTS, [o[0][0].token_ids for o in outs])
        stats, sums = await asyncio.gather(client.compute_logprobs_async(batch, entropy=True),
                                           client.weight_checksums_async())
        return outs, stats, sums

    outs, stats, sums = asyncio.run(run())
    assert [len(o[0][0].token_ids) for o in outs] == [3, 3, 3]
    assert stats.logprobs.shape == stats.entropy.shape == (3, 3) and bool(stats.mask.all())
    assert sums["trainer"] and len(sums["samplers"]) == 1
    with pytest.raises(ValueError, match="model"):
        asyncio.run(client.compute_logprobs_async(RolloutBatch([[1]], [[2]]), model="critic"))


def test_http_save_load_inside_run_dir_only(client, run_dir, tmp_path):
    before = client.weight_checksums()
    client.save(str(run_dir / "ckpt"))
    assert (run_dir / "ckpt" / "polynya" / "mp_rank_00_model_states.pt").is_file()
    client.load(str(run_dir / "ckpt"))
    assert client.weight_checksums()["trainer"] == before["trainer"]
    with pytest.raises(PermissionError, match="run directory"):
        client.save(str(tmp_path / "elsewhere"))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        client.load(str(run_dir / "missing"))
    assert not (tmp_path / "elsewhere").exists()



def test_a_skipped_step_reports_inf_over_http(client, raw):
    """JSON has no inf: the step's metrics carry non-finite numbers as strings, and the HTTP
    client gives back the float the local client returns (was ``None``)."""
    bad = RolloutBatch([[5, 6, 7]] * 2, [[8, 9], [10]], advantages=torch.tensor([3e38, -3e38]))
    client.forward_backward(bad)
    out = client.step()
    assert out["skipped"] == 1.0 and math.isinf(out["grad_norm"]), out
    assert raw.get("/health").status_code == 200


def test_metrics_codec_round_trip():
    from polynya.client.codec import decode_metrics, encode_metrics

    m = {"a": float("inf"), "b": float("-inf"), "c": float("nan"), "d": 1.5, "e": 3, "f": "x"}
    got = decode_metrics(json.loads(json.dumps(encode_metrics(m))))
    assert got["a"] == float("inf") and got["b"] == float("-inf") and math.isnan(got["c"])
    assert (got["d"], got["e"], got["f"]) == (1.5, 3, "x")


def test_embedded_server_that_cannot_start_shuts_its_engines_down(monkeypatch):
    """The in-process server's engines were built before uvicorn started; a server that never
    came up left them (and their threads and memory) behind. Now the error comes through and the
    local client is shut down."""
    from polynya.client import local, uvicorn_server
    from polynya.client.api import EngineError

    shut = []
    real_shutdown = local.LocalClient.shutdown
    monkeypatch.setattr(local.LocalClient, "shutdown",
                        lambda self: (shut.append(self), real_shutdown(self))[1])

    def refuse(config, *args, **kwargs):
        raise EngineError(f"the polynya server on {config.host}:{config.port} did not start")

    monkeypatch.setattr(uvicorn_server, "start_in_thread", refuse)
    with pytest.raises(EngineError, match="did not start"):
        polynya.create_rl_client(tiny_config("http"))
    assert len(shut) == 1
