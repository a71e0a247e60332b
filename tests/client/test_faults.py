"""Fault injection at the server boundary (issue 16): every case gets its clear 4xx (or is
scored 0), and the state around it — trainer and sampler weight checksums, the served version,
the optimizer step, the files on disk — is compared before and after.

| case                                              | outcome                      |
|---------------------------------------------------|------------------------------|
| no / wrong token on API, docs, openapi            | 401 (``/health`` stays open) |
| save/load outside the run dir, ``..``, symlink    | 403, nothing written/read    |
| load of a planted pickle outside the run dir      | 403, the pickle never runs   |
| planted pickle inside it: no / forged manifest    | 400, the pickle never runs   |
| load of a missing dir / a file / a foreign dir    | 404 / 400 / 400              |
| load of a truncated checkpoint                    | 400 (never 500)              |
| trainer broadcasts more than announced            | 409, server alive, recovers  |
| trainer broadcasts fewer elements                 | 400 checksum mismatch        |
| finish without checksum / NaN weights / empty     | 400, version unchanged       |
| unknown name / wrong shape / int dtype            | 400 before any collective    |
| finish after a refused update; stale version      | 409                          |
| explicit ``weight_version``                       | served as given              |
| string / NaN / inf / null params, bad stop ids    | 400 on all three gen routes  |
| ints past int64, non-bool flags, template kwargs  | 400, not 500                 |
| falsy non-object sampling_params / template kwargs| 400 (null: the defaults)     |
| stop / tools / structured_outputs of a wrong type | 400 (was read as "off")      |
| non-string request_id on /inference/v1/generate   | 400, nothing generated       |
| features / stream=true / unknown top-level keys there | 400, nothing generated   |
| a save / load path with a name too long           | 400, nothing written         |
| ``/sleep?level=9``, ``/rl/sleep`` level 9          | 400, sampler keeps serving   |
| ``compute_logprobs(temperature=0)`` HTTP + engine | 400 / ValueError             |
| sequence longer than the model's positions        | 400, no gradient accumulated |
| completion with a NUL token in Txt2SQL reward     | scored 0, counted            |

Bodies that arrive too slowly through the same server: ``test_transport.py``.
"""

from __future__ import annotations

import json
import os
import pickle
import threading
import time

import httpx
import pytest
import torch
from polynya import RolloutBatch
from polynya.client.codec import encode_batch
from polynya.client.local import LocalClient
from polynya.client.server import create_app
from polynya.checksum import checksum_named_tensors
from polynya.distributed import free_port
from polynya.files import write_manifest
from polynya.models import TINY_WINDOW, load_tokenizer
from polynya.sync import SyncGroup

from .common import tiny_config
from .serving import served, snapshot

TOKEN = "t0ken"
READ_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    outside = tmp_path_factory.mktemp("outside")
    local = LocalClient(tiny_config("local"))
    app = create_app(
        local,
        api_token=TOKEN,
        max_body_bytes=1 << 21,
        run_dir=run_dir,
        read_timeout_s=READ_TIMEOUT_S,
        tokenizer=load_tokenizer("tiny:qwen3"),
    )
    with served(app) as url:
        yield dict(url=url, local=local, run=run_dir, outside=outside)
    local.shutdown()


@pytest.fixture()
def raw(server):
    with httpx.Client(
        base_url=server["url"], headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60
    ) as h:
        yield h


@pytest.fixture(scope="module")
def planted(server):
    """Everything a hostile or careless user may have left on disk, made before any snapshot."""
    run, outside = server["run"], server["outside"]
    (run / "link_out").symlink_to(outside, target_is_directory=True)
    (outside / "model.pt").write_bytes(b"not ours")
    (run / "sneaky" / "polynya").mkdir(parents=True)
    (run / "sneaky" / "polynya" / "mp_rank_00_model_states.pt").symlink_to(outside / "model.pt")
    (run / "file").write_bytes(b"\x80garbage")
    (run / "foreign").mkdir()
    (run / "foreign" / "latest").write_text("x")
    (run / "fifo" / "polynya").mkdir(parents=True)
    (run / "fifo" / "polynya" / "a.pt").write_bytes(b"x")
    write_manifest(str(run / "fifo"))  # (before the FIFO: reading one blocks forever)
    os.mkfifo(run / "fifo" / "polynya" / "b.pt")
    markers = {"marker": _plant(outside / "evil"), "bare": _plant(run / "bare")}
    markers["forged"] = _plant(run / "forged")
    write_manifest(str(run / "forged"))  # a valid manifest over the planted files
    return markers


