"""``offload_trainer="auto"`` on a GPU: the trainer's ``make_room`` reads the device's free
memory for real (stays when the room is free, offloads and frees its states when it is not),
and a colocated local client keeps a trainer that fits resident through a full RL round trip
while one that is told the samplers need more than the device holds is offloaded and onloaded."""
from __future__ import annotations

import pytest
import torch

import polynya
from polynya import SamplingParams
from polynya.engines.train import TrainingEngine

from ..engines.common import full_weights, make_batch, train_config
from .common import PROMPTS, rl_round_trip, tiny_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_make_room_reads_the_device_and_offloads_only_when_short():
    engine = TrainingEngine(train_config(2, device="cuda"))
    twin = TrainingEngine(train_config(2, device="cuda"))
    for e in (engine, twin):
        e.forward_backward(make_batch(9, old=True))
        e.step()
    free = torch.cuda.mem_get_info()[0]
    assert engine.make_room(free // 2) is False and not engine._offloaded
    held = torch.cuda.memory_allocated()
    total = torch.cuda.mem_get_info()[1]
    assert engine.make_room(2 * total) is True and engine._offloaded
    assert torch.cuda.memory_allocated() < held  # its states left the device
    assert engine.make_room(2 * total) is False  # already offloaded: nothing more to move
    engine.onload()
    batch = make_batch(10, old=True)
    assert engine.forward_backward(batch)["loss"] == pytest.approx(
        twin.forward_backward(batch)["loss"], rel=1e-6)
    assert engine.step()["grad_norm"] == pytest.approx(twin.step()["grad_norm"], rel=1e-5)
    mine = full_weights(engine.module)
    for name, w in full_weights(twin.module).items():
        torch.testing.assert_close(mine[name], w, rtol=1e-5, atol=1e-6)


def test_auto_client_keeps_a_trainer_that_fits_and_offloads_one_that_does_not():
    cfg = tiny_config("local")
    assert cfg.offload_trainer == "auto"
    with polynya.create_rl_client(cfg) as client:
        room = client.handover.sampler_room
        assert room[0] > 0 and room[1] - room[0] == client.samplers[0].backend.runner.kv_bytes()
        rl_round_trip(client)
        client.generate([PROMPTS[0]], SamplingParams(n=2, max_tokens=3, seed=0))
        assert client.handover.offloads == 0 and not client.trainer._offloaded
        total = torch.cuda.mem_get_info()[1]
        client.handover.sampler_room = {lv: 2 * total for lv in room}  # samplers "need" more
        client.generate([PROMPTS[0]], SamplingParams(n=2, max_tokens=3, seed=0))
        assert client.handover.offloads == 1 and client.trainer._offloaded
        rl_round_trip(client)  # onloaded for log-probs, training and the sync
