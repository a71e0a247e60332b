"""``WeightTransfer``'s receive on the sampler's own device (CPU, and CUDA under ``-m gpu``),
without a server or a process group: a stand-in group plays the trainer's broadcasts byte for
byte, so the receive buffers, the byte views of vLLM's packed buffers (dtypes mixed, tensors at
offsets their dtype cannot view) and the verified load run on the device a served sampler uses.
The HTTP routes and the real gloo group are covered by ``test_transfer_packing.py`` (this
module imports no server code: the GPU machine has no uvicorn).
"""
from __future__ import annotations

import pytest
import torch
from polynya.checksum import checksum_named_tensors, checksum_views
from polynya.client.weight_transfer import Packing, WeightTransfer, packed_chunks

from ..engines.sample.test_native_engine import make_engine

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]


class _Played:
    def wait(self) -> None:
        pass


class TrainerPlayback:
    """Stands in for the transfer group: each broadcast fills the receive buffer with the next
    message the trainer sent (raw bytes, as NCCL / gloo deliver them)."""

    def __init__(self, messages: list[torch.Tensor]):
        self.messages = list(messages)
        self.closed = False

    def broadcast(self, buf: torch.Tensor, src: int) -> _Played:
        raw = self.messages.pop(0).contiguous().view(torch.uint8).view(-1)
        buf.view(torch.uint8)[:raw.numel()].copy_(raw.to(buf.device))
        return _Played()

    def close(self) -> None:
        self.closed = True


def _update(engine, seed: int) -> list[tuple[str, torch.Tensor]]:
    """New weights in the served names, every other tensor in bf16 and a 1-element bf16 tensor
    first (so the fp32 tensors after it start at offsets fp32 cannot view)."""
    g = torch.Generator().manual_seed(seed)
    sent = []
    for k, (n, (shape, _)) in enumerate(sorted(engine.weight_specs().items())):
        t = 0.02 * torch.randn(shape, generator=g)
        sent.append((n, t.to(torch.bfloat16) if k % 2 == 0 else t))
    return sent


def _info(sent) -> dict:
    return {"names": [n for n, _ in sent], "shapes": [list(t.shape) for _, t in sent],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in sent]}


def _receiver(engine, messages) -> WeightTransfer:
    wt = WeightTransfer([engine])
    wt.group = TrainerPlayback(messages)
    return wt


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("packed", [True, False])
def test_a_receive_on_the_samplers_device_loads_exactly(device, packed):
    engine = make_engine(device=device)
    sent = _update(engine, 3)
    if packed:
        raw = [t.contiguous().view(torch.uint8).view(-1) for _, t in sent]
        buffers = packed_chunks([r.numel() for r in raw], 4096)  # == vLLM's (test_transfer_packing)
        messages = [torch.cat([raw[i] for i in idx]) for idx in buffers]
        assert len(messages) > 3
    else:
        messages = [t for _, t in sent]
    wt = _receiver(engine, messages)
    wt.packing = Packing(packed, 4096)
    version = engine.stats()["weight_version"]
    wt.start()
    wt.update(_info(sent))
    assert all(t.device.type == engine.device.type for t in wt.staged.values())
    assert wt.finish({"checksum": checksum_named_tensors(sent)}) == version + 1
    assert not wt.group.messages  # every broadcast was received
    want = [(n, t.to(torch.float32)) for n, t in sent]
    assert engine.weight_checksum() == checksum_views(want)


@pytest.mark.parametrize("device", DEVICES)
def test_a_garbled_packed_buffer_is_refused_with_the_weights_unchanged(device):
    engine = make_engine(device=device)
    before = engine.weight_checksum()
    sent = _update(engine, 4)
    raw = torch.cat([t.contiguous().view(torch.uint8).view(-1) for _, t in sent])
    garbled = raw.clone()
    garbled[raw.numel() // 2] ^= 0x10  # one flipped bit in one weight
    wt = _receiver(engine, [garbled])
    wt.packing = Packing(True, 1 << 30)
    version = engine.stats()["weight_version"]
    wt.start()
    wt.update(_info(sent))
    with pytest.raises(ValueError, match="checksum"):
        wt.finish({"checksum": checksum_named_tensors(sent)})
    assert engine.weight_checksum() == before
    assert engine.stats()["weight_version"] == version
