"""Packed weight updates as vLLM's trainers send them (CPU, gloo, tiny engines behind the HTTP
server): the tensors' raw bytes in update order, cut into buffers by
``packed_broadcast_producer``'s rule, dtypes mixed; packing agreed per update or at init; keys
of another protocol refused before any collective.

(Before: a packed update was received as one flat buffer of one dtype, so any model over vLLM's
1 GiB buffer — every real one — got a receive out of step with the trainer's broadcasts.)
"""

from __future__ import annotations

import random

import pytest
import torch
from polynya.checksum import checksum_named_tensors, checksum_views
from polynya.client.weight_transfer import PACKED_BUFFER_BYTES, _as_tensor, packed_chunks

from .test_transfer_init import _error, _in_thread, _join, _no_group, http, local, url  # noqa: F401


def vllm_producer_buffers(nbytes: list[int], target: int) -> list[list[int]]:
    """vLLM's ``packed_broadcast_producer`` loop, restated (one buffer in flight): which tensors
    each broadcast carries."""
    it, out = iter(range(len(nbytes))), []
    while True:
        chunk, size = [], 0
        try:
            while True:
                i = next(it)
                chunk.append(i)
                size += nbytes[i]
                if size > target:
                    break
            out.append(chunk)
        except StopIteration:
            if chunk:
                out.append(chunk)
            break
    return out


def test_packed_chunks_are_vllms_buffers():
    rng = random.Random(0)
    cases = [([], 8), ([8], 8), ([9], 8), ([8, 8, 8], 8), ([4, 4, 4], 8), ([0, 0, 5, 0], 4),
             ([100, 1, 1], 8)]
    cases += [([rng.choice([0, 1, 2, 6, 64, 300]) for _ in range(rng.randint(1, 40))],
               rng.choice([1, 7, 64, 256, 1000])) for _ in range(300)]
    for nbytes, target in cases:
        assert [list(r) for r in packed_chunks(nbytes, target)] == \
            vllm_producer_buffers(nbytes, target), (nbytes, target)
    assert PACKED_BUFFER_BYTES == 1024 * 1024 * 1024  # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES


def test_a_tensor_at_an_offset_its_dtype_cannot_view_is_copied():
    """One bf16 value then three fp32 ones in a buffer: the fp32 tensor starts at byte 2."""
    half, full = torch.tensor([1.5], dtype=torch.bfloat16), torch.tensor([1.0, -2.0, 3.25])
    raw = torch.cat([half.view(torch.uint8), full.view(torch.uint8)])
    a, b = raw.split([2, 12])
    assert b.storage_offset() % 4 == 2
    got = [_as_tensor(a, torch.bfloat16, (1,)), _as_tensor(b, torch.float32, (3,))]
    assert torch.equal(got[0], half) and torch.equal(got[1], full)


def _mixed_update(local, seed: int) -> tuple[dict, list[tuple[str, torch.Tensor]]]:
    """New weights, every other tensor sent in bf16 (the rest fp32), in the trainer's order."""
    g = torch.Generator().manual_seed(seed)
    sent = []
    for k, (n, p) in enumerate(local.trainer.module.named_parameters()):
        t = p.detach() + 0.01 * torch.randn(p.shape, generator=g)
        sent.append((n, t.to(torch.bfloat16) if k % 2 else t))
    info = {"names": [n for n, _ in sent],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in sent],
            "shapes": [list(t.shape) for _, t in sent]}
    return info, sent


def _broadcast_like_vllm(group, sent, target: int) -> int:
    """The trainer side: vLLM's packed buffers (raw bytes, concatenated) one broadcast each."""
    raw = [t.contiguous().view(torch.uint8).view(-1) for _, t in sent]
    buffers = vllm_producer_buffers([r.numel() for r in raw], target)
    for idx in buffers:
        group.broadcast(torch.cat([raw[i] for i in idx]), 0).wait()
    return len(buffers)


@pytest.mark.parametrize("agreed", ["per update", "at init"])
def test_vllm_packed_buffers_load_exactly(http, local, agreed):
    """Several buffers (a 2 KiB buffer size over the tiny model: 16), bf16 and fp32 tensors
    mixed: the sampler ends with exactly the sent values (cast to its dtype)
    and the version moves; with packing agreed at init the updates carry no packing keys."""
    sampler = local.samplers[0]
    packing = {"packed": True, "packed_buffer_size_bytes": 2048, "packed_num_buffers": 2}
    if agreed == "at init":
        group = _join(http, extra=packing)
    else:
        group = _join(http)
    info, sent = _mixed_update(local, 5)
    if agreed == "per update":
        info.update(packing, extras={})  # some vLLM versions send an empty ``extras``
    version = sampler.stats()["weight_version"]
    assert http.post("/start_weight_update", json={}).status_code == 200
    t, out = _in_thread(lambda: http.post("/update_weights", json={"update_info": info}))
    assert _broadcast_like_vllm(group, sent, 2048) > 3
    t.join(60)
    assert out["r"].status_code == 200, out["r"].text
    r = http.post("/finish_weight_update", json={"checksum": checksum_named_tensors(sent)})
    assert r.status_code == 200, r.text
    assert sampler.stats()["weight_version"] == version + 1
    want = [(n, t.to(torch.float32)) for n, t in sent]
    assert sampler.weight_checksum() == checksum_views(want)
    group.close()


def test_another_protocols_init_keys_are_refused(http, local):
    """``nccl_unique_id_b64`` (a rendezvous this server does not run) or any unknown key: 400
    naming it, before anything waits or joins."""
    sums = local.weight_checksums()
    base = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
    for extra, needle in (({"nccl_unique_id_b64": "AAAA"}, "master_address / master_port only"),
                          ({"group_name": "x"}, "'group_name'"),
                          ({"packed": "yes"}, "packed must be true or false"),
                          ({"packed_buffer_size_bytes": 0}, "packed_buffer_size_bytes"),
                          ({"packed_num_buffers": True}, "packed_num_buffers")):
        r = http.post("/init_weight_transfer_engine", json={"init_info": {**base, **extra}})
        _error(r, 400, needle)
    _no_group(http)
    assert local.weight_checksums() == sums


def test_another_protocols_update_keys_are_refused(http, local):
    """An update carrying CUDA-IPC handles (or any unknown key) or a bad packing value gets 400
    before any receive; the update is void, nothing is loaded, and the group is dropped (the
    trainer's broadcast may have no receive to match: it re-initialises)."""
    sampler = local.samplers[0]
    before, version = sampler.weight_checksum(), sampler.stats()["weight_version"]
    for extra, needle in (({"ipc_handles_pickled": "x"}, "'ipc_handles_pickled'"),
                          ({"extras": {"w": [1]}}, "'extras'"),  # empty extras are accepted
                          ({"packed_buffer_size_bytes": -1}, "packed_buffer_size_bytes")):
        _join(http)
        info, _ = _mixed_update(local, 6)
        assert http.post("/start_weight_update", json={}).status_code == 200
        _error(http.post("/update_weights", json={"update_info": {**info, **extra}}), 400, needle)
        _error(http.post("/finish_weight_update", json={"checksum": "0"}), 409, needle)
        _no_group(http)
    assert sampler.weight_checksum() == before and sampler.stats()["weight_version"] == version
