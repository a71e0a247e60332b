"""``/init_weight_transfer_engine`` is bounded: it answers within the server's init timeout, holds
no thread or lock the other routes need while it waits, and leaves the transfer state as it was
when it fails (CPU, gloo; a fresh app per test over one set of tiny engines).

| case                                                | outcome                                   |
|-----------------------------------------------------|-------------------------------------------|
| nothing listens at the address                      | 504 naming it, after the timeout, no more |
| 40 inits at once (more than the default executor)   | one waits, 39 get 409 at once; ``/rl/*``,  |
|                                                     | ``/start_weight_update``, ``/health`` answer |
| an init fails while a group is in use               | 504; that group still receives an update  |
| a group forms while an update receives on the old  | 504 at the timeout; the update completes, |
|                                                     | the old group stays, the new one closed   |
| a store answers but a rank never joins              | 504; 409 while it ends; the group formed  |
|                                                     | late is closed, never installed           |
| master_address not a string / not resolvable        | 400 before any wait                       |
| ``--weight-transfer-timeout`` out of range          | ValueError at ``create_app``              |

(Before: the init ran on the default executor under the transfer lock and gave up only after
TCPStore's own retries, 2 to 2.5 times its 300 s timeout.)
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import torch
from polynya.client.local import LocalClient
from polynya.client.server import create_app
from polynya.distributed import free_port
from polynya.sync import SyncGroup

from .common import tiny_config
from .serving import served, snapshot

TOKEN = "t0ken"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
INIT_TIMEOUT_S = 4.0
SLACK_S = 3.0  # what an answer may take beyond the timeout on a busy 2-core test machine


@pytest.fixture(scope="module")
def local():
    client = LocalClient(tiny_config("local"))
    yield client
    client.shutdown()


@pytest.fixture()
def url(local, tmp_path):
    """A fresh server (fresh transfer state) over the module's engines."""
    app = create_app(local, api_token=TOKEN, run_dir=tmp_path / "run",
                     weight_transfer_timeout_s=INIT_TIMEOUT_S)
    with served(app) as base:
        yield base


@pytest.fixture()
def http(url):
    with httpx.Client(base_url=url, headers=HEADERS, timeout=60) as h:
        yield h


@pytest.fixture()
def unchanged(local, tmp_path):
    """Weights, versions, optimizer step and the run directory are as before the test."""
    before = snapshot(local, tmp_path)
    yield
    assert snapshot(local, tmp_path) == before


def _error(r, status: int, needle: str) -> str:
    assert r.status_code == status, r.text
    assert needle in r.json()["error"], r.json()
    return r.json()["error"]


def _init_body(port: int, world: int = 2, host="127.0.0.1", extra: dict | None = None) -> dict:
    return {"init_info": {"master_address": host, "master_port": port, "rank_offset": 1,
                          "world_size": world, **(extra or {})}}


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=fn()), daemon=True)
    t.start()
    return t, out


def _join(http, extra: dict | None = None) -> SyncGroup:
    """A trainer's group (rank 0) that the server joins as rank 1 (``extra``: more init keys)."""
    port = free_port()
    t, out = _in_thread(lambda: http.post("/init_weight_transfer_engine",
                                          json=_init_body(port, extra=extra)))
    group = SyncGroup("127.0.0.1", port, rank=0, world_size=2, device="cpu", timeout_s=30,
                      heartbeat=False)
    t.join(60)
    assert out["r"].status_code == 200, out["r"].text
    return group


def _no_group(http) -> None:
    """The server holds no transfer group (an update asks for an init first)."""
    assert http.post("/start_weight_update", json={}).status_code == 200
    _error(http.post("/update_weights", json={"update_info": {}}), 409,
           "call /init_weight_transfer_engine first")


def _random_update(local, seed: int) -> tuple[dict, torch.Tensor]:
    """An ``update_info`` for the sampler's weights and the packed tensor a trainer broadcasts."""
    g = torch.Generator().manual_seed(seed)
    named = {n: p.detach() + 0.01 * torch.randn(p.shape, generator=g)
             for n, p in local.trainer.module.named_parameters()}
    info = {"names": list(named), "dtype_names": ["float32"] * len(named),
            "shapes": [list(t.shape) for t in named.values()], "packed": True}
    return info, torch.cat([t.reshape(-1) for t in named.values()])


def test_nothing_listening_gets_504_after_the_timeout(http, unchanged):
    port = free_port()
    t0 = time.monotonic()
    r = http.post("/init_weight_transfer_engine", json=_init_body(port))
    took = time.monotonic() - t0
    error = _error(r, 504, f"127.0.0.1:{port}")
    assert "--weight-transfer-timeout" in error and "unchanged" in error
    assert INIT_TIMEOUT_S - 0.1 <= took < INIT_TIMEOUT_S + SLACK_S  # waited for a late store
    _no_group(http)


def test_a_pending_init_holds_no_other_route(url, local, unchanged):
    """More inits at once than the default executor has threads: one waits on the init thread,
    the others are refused at once, and routes that run on the default executor (``/rl/*``) or
    take the transfer lock (``/start_weight_update``) answer while it waits."""
    port, n = free_port(), 40

    async def scenario():
        limits = httpx.Limits(max_connections=n + 8)
        async with httpx.AsyncClient(base_url=url, headers=HEADERS, timeout=60,
                                     limits=limits) as h:
            t0 = time.monotonic()
            inits = [asyncio.create_task(h.post("/init_weight_transfer_engine",
                                                json=_init_body(port))) for _ in range(n)]
            while sum(t.done() for t in inits) < n - 1:
                assert time.monotonic() - t0 < INIT_TIMEOUT_S, "the refusals were not at once"
                await asyncio.sleep(0.01)
            waiting = [t for t in inits if not t.done()]
            refused = [t.result() for t in inits if t.done()]
            others = (await h.get("/health"), await h.get("/rl/weight_checksums"),
                      await h.post("/start_weight_update", json={}))
            assert len(waiting) == 1 and not waiting[0].done()  # all answered while it waits
            return refused, others, await waiting[0], time.monotonic() - t0

    refused, others, last, took = asyncio.run(scenario())
    for r in refused:
        _error(r, 409, "one init at a time")
    assert [r.status_code for r in others] == [200, 200, 200]
    assert others[1].json()["samplers"] == local.weight_checksums()["samplers"]
    _error(last, 504, f"127.0.0.1:{port}")
    assert took < INIT_TIMEOUT_S + SLACK_S