@pytest.fixture()
def unchanged(server, planted):
    """Asserts after the test that weights, version, step and files are as before it."""
    before = snapshot(server["local"], server["run"], server["outside"])
    yield
    assert snapshot(server["local"], server["run"], server["outside"]) == before


def _error(r, status: int, needle: str) -> None:
    assert r.status_code == status, r.text
    assert needle in r.json()["error"], r.json()


# ---------------------------------------------------------------------------- security
@pytest.mark.parametrize(
    "method, path",
    [
        ("POST", "/rl/step"),
        ("GET", "/openapi.json"),
        ("GET", "/docs"),
        ("POST", "/v1/completions"),
        ("POST", "/finish_weight_update"),
        ("GET", "/nope"),
    ],
)
@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"bearer {TOKEN}", TOKEN])
def test_token_required_everywhere_but_health(server, unchanged, method, path, auth):
    headers = {} if auth is None else {"Authorization": auth}
    _error(httpx.request(method, server["url"] + path, headers=headers, timeout=30), 401, "token")
    assert httpx.get(server["url"] + "/health", timeout=30).json() == {"status": "ok"}


def test_docs_served_with_token(raw):
    assert raw.get("/openapi.json").json()["info"]["title"] == "polynya"
    assert raw.get("/docs").status_code == 200


@pytest.mark.parametrize("route", ["/rl/save", "/rl/load"])
@pytest.mark.parametrize("where", ["dotdot", "absolute", "symlink", "root", "nul"])
def test_file_routes_confined_to_run_dir(server, raw, unchanged, route, where):
    run, outside = server["run"], server["outside"]
    path = {
        "dotdot": "../escape",
        "absolute": str(outside / "ckpt"),
        "symlink": "link_out/ckpt",
        "root": str(run),
        "nul": "a\x00b",
    }[where]
    r = raw.post(route, json={"path": path})
    if where == "nul":
        _error(r, 400, "NUL")
    else:
        _error(r, 403, "run directory")
    assert not (outside / "ckpt").exists() and not (run.parent / "escape").exists()


@pytest.mark.parametrize("route", ["/rl/save", "/rl/load"])
def test_symlink_inside_checkpoint_leading_out_refused(server, raw, unchanged, route):
    _error(raw.post(route, json={"path": "sneaky"}), 403, "symlink")
    assert (server["outside"] / "model.pt").read_bytes() == b"not ours"


class _Planted:
    """Unpickling this writes a marker file: proof that a load ran code."""

    marker = None

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _plant(directory):
    (directory / "polynya").mkdir(parents=True, exist_ok=True)
    _Planted.marker = directory.parent / f"{directory.name}_pwned"
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        (directory / "polynya" / name).write_bytes(pickle.dumps(_Planted()))
    (directory / "latest").write_text("polynya")
    return _Planted.marker


@pytest.mark.parametrize("path", ["evil", "../evil", "link_out/evil"])
def test_planted_pickle_outside_run_dir_never_runs(server, raw, unchanged, planted, path):
    path = str(server["outside"] / "evil") if path == "evil" else path
    _error(raw.post("/rl/load", json={"path": path}), 403, "run directory")
    assert not planted["marker"].exists()


@pytest.mark.parametrize("manifest", [False, True])
def test_planted_pickle_inside_run_dir_never_runs(server, raw, unchanged, planted, manifest):
    """Our layout, planted pickles: refused at the boundary without a manifest; with a forged
    manifest the engine's weights-only unpickling refuses them. Neither runs the pickle."""
    name = "forged" if manifest else "bare"
    _error(raw.post("/rl/load", json={"path": name}), 400,
           "weights only" if manifest else "MANIFEST.json")
    assert not planted[name].exists()


