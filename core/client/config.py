"""``RLClientConfig``: which engines to build, where they run, and how the client reaches them.

::

    cfg = RLClientConfig("tiny:qwen3", dtype="float32", comm_protocol="ray",
                         training_gpus=2, sampling_gpus=2, colocate=True)
    with polynya.create_rl_client(cfg) as client:
        ...

Engine settings come from ``train`` / ``logprob`` / ``sampling`` (the engine dataclasses, or
dicts of their fields); ``model_name``, ``dtype``, ``zorro_train`` and ``zorro_inference`` (FCA)
are written over them so the engines always agree on the model. Validated in ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config.common import check_model_spec, check_positive
from ..config.logprob import LogProbConfig
from ..config.sampler import SamplerConfig
from ..config.train import ENGINE_DTYPES, TrainConfig

PROTOCOLS = ("local", "ray", "http")
SAMPLERS = ("native", "vllm")


def _as(cls, value, name: str, **fixed):
    if value is None:
        return cls(**fixed)
    if isinstance(value, dict):
        return cls(**{**value, **fixed})
    if isinstance(value, cls):
        return dataclasses.replace(value, **fixed)
    raise ValueError(
        f"RLClientConfig.{name} must be a {cls.__name__} or a dict, got {type(value).__name__}"
    )


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
        sampler: ``"native"`` or ``"vllm"``.
        zorro_train: ZoRRo in the training and log-prob engines.
        zorro_inference: FCA decode in the sampler.
        reference_model: also keep a frozen reference copy for ``compute_logprobs(model="reference")``.
        train, logprob, sampling: engine configs (``TrainConfig`` / ``LogProbConfig`` /
            ``SamplerConfig`` or dicts); their ``model``/``dtype``/``zorro``/``fca`` are overridden.
        device: ``"cpu"`` forces the CPU; ``None`` uses GPUs when present.
        bucket_bytes: flat bucket size of a weight sync.
        timeout_s: longest wait for any engine call (a dead actor or server surfaces as an error).
        server_url, api_token: ``http``: where the server is, and its bearer token.
        max_body_bytes: ``http``: request size limit of a server started by the client.
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
    sampler: str = "native"
    zorro_train: bool = True
    zorro_inference: bool = True
    reference_model: bool = False
    train: TrainConfig | dict | None = None
    logprob: LogProbConfig | dict | None = None
    sampling: SamplerConfig | dict | None = None
    device: str | None = None
    bucket_bytes: int = 1 << 28
    timeout_s: float = 600.0
    server_url: str | None = None
    api_token: str | None = None
    max_body_bytes: int = 1 << 30
    ray_address: str | None = None
    device_resource: str = "GPU"

    def __post_init__(self) -> None:
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
        for name in (
            "colocate",
            "zorro_train",
            "zorro_inference",
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
        check_positive(self.bucket_bytes, "RLClientConfig.bucket_bytes", integer=True)
        check_positive(self.timeout_s, "RLClientConfig.timeout_s")
        check_positive(self.max_body_bytes, "RLClientConfig.max_body_bytes", integer=True)
        if self.server_url is not None and not str(self.server_url).startswith(
            ("http://", "https://")
        ):
            raise ValueError(
                f"RLClientConfig.server_url must start with http:// or https://, got {self.server_url!r}"
            )
        if not isinstance(self.device_resource, str) or not self.device_resource:
            raise ValueError("RLClientConfig.device_resource must be a resource name")
        common = dict(model=self.model_name, dtype=self.dtype)
        dev = {} if self.device is None else {"device": self.device}
        self.train = _as(TrainConfig, self.train, "train", zorro=self.zorro_train, **common, **dev)
        self.logprob = _as(
            LogProbConfig,
            self.logprob,
            "logprob",
            zorro=self.zorro_train,
            seed=self.train.seed,
            **common,
            **dev,
        )
        self.sampling = _as(
            SamplerConfig,
            self.sampling,
            "sampling",
            backend=self.sampler,
            fca=self.zorro_inference,
            seed=self.train.seed,
            **common,
            **dev,
        )

    def replace(self, **changes) -> "RLClientConfig":
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)
