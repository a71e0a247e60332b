"""The colocated hand-over, decided in one place: who is resident, weight versions, when to sync.

``HandOver`` holds no engine: it keeps what the engines currently hold (trainer on the device
or offloaded, samplers awake or asleep at which level, log-prob engine asleep, gradients
pending) and the client's weight versions, and answers each client call with a *plan*: a list
of ``Action(role, method, args)`` that the transport runs on every engine of that role —
in-process (``polynya.client.local``), on Ray actors (``polynya.client.ray_client``), and so
behind the HTTP server too (it serves a local client). After running an action the transport
reports it (``done``), so the recorded state always matches what really happened::

    for action in handover.to_training():          # before forward_backward, sync, save ...
        results = [getattr(engine, action.method)(*action.args)
                   for engine in engines[action.role]]
        handover.done(action, results)   # make_room's results: whether each rank offloaded

Rules. Colocated, the trainer and the samplers take turns on the device: sampling offloads the
trainer (unless it holds gradients not yet applied, cannot offload: ZeRO-0, or is told to
stay) and then wakes the samplers, so their KV cache can take the memory the trainer gave
back. With ``trainer_offloads="auto"`` the trainer is asked to ``make_room`` for what the
samplers take when they wake and generate (``sampler_room[level]`` bytes for samplers asleep
at ``level``, 0 = awake): it stays on the device when that much is free there and offloads
otherwise (room unknown: it offloads); the transport reports which it did. Training, syncing,
saving and log-probs put the samplers to sleep (level 1: KV cache freed, weights kept for the
next sync) and bring the trainer back. Split, nothing moves unless asked. Versions: every
sync attempt gets a new number, never reused even when an attempt failed half-way (some
receivers may hold it); ``version`` is the last one every receiver accepted.
"""
from __future__ import annotations

from dataclasses import dataclass

TRAINER, SAMPLERS, LOGPROB = "trainer", "samplers", "logprob"
OFFLOAD_MODES = (True, False, "auto")  # RLClientConfig.offload_trainer
SLEEP_LEVELS = (0, 1, 2)  # a sampler's: awake, KV cache freed, weights off the device too
ENGINES = ("sampler", "trainer", "logprob")  # what a client's sleep / wake name
_ROLES = {"trainer": TRAINER, "sampler": SAMPLERS, "logprob": LOGPROB}


@dataclass(frozen=True)
class Action:
    """Call ``method(*args)`` on every engine of ``role`` (``TRAINER``, ``SAMPLERS``,
    ``LOGPROB``); methods are those of ``polynya.engines.protocol``."""

    role: str
    method: str
    args: tuple = ()


@dataclass(frozen=True)
class SyncPlan:
    """One weight sync: its version and the manifest layout (``"spans"``: the trainer's own
    flat storages, shared as they are; ``"packed"``: ``export_weights`` buckets)."""

    version: int
    layout: str


