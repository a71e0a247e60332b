"""The hand-over coordinator (polynya.coordination.HandOver) on its own, and the Protocols the
engines declare. The coordinator's plans are compared with the sequence the colocated rules
require; the transports' execution is covered by tests/client (local, Ray, HTTP)."""
from __future__ import annotations

import pytest

from polynya.coordination import Action, HandOver


class Recorder:
    """Runs plans the way a transport does and records the calls (``make_room`` answers
    ``offloads``: whether each trainer rank had to offload)."""

    def __init__(self, handover: HandOver, offloads: list[bool] = (False,)):
        self.handover, self.calls, self.offloads = handover, [], list(offloads)

    def run(self, plan: list[Action]) -> None:
        for action in plan:
            self.calls.append((action.role, action.method, *action.args))
            self.handover.done(action, self.offloads if action.method == "make_room" else None)


def test_colocated_turns():
    h = HandOver(colocate=True, trainer_offloads=True, has_logprob=False)
    r = Recorder(h)
    r.run(h.to_sampling())
    assert r.calls == [("trainer", "offload")] and not h.trainer_resident
    r.run(h.to_sampling())  # already there: nothing to do
    assert len(r.calls) == 1
    r.run(h.to_training())
    assert r.calls[1:] == [("samplers", "sleep", 1), ("trainer", "onload")]
    h.trained("forward_backward")
    r.run(h.to_sampling())  # gradients pending: the trainer stays, the samplers wake
    assert r.calls[3:] == [("samplers", "wake")] and h.trainer_resident
    h.trained("step")
    r.run(h.to_sampling())
    assert r.calls[4:] == [("trainer", "offload")]
    r.run(h.to_training())
    r.run(h.to_sampling())  # the trainer leaves before the samplers' KV cache comes back
    assert r.calls[7:] == [("trainer", "offload"), ("samplers", "wake")]
    assert h.offloads == 3


ROOM = {0: 10, 1: 1000, 2: 5000}


@pytest.mark.parametrize("offloads", [[False], [True], [False, True]],
                         ids=["fits", "short", "one-rank-short"])
def test_auto_asks_for_the_room_of_the_samplers_sleep_level(offloads):
    h = HandOver(colocate=True, trainer_offloads="auto", has_logprob=False, sampler_room=ROOM)
    r = Recorder(h, offloads)
    r.run(h.to_sampling())  # samplers awake: room for their working memory only
    moved = any(offloads)
    assert r.calls == [("trainer", "make_room", 10)] and h.trainer_resident is not moved
    r.run(h.to_training())
    assert r.calls[1:] == [("samplers", "sleep", 1)] + ([("trainer", "onload")] if moved else [])
    r.calls.clear()
    r.run(h.sleep("sampler", 2))
    r.run(h.to_sampling())  # level 2: the weights come back too
    assert r.calls[1:] == [("trainer", "make_room", 5000), ("samplers", "wake")]
    assert h.offloads == 2 * moved
    with pytest.raises(ValueError, match="make_room needs the engines' results"):
        h.done(Action("trainer", "make_room", (1,)))


def test_auto_offloads_when_the_room_is_unknown_and_checks_its_mode():
    h = HandOver(colocate=True, trainer_offloads="auto", has_logprob=False, sampler_room=None)
    assert h.to_sampling() == [Action("trainer", "offload")]
    for bad in ("always", 1, None):
        with pytest.raises(ValueError, match="trainer_offloads must be one of"):
            HandOver(colocate=True, trainer_offloads=bad, has_logprob=False)


def test_sampler_room_combines_replicas():
    from polynya.coordination.handover import sampler_room

    rooms = {0: [1, 2], 1: [10, 30], 2: [100, 300]}
    assert sampler_room(rooms, sum) == {0: 3, 1: 40, 2: 400}
    assert sampler_room(rooms, max) == {0: 2, 1: 30, 2: 300}
    assert sampler_room({0: [1, None], 1: [1, 1], 2: [1, 1]}, sum) is None


def test_split_and_zero0_never_move_unasked():
    for h in (HandOver(colocate=False, trainer_offloads=True, has_logprob=True),
              HandOver(colocate=True, trainer_offloads=False, has_logprob=True)):
        r = Recorder(h)
        r.run(h.to_sampling())
        r.run(h.to_training())
        assert r.calls == ([] if not h.colocate else [("samplers", "sleep", 1)])


def test_user_sleep_wake_levels_and_logprob():
    h = HandOver(colocate=False, trainer_offloads=True, has_logprob=True)
    r = Recorder(h)
    r.run(h.sleep("sampler", 1))
    r.run(h.sleep("sampler", 1))  # already at level 1
    r.run(h.sleep("sampler", 2))  # deeper: weights off the device too
    r.run(h.sleep("logprob", 1))
    r.run(h.wake("logprob"))
    r.run(h.wake("sampler"))
    r.run(h.sleep("trainer"))
    r.run(h.wake("trainer"))
    assert r.calls == [("samplers", "sleep", 1), ("samplers", "sleep", 2), ("logprob", "sleep", 1),
                       ("logprob", "wake"), ("samplers", "wake"), ("trainer", "offload"),
                       ("trainer", "onload")]
    with pytest.raises(ValueError, match="engine must be one of"):
        h.sleep("gpu")
    with pytest.raises(ValueError, match="level"):
        h.sleep("sampler", 9)
    with pytest.raises(ValueError, match="no log-prob engine"):
        HandOver(colocate=False, trainer_offloads=True, has_logprob=False).sleep("logprob")
    with pytest.raises(ValueError, match="not a hand-over action"):
        h.done(Action("trainer", "step"))


def test_state_moves_only_when_the_transport_reports():
    h = HandOver(colocate=True, trainer_offloads=True, has_logprob=False)
    plan = h.to_sampling()
    assert plan and h.trainer_resident  # planned, not done: a failed offload changes nothing
    assert h.to_sampling() == plan


def test_versions_never_reused():
    h = HandOver(colocate=True, trainer_offloads=True, has_logprob=False)
    first = h.begin_sync(in_process=False)
    assert (first.version, first.layout) == (1, "spans") and h.version == 0
    second = h.begin_sync(in_process=False)  # the first failed half-way: a new number
    h.synced(second)
    assert (second.version, h.version) == (2, 2)
    split = HandOver(colocate=False, trainer_offloads=True, has_logprob=False)
    assert split.begin_sync(in_process=False).layout == "packed"
    assert split.begin_sync(in_process=True).layout == "spans"


def test_engines_implement_the_protocols():
    from polynya.config import SamplerConfig
    from polynya.engines import LogProbEngine, SamplingEngine, TrainingEngine
    from polynya.engines.protocol import ServingEngine, TrainerEngine

    for cls in (SamplingEngine, LogProbEngine):
        for name in ("load_weights", "weight_checksum", "sleep", "wake", "weight_version"):
            assert hasattr(cls, name), (cls, name)
    for name in ("export_weights", "weight_checksum", "offload", "onload"):
        assert hasattr(TrainingEngine, name)
    sampler = SamplingEngine(SamplerConfig("tiny:qwen3", dtype="float32", num_blocks=16))
    assert isinstance(sampler, ServingEngine) and not isinstance(sampler, TrainerEngine)