@pytest.mark.parametrize(
    "case, status, needle",
    [
        ("missing", 404, "no checkpoint"),
        ("file", 400, "is a file"),
        ("foreign", 400, "not a polynya checkpoint"),
        ("fifo", 400, "not a regular file"),
    ],
)
def test_load_of_non_checkpoints(raw, unchanged, case, status, needle):
    _error(raw.post("/rl/load", json={"path": case}), status, needle)


def test_save_load_round_trip_and_truncated_checkpoint(server, raw):
    local, run = server["local"], server["run"]
    r = raw.post("/rl/save", json={"path": "ckpt/a"})
    assert r.status_code == 200 and r.json()["path"] == str((run / "ckpt" / "a").resolve())
    assert (run / "ckpt" / "a" / "polynya" / "mp_rank_00_model_states.pt").is_file()
    assert raw.post("/rl/load", json={"path": str(run / "ckpt" / "a")}).status_code == 200
    import shutil

    shutil.copytree(run / "ckpt" / "a", run / "ckpt" / "cut")
    states = run / "ckpt" / "cut" / "polynya" / "mp_rank_00_model_states.pt"
    states.write_bytes(states.read_bytes()[:100])
    before = snapshot(local, run / "ckpt")
    _error(raw.post("/rl/load", json={"path": "ckpt/cut"}), 400, "truncated")
    assert snapshot(local, run / "ckpt") == before


# ---------------------------------------------------------------------------- weight transfer
def _weights(local, scale: float = 0.01) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        n: (p.detach() + scale * torch.randn(p.shape, generator=g)).to(p.dtype)
        for n, p in local.trainer.module.named_parameters()
    }


def _join(raw) -> SyncGroup:
    port, out = free_port(), {}
    info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
    t = threading.Thread(
        target=lambda: out.update(
            r=raw.post("/init_weight_transfer_engine", json={"init_info": info})
        )
    )
    t.start()
    group = SyncGroup("127.0.0.1", port, rank=0, world_size=2, device="cpu", timeout_s=30)
    t.join(60)
    assert out["r"].status_code == 200, out["r"].text
    return group


def _info(weights, packed=True) -> dict:
    return {
        "names": list(weights),
        "dtype_names": [str(t.dtype)[6:] for t in weights.values()],
        "shapes": [list(t.shape) for t in weights.values()],
        "packed": packed,
    }


def _update(raw, group, info, sent: torch.Tensor):
    out = {}
    t = threading.Thread(
        target=lambda: out.update(r=raw.post("/update_weights", json={"update_info": info}))
    )
    t.start()
    group.broadcast(sent, 0).wait()
    t.join(60)
    return out["r"]


@pytest.fixture(scope="module")
def group(server):
    with httpx.Client(
        base_url=server["url"], headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60
    ) as h:
        holder = {"g": _join(h)}
        yield holder


def _fresh(raw, group) -> SyncGroup:
    """The transfer group, re-joined when the server dropped it after a refused update."""
    if group.get("dropped"):
        group["g"].close()
        group["g"], group["dropped"] = _join(raw), False
    return group["g"]