def test_a_failed_init_keeps_the_group_in_use(http, local, unchanged):
    group = _join(http)
    try:
        _error(http.post("/init_weight_transfer_engine", json=_init_body(free_port())), 504,
               "the group in use, if any, is kept")
        info, flat = _random_update(local, 3)
        assert http.post("/start_weight_update", json={}).status_code == 200
        t, out = _in_thread(lambda: http.post("/update_weights", json={"update_info": info}))
        group.broadcast(flat, 0).wait()
        t.join(60)
        assert out["r"].status_code == 200, out["r"].text  # received over the kept group
    finally:
        group.close()


def test_an_update_in_flight_keeps_its_group(url, local, unchanged):
    """A new group forms while an update still receives on the group in use: the init answers
    504 at its timeout, the update completes on its group, and the new member is closed."""
    with httpx.Client(base_url=url, headers=HEADERS, timeout=60) as http, \
            httpx.Client(base_url=url, headers=HEADERS, timeout=60) as other:
        old = _join(http)
        info, flat = _random_update(local, 4)
        assert http.post("/start_weight_update", json={}).status_code == 200
        receiving, update = _in_thread(
            lambda: http.post("/update_weights", json={"update_info": info}))
        time.sleep(0.5)  # the server is receiving on the old group (nothing sent yet)
        port = free_port()
        t, init = _in_thread(
            lambda: other.post("/init_weight_transfer_engine", json=_init_body(port)))
        new = SyncGroup("127.0.0.1", port, rank=0, world_size=2, device="cpu", timeout_s=30,
                        heartbeat=False)  # forms with the server's member, which must wait
        t.join(INIT_TIMEOUT_S + SLACK_S + 5)
        _error(init["r"], 504, "an update still receiving on the group in use held it back")
        old.broadcast(flat, 0).wait()
        receiving.join(60)
        assert update["r"].status_code == 200, update["r"].text  # on the group it began on
        info2, flat2 = _random_update(local, 5)  # the old group is still the one in use
        assert http.post("/start_weight_update", json={}).status_code == 200
        receiving, update = _in_thread(
            lambda: http.post("/update_weights", json={"update_info": info2}))
        old.broadcast(flat2, 0).wait()
        receiving.join(60)
        assert update["r"].status_code == 200, update["r"].text
        old.close()
        new.close()


def test_a_group_that_forms_late_is_closed_not_installed(http, unchanged):
    """The trainer's store answers but rank 2 of 3 comes only after the 504: the server's late
    member is closed once the group forms, and the next init is served again."""
    port, members = free_port(), {}

    def member(rank: int) -> None:
        members[rank] = SyncGroup("127.0.0.1", port, rank=rank, world_size=3, device="cpu",
                                  timeout_s=60, heartbeat=False)

    threads = [threading.Thread(target=member, args=(0,), daemon=True)]
    threads[0].start()
    deadline = time.monotonic() + 30
    while True:  # rank 0's store listens
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    t0 = time.monotonic()
    r = http.post("/init_weight_transfer_engine", json=_init_body(port, world=3))
    _error(r, 504, "not all 3 ranks joined")
    assert time.monotonic() - t0 < INIT_TIMEOUT_S + SLACK_S
    _error(http.post("/init_weight_transfer_engine", json=_init_body(free_port())), 409,
           "ending the rendezvous it timed out on")
    threads.append(threading.Thread(target=member, args=(2,), daemon=True))
    threads[1].start()
    for t in threads:
        t.join(60)
    assert sorted(members) == [0, 2]  # the group formed, with the server's member
    deadline = time.monotonic() + 30
    while (r := http.post("/init_weight_transfer_engine",
                          json=_init_body(free_port()))).status_code == 409:
        assert time.monotonic() < deadline, r.text  # the late member is closed, the slot free
        time.sleep(0.1)
    _error(r, 504, "nothing accepted a connection")
    _no_group(http)  # the late group was never installed
    for g in members.values():
        g.close()


@pytest.mark.parametrize("host, needle", [
    (5, "master_address must be a host name"),
    ("", "master_address must be a host name"),
    (None, "master_address must be a host name"),
    ("no-such-host.invalid", "does not resolve"),
])
def test_bad_master_address_gets_400(http, unchanged, host, needle):
    t0 = time.monotonic()
    _error(http.post("/init_weight_transfer_engine", json=_init_body(free_port(), host=host)),
           400, needle)
    assert time.monotonic() - t0 < INIT_TIMEOUT_S  # refused, not waited on
    _no_group(http)


@pytest.mark.parametrize("timeout_s", [0, -1, float("nan"), float("inf"), 3601, True, "30"])
def test_init_timeout_out_of_range_refused(local, tmp_path, timeout_s):
    with pytest.raises(ValueError, match="weight-transfer init timeout"):
        create_app(local, run_dir=tmp_path, weight_transfer_timeout_s=timeout_s)
