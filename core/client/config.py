"""``RLClientConfig``: which engines to build, where they run, and how the client reaches them.

::

    cfg = RLClientConfig("tiny:qwen3", dtype="float32", comm_protocol="ray",
                         training_gpus=2, sampling_gpus=2, colocate=True)
    with polynya.create_rl_client(cfg) as client:
        ...

Engine settings come from ``train`` / ``logprob`` / ``sampling`` (the engine dataclasses, or
dicts of their fields). Each setting has one place: what the client owns (``OWNED``: the model,
dtype, device, ``zorro_train`` -> ``zorro``, ``fca`` -> ``fca``, ``sampler`` -> ``backend``;
``train.seed`` -> the other engines' ``seed``, ``train.temperature`` -> ``logprob.temperature``)
flows from the client into the engine sections,
and a section that sets one of those fields to a different, non-default value is a
``ValueError`` naming both keys (never a silent override). ``zorro_inference`` is the former
name of ``fca`` and is still accepted. Validated in ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import InitVar, dataclass

from ..config.common import check_model_spec, check_positive
from ..config.logprob import LogProbConfig
from ..config.sampler import SamplerConfig
from ..config.train import ENGINE_DTYPES, TrainConfig

PROTOCOLS = ("local", "ray", "http")
SAMPLERS = ("native", "vllm")


# Settings the client owns, and the engine-section field each one flows into. A section that
# sets one of them to a value other than its default and the client's is a contradiction.
OWNED = {
    "model_name": ("model", ("train", "logprob", "sampling")),
    "dtype": ("dtype", ("train", "logprob", "sampling")),
    "device": ("device", ("train", "logprob", "sampling")),
    "zorro_train": ("zorro", ("train", "logprob")),
    "fca": ("fca", ("sampling",)),
    "sampler": ("backend", ("sampling",)),
}
# Fields of the other engines that follow the trainer's (same weights for random specs; the
# log-probs of the rollouts' temperature).
FROM_TRAINER = {"logprob": ("seed", "temperature"), "sampling": ("seed",)}
SECTIONS = {"train": TrainConfig, "logprob": LogProbConfig, "sampling": SamplerConfig}


def owned_fields(section: str) -> dict[str, str]:
    """``{engine field: client key}`` of the fields of engine section ``section`` that the client
    sets (``train.<field>`` for those that follow the trainer: ``FROM_TRAINER``)."""
    out = {field: owner for owner, (field, names) in OWNED.items() if section in names}
    return {**out, **{f: f"train.{f}" for f in FROM_TRAINER.get(section, ())}}


def _client_value(cfg: "RLClientConfig", key: str):
    return getattr(cfg.train, key[6:]) if key.startswith("train.") else getattr(cfg, key)


def _default(cls, name: str):
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING


def _section(name: str, value, fixed: dict[str, tuple[str, object]]):
    """Build engine section ``name`` from a dataclass / dict / None with the client-owned
    ``fixed`` fields (``field -> (client key, value)``) written in; ``ValueError`` when the
    section set one of them to something else."""
    cls = SECTIONS[name]
    if value is None:
        given = {}
    elif isinstance(value, dict):
        given = dict(value)
    elif isinstance(value, cls):
        given = {f.name: getattr(value, f.name) for f in dataclasses.fields(cls)}
    else:
        raise ValueError(f"RLClientConfig.{name} must be a {cls.__name__} or a dict, got {type(value).__name__}")
    for key, (owner, want) in fixed.items():
        if key in given and given[key] != want and given[key] != _default(cls, key):
            raise ValueError(
                f"RLClientConfig.{name}.{key}={given[key]!r} contradicts RLClientConfig.{owner}={want!r}: "
                f"{owner} is set once, on the client, for every engine; set RLClientConfig.{owner} "
                f"and leave {name}.{key} unset")
        given[key] = want
    return cls(**given)


@dataclass
class RLClientConfig:
    """Client settings.

    Args:
        model_name: HF id, local path, ``tiny:<family>`` or ``random:<shape>``.
        dtype: weights of every engine (``"bfloat16"`` or ``"float32"``).
        comm_protocol: ``"local"`` (engines in this process), ``"ray"`` (actors) or ``"http"``
            (a polynya server: ``server_url``, or one started in this process when ``None``).
        training_gpus: training ranks (one per GPU; on CPU, one per process).
        sampling_gpus: sampler replicas.
        log_prob_gpus: log-prob ranks for old-policy / reference log-probs; 0 = on the trainer.
        colocate: engines share devices and take turns (offload/onload, sleep/wake; CUDA-IPC or
            shared-memory sync); False = separate devices, broadcast sync.
        offload_trainer: colocated, whether the trainer's weights, gradients and optimizer
            states go to host memory while the samplers generate (ZeRO 1-3; ZeRO-0 cannot).
            ``"auto"`` (default): only when the device lacks the room the samplers take to wake
            and generate (their KV cache, weights brought back and an estimate of their working
            memory; ``SamplingEngine.room_bytes``), so a trainer that fits stays and the
            hand-over costs no copies (~0.19 s per step for a 0.6B model on an H200); a sampler
            that cannot tell its room (vLLM) always gets the trainer offloaded. ``True``: always
            offload; ``False``: never (trainer, reference, samplers' weights and KV cache must
            then fit together: size ``sampling.kv_cache_memory_gb`` for it).
        sampler: ``"native"`` or ``"vllm"``.
        zorro_train: ZoRRo in the training and log-prob engines.
        fca: forest cascade attention (FCA) decode in the sampler (``SamplerConfig.fca``).
        zorro_inference: former name of ``fca`` (public contract): accepted at construction
            and mapped onto ``fca``; giving both with different values is a ``ValueError``.
        reference_model: also keep a frozen reference copy for ``compute_logprobs(model="reference")``.
        train, logprob, sampling: engine configs (``TrainConfig`` / ``LogProbConfig`` /
            ``SamplerConfig`` or dicts) holding only engine settings: the client-owned fields
            are filled in (see module docstring).
        device: ``"cpu"`` forces the CPU; ``None`` uses GPUs when present.
        cpu_threads: torch intra-op threads of each engine process computing on the CPU (the
            one setting for it). ``None``: torch's default (every core) for ``"local"`` and an
            in-process ``"http"`` server, where one process runs every engine; 1 per Ray actor
            for ``"ray"`` (several actors share the cores).
        bucket_bytes: flat bucket size of a weight sync.
        timeout_s: longest wait for any engine call (a dead actor or server surfaces as an error).
        sync_peer_timeout_s: split weight sync (``"ray"``, NCCL / gloo broadcast): a member
            silent this long (killed, hung) ends the sync with ``polynya.sync.SyncPeerLost``
            in the others; the client rebuilds the group on the next sync.
        server_url, api_token: ``http``: where the server is, and its bearer token.
        max_body_bytes: ``http``: request size limit of a server started by the client.
        run_dir: ``http``: the only directory a server started by the client lets ``save`` /
            ``load`` use (default: the current directory). Such a server always has a token:
            ``api_token``, or a random one the client keeps.
        ray_address: ``ray.init`` address (``None``: connect or start locally).
        device_resource: Ray resource one device stands for (``"GPU"``; a custom one on CPU).
    """

    model_name: str
    dtype: str = "bfloat16"
    comm_protocol: str = "local"
    training_gpus: int = 1
    sampling_gpus: int = 1
    log_prob_gpus: int = 0
    colocate: bool = True
    offload_trainer: bool | str = "auto"
    sampler: str = "native"
    zorro_train: bool = True
    fca: bool = True
    reference_model: bool = False
    train: TrainConfig | dict | None = None
    logprob: LogProbConfig | dict | None = None
    sampling: SamplerConfig | dict | None = None
    device: str | None = None
    cpu_threads: int | None = None
    bucket_bytes: int = 1 << 28
    timeout_s: float = 600.0
    sync_peer_timeout_s: float = 30.0
    server_url: str | None = None
    api_token: str | None = dataclasses.field(default=None, repr=False)  # a secret: never in a repr
    max_body_bytes: int = 1 << 30
    run_dir: str | None = None
    ray_address: str | None = None
    device_resource: str = "GPU"
    zorro_inference: InitVar[bool | None] = None

    def __post_init__(self, zorro_inference: bool | None = None) -> None:
        if zorro_inference is not None:
            if not isinstance(zorro_inference, bool):
                raise ValueError(f"RLClientConfig.zorro_inference must be a bool, got {zorro_inference!r}")
            if zorro_inference != self.fca and self.fca is not True:
                raise ValueError(f"RLClientConfig.zorro_inference={zorro_inference} contradicts "
                                 f"fca={self.fca}: zorro_inference is the former name of fca, give one")
            self.fca = zorro_inference
        check_model_spec(self.model_name, "RLClientConfig.model_name")
        if self.dtype not in ENGINE_DTYPES:
            raise ValueError(
                f"RLClientConfig.dtype must be one of {ENGINE_DTYPES}, got {self.dtype!r}"
            )
        if self.comm_protocol not in PROTOCOLS:
            raise ValueError(
                f"RLClientConfig.comm_protocol must be one of {PROTOCOLS}, got {self.comm_protocol!r}"
            )
        check_positive(self.training_gpus, "RLClientConfig.training_gpus", integer=True)
        check_positive(self.sampling_gpus, "RLClientConfig.sampling_gpus", integer=True)
        check_positive(
            self.log_prob_gpus, "RLClientConfig.log_prob_gpus", allow_zero=True, integer=True
        )
        if not (isinstance(self.offload_trainer, bool) or self.offload_trainer == "auto"):
            raise ValueError("RLClientConfig.offload_trainer must be True, False or 'auto', got "
                             f"{self.offload_trainer!r}")
        for name in (
            "colocate",
            "zorro_train",
            "fca",
            "reference_model",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"RLClientConfig.{name} must be a bool, got {getattr(self, name)!r}"
                )
        if self.sampler not in SAMPLERS:
            raise ValueError(
                f"RLClientConfig.sampler must be one of {SAMPLERS}, got {self.sampler!r}"
            )
        if self.colocate and self.sampling_gpus != self.training_gpus:
            raise ValueError(
                f"colocate=True puts one sampler replica on each training GPU: sampling_gpus "
                f"({self.sampling_gpus}) must equal training_gpus ({self.training_gpus})"
            )
        if self.colocate and self.log_prob_gpus not in (0, self.training_gpus):
            raise ValueError("colocate=True: log_prob_gpus must be 0 or equal to training_gpus")
        if self.device is not None and self.device not in ("cpu", "cuda"):
            raise ValueError(
                f"RLClientConfig.device must be 'cpu', 'cuda' or None, got {self.device!r}"
            )
        if self.cpu_threads is not None:
            check_positive(self.cpu_threads, "RLClientConfig.cpu_threads", integer=True)
        check_positive(self.bucket_bytes, "RLClientConfig.bucket_bytes", integer=True)
        check_positive(self.timeout_s, "RLClientConfig.timeout_s")
        check_positive(self.sync_peer_timeout_s, "RLClientConfig.sync_peer_timeout_s")
        check_positive(self.max_body_bytes, "RLClientConfig.max_body_bytes", integer=True)
        if self.server_url is not None and not str(self.server_url).startswith(
            ("http://", "https://")
        ):
            raise ValueError(
                f"RLClientConfig.server_url must start with http:// or https://, got {self.server_url!r}"
            )
        if self.run_dir is not None and (not isinstance(self.run_dir, str) or not self.run_dir):
            raise ValueError(f"RLClientConfig.run_dir must be a directory path, got {self.run_dir!r}")
        if not isinstance(self.device_resource, str) or not self.device_resource:
            raise ValueError("RLClientConfig.device_resource must be a resource name")
        for name in SECTIONS:  # train first: the others take its seed
            fixed = {f: (key, _client_value(self, key)) for f, key in owned_fields(name).items()}
            setattr(self, name, _section(name, getattr(self, name), fixed))

    @property
    def trainer_offloads(self) -> bool | str:
        """How a colocated hand-over treats the trainer: ``offload_trainer`` where offloading
        is possible (ZeRO 1-3), False under ZeRO-0."""
        return self.offload_trainer if self.train.zero_stage > 0 else False

    def replace(self, **changes) -> "RLClientConfig":
        """A copy with ``changes`` (validated again); engine fields that came from a changed
        client setting follow it."""
        if "zorro_inference" in changes:
            changes["fca"] = changes.pop("zorro_inference")
        sections = {}
        for name, cls in SECTIONS.items():
            if name in changes:
                continue
            follow = {f: changes[key] if key in changes else _default(cls, f)
                      for f, key in owned_fields(name).items()
                      if key in changes or (key.startswith("train.") and "train" in changes)}
            sections[name] = dataclasses.replace(getattr(self, name), **follow)
        return dataclasses.replace(self, **{**sections, **changes})