class HandOver:
    """Residency and versions of one client's engines (module docstring)."""

    def __init__(self, *, colocate: bool, trainer_offloads: bool | str, has_logprob: bool,
                 sampler_room: dict[int, int] | None = None):
        if not (isinstance(trainer_offloads, bool) or trainer_offloads == "auto"):
            raise ValueError(f"trainer_offloads must be one of {OFFLOAD_MODES}, got {trainer_offloads!r}")
        self.colocate = colocate
        self.trainer_offloads = trainer_offloads  # ZeRO-0 cannot offload: it stays resident
        self.sampler_room = sampler_room  # {sleep level: device bytes the samplers' wake takes}
        self.has_logprob = has_logprob
        self.offloads = 0  # hand-overs that moved the trainer off the device
        self.trainer_resident = True
        self.sampler_sleep = 0  # 0: awake; else the level it sleeps at
        self.logprob_asleep = False
        self.gradients_pending = False
        self.version = 0  # last version every receiver accepted
        self._attempted = 0

    # ------------------------------------------------------------------ plans
    def to_sampling(self) -> list[Action]:
        """Before generating: colocated, the trainer off the device (or asked to make room:
        ``"auto"``), then the samplers awake."""
        plan = []
        if self.colocate and self.trainer_resident and not self.gradients_pending:
            if self.trainer_offloads == "auto" and self.sampler_room is not None:
                plan.append(Action(TRAINER, "make_room", (self.sampler_room[self.sampler_sleep],)))
            elif self.trainer_offloads:
                plan.append(Action(TRAINER, "offload"))
        if self.sampler_sleep:
            plan.append(Action(SAMPLERS, "wake"))
        return plan

    def to_training(self) -> list[Action]:
        """Before training, log-probs, a sync, save / load or checksums: colocated, the
        samplers asleep (level 1); the trainer on the device."""
        plan = [Action(SAMPLERS, "sleep", (1,))] if self.colocate and not self.sampler_sleep else []
        if not self.trainer_resident:
            plan.append(Action(TRAINER, "onload"))
        return plan

    def sleep(self, engine: str, level: int = 1) -> list[Action]:
        """The user's ``sleep(engine, level)``."""
        role = _role(engine)
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if role == SAMPLERS:
            return [Action(SAMPLERS, "sleep", (level,))] if self.sampler_sleep < level else []
        if role == TRAINER:
            return [Action(TRAINER, "offload")] if self.trainer_resident else []
        self._need_logprob()
        return [] if self.logprob_asleep else [Action(LOGPROB, "sleep", (level,))]

    def wake(self, engine: str) -> list[Action]:
        """The user's ``wake(engine)``: the sampler or trainer side of the hand-over."""
        role = _role(engine)
        if role == SAMPLERS:
            return self.to_sampling()
        if role == TRAINER:
            return self.to_training()
        self._need_logprob()
        return [Action(LOGPROB, "wake")] if self.logprob_asleep else []

    def done(self, action: Action, results: list | None = None) -> None:
        """Record that the transport ran ``action`` on every engine of its role; ``results``
        are their return values (``make_room``: whether each offloaded)."""
        role, method = action.role, action.method
        if role == TRAINER and method == "make_room":
            if results is None:
                raise ValueError("make_room needs the engines' results: did each offload?")
            if any(results):  # one rank short of room moved: onload them all (a no-op elsewhere)
                self.trainer_resident = False
                self.offloads += 1
        elif role == TRAINER and method in ("offload", "onload"):
            if method == "offload" and self.trainer_resident:
                self.offloads += 1
            self.trainer_resident = method == "onload"
        elif role == SAMPLERS and method in ("sleep", "wake"):
            self.sampler_sleep = action.args[0] if method == "sleep" else 0
        elif role == LOGPROB and method in ("sleep", "wake"):
            self.logprob_asleep = method == "sleep"
        else:
            raise ValueError(f"not a hand-over action: {action}")

    # ------------------------------------------------------------------ training
    def trained(self, method: str) -> None:
        """After a trainer call: ``forward_backward`` leaves gradients the trainer must keep
        (it stays resident until they are applied); ``step`` and ``load`` clear them."""
        if method == "forward_backward":
            self.gradients_pending = True
        elif method in ("step", "load"):
            self.gradients_pending = False

    # ------------------------------------------------------------------ versions
    def begin_sync(self, *, in_process: bool) -> SyncPlan:
        """A new sync (its version is never reused). In one process, or colocated, the
        trainer's flat storages are handed over as they are; split, packed buckets travel."""
        self._attempted = max(self.version, self._attempted) + 1
        layout = "spans" if in_process or self.colocate else "packed"
        return SyncPlan(self._attempted, layout)

    def synced(self, plan: SyncPlan) -> None:
        """Every receiver accepted ``plan``'s version."""
        self.version = max(self.version, plan.version)

    def _need_logprob(self) -> None:
        if not self.has_logprob:
            raise ValueError("there is no log-prob engine (log_prob_gpus=0)")


def sampler_room(rooms: dict[int, list], combine) -> dict[int, int] | None:
    """``HandOver.sampler_room`` from every sampler's ``room_bytes(level)`` per level:
    ``combine`` them (``sum`` when the samplers share the trainer's device, ``max`` when each
    has its own); None when one cannot tell (then ``"auto"`` offloads)."""
    if any(r is None for per in rooms.values() for r in per):
        return None
    return {level: combine(per) for level, per in rooms.items()}


def check_engine(engine: str) -> str:
    """``engine`` if it names one of ``ENGINES`` (``ValueError`` otherwise)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    return engine


def _role(engine: str) -> str:
    return _ROLES[check_engine(engine)]