@pytest.mark.parametrize(
    "fault, status, needle",
    [
        ("more", 409, "more than"),
        ("fewer", 400, "checksum mismatch"),
        ("no_checksum", 400, "needs the trainer's 'checksum'"),
        ("nan", 400, "NaN"),
        ("stale", 409, "stale"),
    ],
)
def test_weight_update_faults_change_nothing(server, raw, group, unchanged, fault, status, needle):
    local = server["local"]
    w = _weights(local)
    if fault == "nan":
        next(iter(w.values()))[0] = float("nan")
    flat = torch.cat([t.reshape(-1) for t in w.values()])
    g = _fresh(raw, group)
    assert raw.post("/start_weight_update", json={}).status_code == 200
    sent = {"more": torch.cat([flat, torch.ones(10)]), "fewer": flat[: flat.numel() // 2].clone()}
    r = _update(raw, g, _info(w), sent.get(fault, flat))
    if fault == "more":
        _error(r, status, needle)
        group["dropped"] = True
        _error(raw.post("/finish_weight_update", json={"checksum": "0"}), 409, "refused")
        return
    assert r.status_code == 200, r.text
    body = {"checksum": checksum_named_tensors(w.items())}
    if fault == "no_checksum":
        body = {}
    if fault == "stale":
        body["weight_version"] = local.samplers[0].stats()["weight_version"]
    _error(raw.post("/finish_weight_update", json=body), status, needle)


@pytest.mark.parametrize(
    "fault, needle",
    [
        ("unknown", "not weights"),
        ("shape", "shape"),
        ("dtype", "dtype"),
        ("twice", "twice"),
        ("lengths", "equally long"),
    ],
)
def test_update_info_refused_before_the_collective(server, raw, group, unchanged, fault, needle):
    w = _weights(server["local"])
    info = _info(w)
    name = info["names"][0]
    if fault == "unknown":
        info["names"][0] = "evil.weight"
    elif fault == "shape":
        info["shapes"][0] = [s + 1 for s in info["shapes"][0]]
    elif fault == "dtype":
        info["dtype_names"] = ["int64"] * len(info["names"])
    elif fault == "twice":
        info["names"][1] = name
        info["shapes"][1] = info["shapes"][0]
    else:
        info["shapes"].pop()
    _fresh(raw, group)
    assert raw.post("/start_weight_update", json={}).status_code == 200
    t0 = time.monotonic()  # no trainer broadcasts here: a receive would wait for the timeout
    _error(raw.post("/update_weights", json={"update_info": info}), 400, needle)
    assert time.monotonic() - t0 < 10
    group["dropped"] = True
    _error(raw.post("/finish_weight_update", json={"checksum": "0"}), 409, "refused")


def test_empty_update_keeps_version(raw, unchanged):
    assert raw.post("/start_weight_update", json={}).status_code == 200
    _error(raw.post("/finish_weight_update", json={"checksum": "0"}), 400, "empty")
    _error(raw.post("/finish_weight_update", json={"checksum": "0"}), 409, "no weight update")


def test_good_update_with_explicit_version(server, raw, group):
    local = server["local"]
    w = _weights(local, scale=0.02)
    flat = torch.cat([t.reshape(-1) for t in w.values()])
    before = local.samplers[0].stats()["weight_version"]
    g = _fresh(raw, group)
    assert raw.post("/start_weight_update", json={}).status_code == 200
    assert _update(raw, g, _info(w), flat).status_code == 200
    r = raw.post(
        "/finish_weight_update",
        json={"checksum": checksum_named_tensors(w.items()), "weight_version": before + 5},
    )
    assert r.status_code == 200 and r.json()["version"] == before + 5
    assert local.samplers[0].stats()["weight_version"] == before + 5
    assert local.weight_checksums()["samplers"] == [checksum_named_tensors(w.items())]


# ---------------------------------------------------------------------------- parameters
BAD_PARAMS = [
    ({"top_p": "0.5"}, "top_p"),
    ({"min_p": "x"}, "min_p"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"stop_token_ids": [None]}, "stop_token_ids"),
    ({"stop_token_ids": [float("inf")]}, "stop_token_ids"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids"),
    ({"temperature": "1"}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"n": True}, "n must"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"seed": "1"}, "seed"),
    ({"max_tokens": 2**64}, "max_tokens must be at most"),  # past int64: was a 500
    ({"n": 2**40}, "n must be at most"),
    ({"stop_token_ids": [2**64]}, "stop_token_ids"),
]


@pytest.mark.parametrize("params, needle", BAD_PARAMS)
@pytest.mark.parametrize("route", ["/rl/generate", "/v1/completions", "/inference/v1/generate"])
def test_bad_sampling_params_get_400(raw, unchanged, route, params, needle):
    body = {
        "/rl/generate": {"prompts": [[5, 6]], "params": {"max_tokens": 2, **params}},
        "/v1/completions": {"prompt": [5, 6], "max_tokens": 2, **params},
        "/inference/v1/generate": {
            "token_ids": [5, 6],
            "sampling_params": {"max_tokens": 2, **params},
        },
    }[route]
    r = raw.post(route, content=json.dumps(body), headers={"Content-Type": "application/json"})
    _error(r, 400, needle)  # json.dumps writes NaN / Infinity as Python's json reads them


