"""``LogProbEngine``: forward-only DeepSpeed engine for reference and old-policy log-probs.

::

    ref = LogProbEngine(LogProbConfig("tiny:qwen3", dtype="float32", zero_stage=3))
    stats = ref.compute_logprobs(batch)            # TokenStats, rows in the batch's order
    ref.load_weights(trainer.export_weights())     # refresh an old-policy copy

ZeRO-3 shards the weights over the data-parallel ranks (gathered layer by layer in the forward
pass); stage 0 keeps a full copy per rank. Every rank is given the same global batch and computes
the log-probs of its shard of whole prompt groups; the shards are summed into the full
``[B, Rmax]`` result on every rank. The log-prob math is ``polynya.compute_logprobs`` itself.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from ..config.common import resolve_dtype
from ..config.logprob import LogProbConfig
from ..distributed import (
    all_reduce_sum,
    batch_fingerprint,
    check_same_on_all_ranks,
    local_device,
)
from ..types import RolloutBatch, TokenStats
from ..verified_copy import load_verified
from ..zorro.batching import plan_micro_batches
from . import _deepspeed as dsu


def sharded_logprobs(owner, batch: RolloutBatch, *, entropy: bool, temperature: float) -> TokenStats:
    """Data-parallel ``compute_logprobs`` for an engine ``owner`` (``module``, ``config``,
    ``rank``, ``world_size``, ``device``): each rank does its shard, results are summed."""
    from ..logprobs import check_inputs, compute_logprobs

    if not isinstance(batch, RolloutBatch):
        raise ValueError(f"expected a polynya.RolloutBatch, got {type(batch).__name__}")
    check_inputs(owner.module, batch, temperature)
    cfg = owner.config
    if owner.world_size > 1:  # the rows in order: each rank's log-probs go back to their rows
        check_same_on_all_ranks(batch_fingerprint(batch), owner.device, "the batch (its rows in order)")
    plan = plan_micro_batches(batch, rank=owner.rank, world=owner.world_size,
                              max_tokens=cfg.micro_batch_tokens, zorro=cfg.zorro)
    shape = (len(batch), batch.max_response_len)
    lp = torch.zeros(shape, dtype=torch.float32, device=owner.device)
    ent = torch.zeros_like(lp) if entropy else None
    with torch.no_grad():
        for rows, real in plan:
            st = compute_logprobs(owner.module, batch.select(rows), zorro=cfg.zorro, entropy=entropy,
                                  temperature=temperature, max_tokens_per_row=cfg.max_tokens_per_row,
                                  zorro_attention=cfg.zorro_attention, naive_layout=cfg.naive_layout)
            if not real:
                continue
            idx = torch.tensor(rows, device=owner.device)
            width = st.logprobs.shape[1]
            lp[idx, :width] = st.logprobs
            if entropy:
                ent[idx, :width] = st.entropy
    all_reduce_sum(lp)
    if entropy:
        all_reduce_sum(ent)
    return TokenStats(lp, ent, batch.response_mask().to(owner.device))


class LogProbEngine:
    """A forward-only DeepSpeed engine for one data-parallel rank (module docstring)."""

    def __init__(self, config: LogProbConfig):
        if not isinstance(config, LogProbConfig):
            raise ValueError(f"LogProbEngine needs a LogProbConfig, got {type(config).__name__}")
        from ..logprobs import check_model
        from ..models import load_model

        self.config = config
        self.device = local_device(config.device)
        self.rank, self.world_size = dsu.init_deepspeed(self.device)
        deepspeed = dsu.import_deepspeed()
        model = load_model(config.model, dtype=config.dtype, device=self.device, seed=config.seed)
        check_model(model, zorro=config.zorro, naive_layout=config.naive_layout)  # refuse before DeepSpeed starts
        if config.fused_kernels:
            from ..fused import fuse_model

            fuse_model(model)
        if config.compile_layers:
            from .. import compiled_layers

            compiled_layers.compile_layers(model)
        model.requires_grad_(False)
        ds_cfg = dsu.ds_config(zero_stage=config.zero_stage, dtype=resolve_dtype(config.dtype),
                               train=False, overrides=config.deepspeed,
                               num_params=sum(p.numel() for p in model.parameters()))
        self.engine, _, _, _ = deepspeed.initialize(model=model, config=ds_cfg, dist_init_required=False)
        self.module = self.engine.module.eval()
        self._version = 0
        self._asleep = False
        self._copy_plans: dict = {}  # a sync's layout -> its VerifiedBucketCopy (ZeRO-0)

    def compute_logprobs(self, batch: RolloutBatch, *, entropy: bool = False,
                         temperature: float | None = None) -> TokenStats:
        """Per-token log-probs (and entropy) of ``batch``'s responses.

        Args:
            batch: the global batch (same on every rank).
            entropy: also return the entropy of each predictive distribution.
            temperature: defaults to ``config.temperature``.
        Returns:
            ``TokenStats``: ``logprobs`` / ``entropy`` ``[B, Rmax]`` float32, ``mask`` ``[B, Rmax]``,
            on the engine's device, identical on every rank.
        """
        self._check_awake()
        return sharded_logprobs(self, batch, entropy=entropy,
                                temperature=self.config.temperature if temperature is None else temperature)

    def load_weights(self, weights: Iterable, version: int | None = None, *,
                     checksum: str | None = None) -> int:
        """Copy new weights in; returns the new weight version.

        Args:
            weights: ``(name, tensor)`` pairs and/or ``(names, flat)`` pieces as yielded by
                ``TrainingEngine.export_weights`` (a single piece may be passed bare). Names are
                ``named_parameters`` names (tied aliases accepted). Under ZeRO-3 every rank
                passes the same pieces.
            version: the version these weights are (default: the current one + 1); must be
                newer than ``weight_version``.
            checksum: the sender's ``polynya.checksum`` of the pieces, verified before loading.
        Every piece is checked first (names, shapes, dtypes, finite values, checksum): on
        ``ValueError`` nothing was copied and ``weight_version`` is unchanged.

        Under ZeRO-0 a weight sync's ``FlatBuckets`` with a ``checksum`` take the native
        sampler's path (``polynya.verified_copy``: one read checks checksum and finite values,
        one launch per bucket copies; the plan is kept per layout) when the weights are in the
        buckets' dtype; anything else is checked and copied tensor by tensor.
        """
        if version is not None and int(version) <= self._version:
            raise ValueError(f"weight version {version} is not newer than the served {self._version}")
        params = lambda: dict(self.module.named_parameters(remove_duplicate=False))  # noqa: E731
        if not (self.config.zero_stage == 0
                and load_verified(self._copy_plans, weights, checksum, params)):
            dsu.load_pieces(self.module, weights, checksum=checksum)
        self._version = self._version + 1 if version is None else int(version)
        return self._version

    @property
    def weight_version(self) -> int:
        """The version of the loaded weights (0: as built)."""
        return self._version

    def sleep(self, level: int = 1) -> None:
        """Move the weights to host memory (ZeRO-0; level 1 and 2 alike: there is no KV cache);
        ``wake()`` brings them back."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.config.zero_stage != 0:
            raise NotImplementedError("sleep/wake of a ZeRO-3 log-prob engine is not supported")
        if not self._asleep:
            self._copy_plans = {}  # its views would keep the device weights alive
            self.module.to("cpu")
            dsu.free_accelerator_cache()
            self._asleep = True

    def wake(self) -> None:
        if self._asleep:
            self._copy_plans = {}
            self.module.to(self.device)
            self._asleep = False

    def _check_awake(self) -> None:
        if self._asleep:
            raise RuntimeError("the log-prob engine is asleep: call wake() first")

    def weight_checksum(self, bucket_bytes: int = 1 << 28) -> str:
        """Same digest as ``TrainingEngine.weight_checksum`` (equal after a sync in one dtype)."""
        return dsu.weights_checksum(self.module, bucket_bytes)
