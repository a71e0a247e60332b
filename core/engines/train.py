"""``TrainingEngine``: policy forward/backward and optimizer steps on DeepSpeed (ZeRO 0-3).

One engine per data-parallel rank; each rank is given the same global ``RolloutBatch`` and
trains on its share::

    engine = TrainingEngine(TrainConfig("tiny:qwen3", dtype="float32", zero_stage=2, loss="dapo"))
    metrics = engine.forward_backward(batch)   # loss, token counts, clip fraction, KL, entropy
    info = engine.step()                       # grad_norm, lr
    for names, flat in engine.export_weights(1 << 28): sampler.load_weights((names, flat))

How a batch flows: the global batch is cut into ``world_size`` shards of whole prompt groups
(``polynya.zorro.batching.plan_micro_batches``), each shard into micro-batches under
``micro_batch_tokens``; each micro-batch goes through ``polynya.compute_logprobs`` (ZoRRo when
``zorro``) and ``polynya.losses.policy_loss``, whose normalisation uses the *global* batch's
token/sequence counts, so the accumulated gradient does not depend on the split.
DeepSpeed runs with unmanaged gradient accumulation: ``backward`` accumulates locally, ``step``
reduces over ranks (averaging) and updates; each micro-batch loss is multiplied by the world size
to undo DeepSpeed's averaging, so the update is that of the global loss. Calling
``forward_backward`` twice before ``step`` adds the two batches' losses.

Without a launcher the engine sets up a one-rank process group itself (``polynya.distributed``);
under ``torchrun`` / Ray it joins the launcher's group.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator

import torch

from ..checksum import PendingChecksum
from ..config.common import resolve_dtype
from ..config.train import TrainConfig
from ..distributed import (
    all_reduce_max,
    all_reduce_sum,
    batch_fingerprint,
    check_same_on_all_ranks,
    local_device,
)
from ..files import CHECKPOINT_TAG, clear_checkpoint, verify_manifest, write_manifest
from ..losses import Normalizer, policy_loss, resolve_loss
from ..spans import cached_layout, span_layout
from ..types import RolloutBatch, TokenStats
from ..zorro.batching import plan_micro_batches
from . import _deepspeed as dsu
from ._grad_checks import fuse_grad_checks, skip_fp32_overflow

HF_EXPORT = "hf"  # sub-directory of a checkpoint holding its Hugging Face export
OWN_SKIPPED = "polynya_own_skipped_steps"  # checkpoint client state: the steps ZeRO-0 skipped itself
_METRICS = ("loss", "pg_loss", "clip_frac", "ratio", "kl", "entropy")


def _finite_tensor(t, what: str, shape: tuple[int, ...] | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what} must be a tensor, got {type(t).__name__}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{what} has shape {tuple(t.shape)}, expected {shape}")
    if not torch.isfinite(t).all():
        raise ValueError(f"{what} contains NaN or inf")


def check_train_batch(batch: object, *, needs_ref: bool) -> RolloutBatch:
    """Everything ``forward_backward`` needs of a batch, checked before any state is touched."""
    if not isinstance(batch, RolloutBatch):
        raise ValueError(f"expected a polynya.RolloutBatch, got {type(batch).__name__}")
    b, r = len(batch), batch.max_response_len
    if batch.advantages is None:
        raise ValueError("forward_backward needs batch.advantages ([B] or [B, Rmax])")
    adv = batch.advantages
    _finite_tensor(adv, "advantages", None)
    if tuple(adv.shape) not in ((b,), (b, r)):
        raise ValueError(f"advantages must be [B]=[{b}] or [B, Rmax]=[{b}, {r}], got {tuple(adv.shape)}")
    for name in ("old_logprobs", "ref_logprobs"):
        t = getattr(batch, name)
        if t is not None:
            _finite_tensor(t, name, (b, r))
    if needs_ref and batch.ref_logprobs is None:
        raise ValueError("loss_config.kl_coef > 0 needs batch.ref_logprobs")
    return batch


def _export_folder(name) -> bool:
    """Whether ``name`` is a folder inside a checkpoint that ``save`` may export to: relative,
    below the checkpoint (not itself), outside DeepSpeed's tag folder."""
    if not isinstance(name, str) or not name or os.path.isabs(name):
        return False
    parts = os.path.normpath(name).split(os.sep)
    return parts[0] not in (".", "..", CHECKPOINT_TAG)