@pytest.mark.parametrize("route, body, needle", [
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "skip_special_tokens": "x"},
     "skip_special_tokens must be true or false"),
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "ignore_eos": "yes"},
     "ignore_eos must be true or false"),
    ("/inference/v1/generate", {"token_ids": [5, 6], "sampling_params": {
        "max_tokens": 2, "skip_special_tokens": 0}}, "skip_special_tokens must be true or false"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "chat_template_kwargs": {"tokenize": False}}, "may not set ['tokenize']"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "chat_template_kwargs": {"conversation": []}}, "conversation"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "add_generation_prompt": "no"}, "add_generation_prompt must be"),
    ("/collective_rpc", {"method": ["x"]}, "needs a method name"),
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "stop": 0},
     "stop must be a string or a list of strings"),
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "structured_outputs": []},
     "structured_outputs must be an object"),
    ("/inference/v1/generate", {"token_ids": [5, 6], "sampling_params": {
        "max_tokens": 2, "stop": False}}, "stop must be a string or a list of strings"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "tools": 0}, "tools must be a list"),
    *[("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                "chat_template_kwargs": v}, "chat_template_kwargs must be an object")
      for v in (0, "", [], False, "x")],
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": []},
     "chat_template_kwargs must be an object"),
])
def test_bad_flags_and_template_arguments_get_400(raw, unchanged, route, body, needle):
    """Each was a 500 (a TypeError inside the tokenizer, the template call or a lookup)."""
    _error(raw.post(route, json=body), 400, needle)


def test_null_flags_take_their_defaults(raw):
    """``"skip_special_tokens": null`` is the default (true), as vLLM reads it (was a 500 after
    the generation had run)."""
    r = raw.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "temperature": 0,
                                          "skip_special_tokens": None, "ignore_eos": None,
                                          "stop": None, "structured_outputs": None})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) <= 2
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    plain = raw.post("/v1/chat/completions", json=chat)
    null = raw.post("/v1/chat/completions", json={**chat, "chat_template_kwargs": None})
    assert plain.status_code == null.status_code == 200, null.text
    assert null.json()["prompt_token_ids"] == plain.json()["prompt_token_ids"]
    assert null.json()["choices"][0]["token_ids"] == plain.json()["choices"][0]["token_ids"]


def _generated(local) -> list[tuple[float, float]]:
    """Every replica's prefill and decode token counters (a refused request moves neither)."""
    return [(s.stats()["prefill_tokens"], s.stats()["decode_tokens"]) for s in local.samplers]


@pytest.mark.parametrize("value", [0, "", [], False, 1, "x", [{"max_tokens": 2}]])
def test_non_object_sampling_params_get_400(server, raw, unchanged, value):
    """A falsy non-object (``0``, ``""``, ``[]``, ``false``) was read as ``{}``: the defaults."""
    before = _generated(server["local"])
    r = raw.post("/inference/v1/generate", json={"token_ids": [5, 6], "sampling_params": value})
    _error(r, 400, "sampling_params must be an object")
    assert _generated(server["local"]) == before


@pytest.mark.parametrize("body", [{}, {"sampling_params": None}])
def test_absent_or_null_sampling_params_take_the_defaults(raw, body):
    r = raw.post("/inference/v1/generate", json={"token_ids": [5, 6], **body})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    n = len(choice["token_ids"])  # vLLM's default max_tokens: 16
    assert n == 16 if choice["finish_reason"] == "length" else 1 <= n <= 16
    assert choice["logprobs"] is None


@pytest.mark.parametrize("extra, needle", [
    ({"features": {"images": []}}, "unsupported field(s) ['features']"),
    ({"return_sample_support": True}, "unsupported field(s) ['return_sample_support']"),
    ({"prompt": "hi"}, "unsupported field(s) ['prompt']"),
    ({"stream": True}, "stream=True is not supported"),
])
def test_unknown_top_level_keys_of_inference_generate_get_400(server, raw, unchanged, extra, needle):
    """Top-level keys beside token_ids / sampling_params / request_id were ignored: multimodal
    ``features`` sampled the text alone, ``stream: true`` got one JSON answer."""
    before = _generated(server["local"])
    r = raw.post("/inference/v1/generate", json={
        "token_ids": [5, 6], "sampling_params": {"max_tokens": 2}, **extra})
    _error(r, 400, needle)
    assert _generated(server["local"]) == before


def test_what_skyrl_sends_at_the_top_level_is_accepted(raw):
    """SkyRL's RemoteInferenceClient adds ``model`` and ``cache_salt``; neither changes a token."""
    body = {"token_ids": [5, 6], "sampling_params": {"max_tokens": 3, "temperature": 0.0}}
    plain = raw.post("/inference/v1/generate", json=body)
    salted = raw.post("/inference/v1/generate", json={**body, "model": "any", "cache_salt": "s1",
                                                      "stream": False})
    assert plain.status_code == salted.status_code == 200, (plain.text, salted.text)
    assert salted.json()["choices"][0]["token_ids"] == plain.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize("request_id", [0, 1, 1.5, True, False, [], ["r"], {}, {"id": "r"}])
def test_non_string_request_id_gets_400(server, raw, unchanged, request_id):
    """It was echoed whatever its type; vLLM's request id is a string."""
    before = _generated(server["local"])
    r = raw.post("/inference/v1/generate", json={
        "token_ids": [5, 6], "sampling_params": {"max_tokens": 2}, "request_id": request_id})
    _error(r, 400, "request_id must be a string")
    assert _generated(server["local"]) == before


@pytest.mark.parametrize("body, echoed", [
    ({"request_id": "req-7"}, "req-7"),
    ({"request_id": ""}, ""),
    ({"request_id": None}, None),
    ({}, None),
])
def test_string_request_id_echoed_else_a_fresh_one(raw, body, echoed):
    r = raw.post("/inference/v1/generate", json={
        "token_ids": [5, 6], "sampling_params": {"max_tokens": 2}, **body})
    assert r.status_code == 200, r.text
    got = r.json()["request_id"]
    if echoed is None:
        assert isinstance(got, str) and len(got) == 32 and int(got, 16) >= 0
    else:
        assert got == echoed


@pytest.mark.parametrize("route", ["/rl/save", "/rl/load"])
def test_a_path_name_too_long_gets_400(raw, unchanged, route):
    """An OSError of the lookup (ENAMETOOLONG) was a 500; nothing is written."""
    _error(raw.post(route, json={"path": "a" * 300}), 400, "too long")
    _error(raw.post(route, json={"path": "ok/" + "b" * 300}), 400, "too long")


@pytest.mark.parametrize("call", ["ecosystem", "client"])
def test_sleep_level_validated(server, raw, unchanged, call):
    r = (
        raw.post("/sleep", params={"level": 9})
        if call == "ecosystem"
        else raw.post("/rl/sleep", json={"level": 9})
    )
    _error(r, 400, "sleep level")
    g = raw.post("/rl/generate", json={"prompts": [[5, 6]], "params": {"max_tokens": 2}})
    assert g.status_code == 200 and len(g.json()["samples"][0][0]["token_ids"]) == 2


def test_temperature_zero_logprobs_refused(server, raw, unchanged):
    batch = encode_batch(RolloutBatch([[5, 6, 7]], [[8, 9]]))
    _error(
        raw.post("/rl/compute_logprobs", params={"temperature": 0}, content=batch),
        400,
        "temperature",
    )
    _error(
        raw.post("/rl/compute_logprobs", params={"temperature": "hot"}, content=batch),
        400,
        "temperature",
    )
    with pytest.raises(ValueError, match="temperature"):  # the engine itself, through the client
        server["local"].compute_logprobs(RolloutBatch([[5, 6, 7]], [[8, 9]]), temperature=0)
    ok = raw.post("/rl/compute_logprobs", params={"temperature": 1.0}, content=batch)
    assert ok.status_code == 200


@pytest.mark.parametrize("route", ["/rl/forward_backward", "/rl/compute_logprobs"])
def test_sequence_longer_than_window_refused(raw, unchanged, route):
    long = RolloutBatch(
        [[5] * (TINY_WINDOW - 1), [6, 7]], [[8, 9], [10]], advantages=torch.tensor([1.0, -1.0])
    )
    _error(raw.post(route, content=encode_batch(long)), 400, "positions")
    _error(raw.post("/rl/step"), 409, "forward_backward")  # nothing accumulated