class TrainingEngine:
    """A DeepSpeed training engine for one data-parallel rank (module docstring)."""

    def __init__(self, config: TrainConfig):
        if not isinstance(config, TrainConfig):
            raise ValueError(f"TrainingEngine needs a TrainConfig, got {type(config).__name__}")
        self.config = config
        self.loss_spec = resolve_loss(config.loss, config.loss_config)
        self.device = local_device(config.device)
        self.rank, self.world_size = dsu.init_deepspeed(self.device)
        self.dtype = resolve_dtype(config.dtype)
        self._pending = 0  # forward_backward calls since the last step
        self._torn: str | None = None  # why a forward_backward stopped after gradients were added
        self._half_loaded: str | None = None  # why a load() stopped after DeepSpeed began loading
        self._offloaded = False
        self._ready = None  # (span layout, its .seen, PendingChecksum) launched after the update
        self._digest_stream = None
        self._host: list | None = None  # ZeRO-3 master-weight host buffers, kept across offloads
        self.engine = self._build(dsu.import_deepspeed())
        self.module = self.engine.module

    # ------------------------------------------------------------------ set-up
    def _build(self, deepspeed):
        from ..logprobs import check_model
        from ..models import load_model

        cfg = self.config
        torch.manual_seed(cfg.seed)
        model = load_model(cfg.model, dtype=cfg.dtype, device=self.device, seed=cfg.seed)
        check_model(model, zorro=cfg.zorro, train=True, naive_layout=cfg.naive_layout)  # refuse before DeepSpeed starts
        if cfg.fused_kernels:
            from ..fused import fuse_model

            fuse_model(model)
        if cfg.compile_layers:
            from .. import compiled_layers

            compiled_layers.compile_layers(model)
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        fused = self.device.type == "cuda" if cfg.optim.fused is None else cfg.optim.fused
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.optim.betas, eps=cfg.optim.eps,
                                weight_decay=cfg.optim.weight_decay, fused=fused)
        sched = self._sched = torch.optim.lr_scheduler.LambdaLR(opt, cfg.optim.lr_factor)
        # Plain fp32 ZeRO-0 has no DeepSpeed optimizer wrapper that reports the norm (or skips a
        # non-finite one, as DeepSpeed's ZeRO-1/2/3 and bf16 wrappers do): clip and skip here.
        self._own_clip = cfg.zero_stage == 0 and self.dtype == torch.float32
        self._own_norm: float | None = None
        self._own_skipped = 0  # steps skipped here (DeepSpeed counts its own in skipped_steps)
        if self._own_clip:
            opt.register_step_pre_hook(self._clip_hook)
        ds_cfg = dsu.ds_config(zero_stage=cfg.zero_stage, dtype=self.dtype, train=True,
                               grad_clip=0.0 if self._own_clip else cfg.optim.grad_clip,
                               overrides=cfg.deepspeed,
                               num_params=sum(p.numel() for p in model.parameters()))
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                               config=ds_cfg, dist_init_required=False)
        fuse_grad_checks(engine.optimizer)  # ZeRO-1/2: the step's overflow check and norm, multi-tensor
        skip_fp32_overflow(engine.optimizer)  # ZeRO-3: a norm past fp32 skips, as on ZeRO-0/1/2
        return engine

    def _clip_hook(self, optimizer, args, kwargs) -> None:
        """Runs inside the optimizer step, after DeepSpeed reduced the gradients over ranks:
        clip, and drop a non-finite gradient (AdamW leaves a parameter without one as it is)."""
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        limit = self.config.optim.grad_clip or math.inf
        self._own_norm = float(torch.nn.utils.clip_grad_norm_(params, limit))
        if not math.isfinite(self._own_norm):
            for p in params:
                p.grad = None

    # ------------------------------------------------------------------ training
    def _plan(self, batch: RolloutBatch):
        """Validate and plan a batch; raises ``ValueError`` before any state changes."""
        from ..logprobs import check_inputs

        check_train_batch(batch, needs_ref=self.loss_spec.kl_coef > 0)
        check_inputs(self.module, batch, self.config.temperature)
        normalizer = Normalizer.from_mask(batch.response_mask(), self.loss_spec.max_response_len)
        if self.world_size > 1:
            tensors = (batch.advantages, batch.old_logprobs, batch.ref_logprobs)
            check_same_on_all_ranks(batch_fingerprint(batch, tensors), self.device,
                                    "the batch (its rows in order, advantages, old / reference log-probs)")
        plan = plan_micro_batches(batch, rank=self.rank, world=self.world_size,
                                  max_tokens=self.config.micro_batch_tokens, zorro=self.config.zorro)
        return normalizer, plan

    def forward_backward(self, batch: RolloutBatch) -> dict[str, float]:
        """Accumulate the gradient of the configured loss over ``batch`` (this rank's share).

        Args:
            batch: the *global* batch (the same on every rank, rows in the same order: checked,
                ``batch_fingerprint``) with ``advantages`` ``[B]`` or ``[B, Rmax]``;
                ``old_logprobs`` ``[B, Rmax]`` or None (on-policy: ratio 1 against the detached
                current log-probs); ``ref_logprobs`` when ``kl_coef > 0``.
        Returns:
            global metrics: ``loss``, ``pg_loss``, ``clip_frac``, ``ratio``, ``kl`` (with
            ``ref_logprobs``), ``entropy`` (when computed), ``response_tokens``, ``sequences``,
            ``micro_batches`` (per rank), ``zorro_micro_batches`` (of them, those that ran the
            ZoRRo layout: with ``zorro_attention="auto"`` a micro-batch too small to pay runs
            the packed naive one, ``polynya.logprobs.zorro_pays``), ``time_s``.
        """
        self._check_onloaded()
        self._check_whole()
        t0 = time.perf_counter()
        normalizer, plan = self._plan(batch)
        spec, cfg = self.loss_spec, self.config
        want_entropy = cfg.log_entropy or spec.entropy_coef != 0
        sums = torch.zeros(len(_METRICS), dtype=torch.float64, device=self.device)
        self.module.train()
        zorro_runs = 0
        with self._whole_or_torn(len(plan)) as started:
            for rows, real in plan:
                mb = batch.select(rows)
                with dsu.engine_forward(self.engine):
                    stats = self._logprobs(mb, entropy=want_entropy, grad=True)
                zorro_runs += stats.layout == "zorro"
                dev = lambda t: None if t is None else t.to(self.device)
                out = policy_loss(spec, stats.logprobs, dev(mb.advantages), stats.mask, normalizer,
                                  old_logprobs=dev(mb.old_logprobs), ref_logprobs=dev(mb.ref_logprobs),
                                  entropy=stats.entropy)
                started.append(rows)
                self.engine.backward(out.loss * (self.world_size if real else 0.0), scale_wrt_gas=False)
                if real:
                    vals = {"loss": out.loss.detach(), **out.metrics}
                    sums += torch.stack([vals.get(k, torch.zeros((), device=self.device)).double()
                                         for k in _METRICS])
        all_reduce_sum(sums)
        self._pending += 1
        metrics = {k: float(v) for k, v in zip(_METRICS, sums.tolist())}
        if batch.ref_logprobs is None:
            metrics.pop("kl")
        if not want_entropy:
            metrics.pop("entropy")
        metrics.update(response_tokens=normalizer.num_tokens, sequences=normalizer.num_sequences,
                       micro_batches=len(plan), zorro_micro_batches=zorro_runs,
                       time_s=time.perf_counter() - t0)
        return metrics

    def step(self) -> dict[str, float]:
        """Reduce the accumulated gradients over ranks, clip, and apply one AdamW update.

        A non-finite global gradient norm (NaN / inf gradients, or finite ones whose norm
        overflows) skips the update on every ZeRO stage: weights, optimizer state and the LR
        schedule stay as they were and the gradients are dropped.

        Returns ``grad_norm`` (global, before clipping), ``lr`` (the rate this update used),
        ``step`` (step() calls so far, skipped ones included), ``skipped`` (1.0 when this
        update was skipped) and ``skipped_steps`` (how many were, since the engine started).
        """
        self._check_onloaded()
        self._check_whole()
        if self._pending == 0:
            raise RuntimeError("step() needs a forward_backward() first (no gradient accumulated)")
        lr = float(self.engine.optimizer.param_groups[0]["lr"])
        ds_skipped = int(self.engine.skipped_steps)
        schedule = self._sched.state_dict() if self._own_clip else None
        group_lrs = [g["lr"] for g in self._sched.optimizer.param_groups]
        self._own_norm = None
        self._drop_checksum()
        self.engine.step()
        self._pending = 0
        self.prepare_checksum()
        norm = self._own_norm if self._own_clip else self.engine.get_global_grad_norm()
        norm = float("nan") if norm is None else float(norm)
        skipped = int(self.engine.skipped_steps) > ds_skipped
        if self._own_clip and not math.isfinite(norm):
            self._sched.load_state_dict(schedule)  # DeepSpeed stepped it: as its own skips, don't
            for g, group_lr in zip(self._sched.optimizer.param_groups, group_lrs):
                g["lr"] = group_lr
            self._own_skipped += 1
            skipped = True
        return {"grad_norm": norm, "lr": lr, "step": int(self.engine.global_steps),
                "skipped": float(skipped), "skipped_steps": self.skipped_steps}

    @property
    def skipped_steps(self) -> int:
        """Updates skipped for a non-finite gradient norm since the engine started."""
        return int(self.engine.skipped_steps) + self._own_skipped

    # ------------------------------------------------------------------ external losses
    def forward_backward_local(self, batch: RolloutBatch,
                               loss_fn: Callable[[list[int], TokenStats], torch.Tensor] | None, *,
                               backward: bool = True, entropy: bool = False,
                               temperature: float | None = None) -> list[tuple[list[int], TokenStats]]:
        """Log-probs for a loss the caller owns (a framework's own PPO loss), and its backward.

        For frameworks that shard the data themselves (verl): ``batch`` is *this rank's* samples,
        not a global batch. It is cut into micro-batches of whole prompt groups under
        ``micro_batch_tokens``; every rank runs the same number of micro-batches (collectives
        inside forward/backward must line up), a rank with fewer repeats one with weight 0.

        Args:
            batch: this rank's samples (advantages / old log-probs are not read: the loss owns them).
            loss_fn: ``loss_fn(rows, stats) -> scalar`` for each micro-batch: ``rows`` index into
                ``batch``, ``stats`` are their ``TokenStats`` (differentiable when ``backward``).
                May be None when ``backward`` is False.
            backward: accumulate the gradient of each returned loss (``step()`` applies it). As
                DeepSpeed averages gradients over ranks at ``step()``, a loss normalised by
                global counts must be scaled by the number of ranks (verl's losses are, by
                ``dp_size``).
            entropy, temperature: as ``compute_logprobs``.
        Returns:
            ``[(rows, stats)]`` per real micro-batch, stats detached.
        """
        self._check_onloaded()
        if backward:
            self._check_whole()
        if backward and loss_fn is None:
            raise ValueError("forward_backward_local(backward=True) needs a loss_fn")
        if not isinstance(batch, RolloutBatch):
            raise ValueError(f"expected a polynya.RolloutBatch, got {type(batch).__name__}")
        plan = plan_micro_batches(batch, rank=0, world=1, max_tokens=self.config.micro_batch_tokens,
                                  zorro=self.config.zorro)
        # shares differ per rank: every rank runs the largest count, padding with weight-0 repeats
        count = all_reduce_max([len(plan)], self.device)[0]
        smallest = min((rows for rows, _ in plan), key=len)
        plan += [(smallest, False)] * (count - len(plan))
        self.module.train(backward)
        out = []
        with self._whole_or_torn(len(plan)) as started:
            for rows, real in plan:
                mb = batch.select(rows)
                ctx = dsu.engine_forward(self.engine) if backward else contextlib.nullcontext()
                with ctx:
                    stats = self._logprobs(mb, entropy=entropy, grad=backward, temperature=temperature)
                with torch.set_grad_enabled(backward):
                    loss = loss_fn(rows, stats) if real and loss_fn is not None else None
                if backward:
                    if loss is None:  # a weight-0 repeat: same collectives, no contribution
                        loss = stats.logprobs.sum() * 0.0
                    started.append(rows)
                    self.engine.backward(loss, scale_wrt_gas=False)
                if real:
                    out.append((rows, TokenStats(stats.logprobs.detach(), None if stats.entropy is None
                                                 else stats.entropy.detach(), stats.mask)))
        if backward:
            self._pending += 1
        return out

    def zero_grad(self) -> None:
        """For callers that zero gradients before each accumulation (verl): ``step()`` already
        leaves them zero, so this only checks. Gradients of an unfinished accumulation cannot be
        dropped (ZeRO keeps them in its partitions): ``RuntimeError`` then, rather than silently
        adding them to the next step."""
        self._check_whole()
        if self._pending:
            raise RuntimeError(f"gradients of {self._pending} forward_backward call(s) are pending and "
                               "cannot be dropped: call step() first")

    def _logprobs(self, batch: RolloutBatch, *, entropy: bool, grad: bool,
                  temperature: float | None = None) -> TokenStats:
        from ..logprobs import compute_logprobs

        with torch.set_grad_enabled(grad):
            return compute_logprobs(self.module, batch, zorro=self.config.zorro, entropy=entropy,
                                    temperature=self.config.temperature if temperature is None else temperature,
                                    max_tokens_per_row=self.config.max_tokens_per_row,
                                    zorro_attention=self.config.zorro_attention,
                                    naive_layout=self.config.naive_layout)

    def compute_logprobs(self, batch: RolloutBatch, *, entropy: bool = False,
                         temperature: float | None = None) -> TokenStats:
        """Log-probs of ``batch`` under the current policy (no gradient); see ``LogProbEngine``."""
        from .logprob import sharded_logprobs

        self._check_onloaded()
        self._check_loaded()
        self.module.eval()
        return sharded_logprobs(self, batch, entropy=entropy,
                                temperature=self.config.temperature if temperature is None else temperature)

    # ------------------------------------------------------------------ state
    def save(self, path: str, *, hf_export: str | None = None) -> None:
        """Checkpoint weights, optimizer, LR schedule and step count to directory ``path``
        (every rank calls it; ZeRO partitions are saved per rank), with ``config.export_hf`` a
        Hugging Face export of the weights beside it in ``<path>/hf`` (``save_pretrained``;
        ``hf_export`` names another sub-directory for it and exports whatever ``export_hf``
        says, e.g. verl's ``huggingface``), then a manifest with the sha256 of every file (``polynya.files``; rank 0 writes it once
        every rank is done). A checkpoint already in ``path`` is removed first (the files its
        manifest lists; ``clear_checkpoint``). ``RuntimeError`` with gradients pending: the
        checkpoint would hold the state before them, and a resume would lose them."""
        self._check_onloaded()
        self._check_loaded()
        if hf_export is not None and not _export_folder(hf_export):
            raise ValueError(f"hf_export must name a sub-directory of the checkpoint other than its "
                             f"{CHECKPOINT_TAG!r} tag folder, got {hf_export!r}")
        if self._pending:
            raise RuntimeError(f"save() with the gradients of {self._pending} forward_backward call(s) "
                               "pending: the checkpoint would hold the state before them and a resume "
                               "would lose them. Call step() first")
        if self.rank == 0:
            clear_checkpoint(path)
        dsu.barrier()
        # the steps skipped here (plain fp32 ZeRO-0) are not in DeepSpeed's own count
        self.engine.save_checkpoint(path, tag=CHECKPOINT_TAG,
                                    client_state={OWN_SKIPPED: self._own_skipped,
                                                  dsu.MODEL_CONFIG: dsu.model_config_json(self.module)})
        if hf_export is not None or self.config.export_hf:
            self.save_pretrained(os.path.join(path, hf_export or HF_EXPORT))
        dsu.barrier()
        if self.rank == 0:
            write_manifest(path)
        dsu.barrier()

    def save_pretrained(self, path: str) -> str:
        """Write the current weights in Hugging Face format to directory ``path``: ``config.json``
        and safetensors of the consolidated weights (``export_weights``: ZeRO partitions
        gathered; the module's dtype, i.e. the weights the trainer computes with) plus the
        model's tokenizer, loadable by ``AutoModelForCausalLM.from_pretrained`` and vLLM. Every
        rank calls it; rank 0 writes. Returns ``path``."""
        from ..models import load_tokenizer

        self._check_onloaded()
        self._check_loaded()
        shapes = {n: dsu.full_shape(p) for n, p in self.module.named_parameters()}
        state = {}
        for names, flat in self.export_weights():
            for n, piece in zip(names, flat.cpu().split([shapes[n].numel() for n in names])):
                state[n] = piece.view(shapes[n]).clone()
        if self.rank == 0:
            self.module.save_pretrained(path, state_dict=state)
            load_tokenizer(self.config.model).save_pretrained(path)
        return path

    def load(self, path: str) -> None:
        """Restore a checkpoint written by ``save`` (same ZeRO stage and world size).

        Before anything is loaded, every file is checked against the checkpoint's manifest
        and every pickle is read with ``weights_only=True`` (tensors, containers and the few
        DeepSpeed types its state holds): a missing, corrupted, truncated or mismatched file,
        or a pickle holding anything else, is a ``CheckpointError`` naming the file, with the
        engine unchanged. A load that fails after DeepSpeed began (a file whose pickle is sound
        but whose contents DeepSpeed cannot use) may have replaced part of the state: the engine
        then refuses everything but another ``load`` until one succeeds.
        """
        self._check_onloaded()
        self._check_gradients()
        if self._pending:  # DeepSpeed keeps accumulated gradients across a checkpoint load
            raise RuntimeError(f"load() with the gradients of {self._pending} forward_backward call(s) "
                               "pending: the next step() would add them to the loaded state. Call step() "
                               "first, or load into a new TrainingEngine")
        verify_manifest(path)
        self._drop_checksum()
        began: list[bool] = []
        try:
            client = dsu.load_checkpoint(self.engine, path, tag=CHECKPOINT_TAG,
                                         began=lambda: began.append(True))
        except BaseException as exc:
            if began:  # DeepSpeed had begun: part of the state may be the checkpoint's
                self._half_loaded = f"a load({path!r}) failed part-way ({type(exc).__name__}: {exc})"
            raise
        self._half_loaded = None
        self._own_skipped = int(client.get(OWN_SKIPPED, 0))  # (0 in checkpoints from before it)

    def offload(self) -> dict[str, float]:
        """Move weights, gradients, fp32 master weights and optimizer state to host memory (for a
        colocated sampler); ``onload()`` brings them back. Needs ZeRO stage >= 1.

        Returns accelerator bytes ``before`` / ``after`` and the ``freed_fraction`` (0 on CPU,
        where the same moves run but the states already live in host memory).
        """
        if self._offloaded:
            return {"before": 0.0, "after": 0.0, "freed_fraction": 0.0}
        if self._pending:
            raise RuntimeError("offload() with gradients pending: call step() first")
        if self.config.zero_stage == 0:
            raise NotImplementedError("offload() needs ZeRO stage >= 1 (DeepSpeed's offload_states)")
        self._drop_checksum()
        before = _allocated(self.device)
        self._host = dsu.offload_engine(self.engine, pin_memory=self.device.type == "cuda",
                                        host=self._host)
        dsu.free_accelerator_cache()
        self._offloaded = True
        after = _allocated(self.device)
        return {"before": before, "after": after,
                "freed_fraction": (before - after) / before if before else 0.0}

    def make_room(self, nbytes: int) -> bool:
        """Offload unless ``nbytes`` are free on the device with the trainer resident (first
        as the device reports it, then after returning PyTorch's cached blocks); returns
        whether it offloaded. On the CPU nothing is ever moved: the states already live in
        host memory. The colocated hand-over's ``offload_trainer="auto"`` calls it."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"make_room needs a byte count >= 0, got {nbytes!r}")
        if self._offloaded or self.device.type != "cuda":
            return False
        if _free(self.device) >= nbytes:
            return False
        dsu.free_accelerator_cache()
        if _free(self.device) >= nbytes:
            return False
        self.offload()
        return True

    def onload(self) -> None:
        """Bring the states back after ``offload``."""
        if not self._offloaded:
            return
        dsu.reload_engine(self.engine, self.device)
        self._offloaded = False

    @contextlib.contextmanager
    def _whole_or_torn(self, planned: int):
        """Around a forward_backward's micro-batches: the caller appends each micro-batch's
        rows before its backward. An exception after one began leaves a partial gradient in
        DeepSpeed's buffers, which ZeRO cannot drop; the engine then refuses to accumulate or
        step on it (``_check_whole``) rather than train on part of a batch."""
        started: list = []
        try:
            yield started
        except BaseException as exc:
            if started:
                self._torn = (f"a forward_backward failed after the backward of {len(started)} of its "
                              f"{planned} micro-batches had begun ({type(exc).__name__}: {exc})")
            raise

    def _check_whole(self) -> None:
        """Refuse to train on a partial gradient or a partly loaded state."""
        self._check_loaded()
        self._check_gradients()

    def _check_gradients(self) -> None:
        if self._torn:
            raise RuntimeError(f"{self._torn}: its partial gradient is in DeepSpeed's buffers, which neither "
                               "ZeRO nor a load() drops, so step() would train on part of a batch. Build a "
                               "new TrainingEngine (and load(<checkpoint>) into it) to train on.")

    def _check_loaded(self) -> None:
        if self._half_loaded:
            raise RuntimeError(f"{self._half_loaded}: the engine may hold part of that checkpoint's "
                               "state (weights, optimizer, schedule). load() a sound checkpoint first")

    def _check_onloaded(self) -> None:
        if self._offloaded:
            raise RuntimeError("the engine is offloaded: call onload() first")

    # ------------------------------------------------------------------ weights
    def export_weights(self, bucket_bytes: int = 1 << 28) -> Iterator[tuple[list[str], torch.Tensor]]:
        """Full weights as ``(names, flat)`` pieces of at most ~``bucket_bytes`` each.

        ``names`` follow ``module.named_parameters()``; ``flat`` is 1-D (the weights' dtype, on
        the engine's device) with each tensor flattened in order. Under ZeRO-3 each bucket is
        gathered, copied and released before the next (never a second full copy); every rank
        must consume the generator.
        """
        self._check_onloaded()
        self._check_loaded()
        return dsu.export_buckets(self.module, bucket_bytes)

    def weight_checksum(self, bucket_bytes: int = 1 << 28) -> str:
        """``polynya.distributed.checksum_named_tensors`` of the full weights (all ranks call)."""
        self._check_loaded()
        return dsu.weights_checksum(self.module, bucket_bytes)

    def prepare_checksum(self) -> None:
        """Launch the digest of the current weights on a side CUDA stream without waiting;
        ``step()`` calls it after every update, so the next sync's ``build_manifest`` only
        collects it (``ready_checksum``) instead of reading the weights on the sync's path.
        CUDA with span weights (ZeRO-1/2) only; elsewhere a no-op."""
        self._drop_checksum()
        if self.device.type != "cuda" or self._offloaded:
            return
        found = span_layout(self.module)
        if found is None or not found[0].plan.kernel_ok(found[1]):
            return
        layout, spans = found
        if self._digest_stream is None:
            self._digest_stream = torch.cuda.Stream(self.device)
        self._ready = (layout, layout.seen, PendingChecksum(layout.plan, layout.prefixes, spans,
                                                            self._digest_stream))

    def ready_checksum(self) -> str | None:
        """The checksum ``prepare_checksum`` launched, when the weights have not changed through
        the engine since and still lie where they did (as the last ``span_layout`` call saw
        them: ``build_manifest`` makes one first); ``None`` otherwise. Weights must change
        only through the engine's methods: a change made behind its back makes the next sync
        fail its checksum (``SyncError``), it never applies the wrong weights."""
        if self._ready is None:
            return None
        layout, seen, pending = self._ready
        # the module's layout and ``seen`` unchanged: no span_layout call has seen the weights
        # move since the launch (build_manifest makes one first); else compare the pointers
        unmoved = cached_layout(self.module) is layout and layout.seen is seen
        if not unmoved and layout.recheck(seen) is None:  # moved or gone since the launch
            self._drop_checksum()
            return None
        return pending.result()

    def _drop_checksum(self) -> None:
        """Before the weights change or move: the current stream waits for a pending digest."""
        if self._ready is not None:
            self._ready[2].wait()
            self._ready = None


def _free(device: torch.device) -> int:
    return int(torch.cuda.mem_get_info(device)[0])


def _allocated(device: torch.device) -> float:
    if device.type != "cuda":
        return 0.0
    torch.cuda.synchronize(device)
    return float(torch.cuda.memory_allocated(device))
