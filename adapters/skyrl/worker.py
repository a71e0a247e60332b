"""SkyRL's policy / reference worker calls on polynya's engines.

    worker = PolicyWorker(train_config_from_skyrl(cfg.trainer, "Qwen/Qwen3-0.6B", dtype="bfloat16"))
    metrics = worker.forward_backward(training_input_batch)   # SkyRL's whole mini-batch
    grad_norm = worker.optim_step()
    old_logprobs = worker.forward(training_input_batch)       # [B, R] right-aligned, as SkyRL's

``forward_backward`` takes the batch exactly as SkyRL's trainer hands it to its workers
(``TrainingInputBatch``: padded ``sequences``, right-aligned masks, pre-scaled ``advantages``,
``action_log_probs``, ``base_action_log_probs`` when the KL loss is on), runs polynya's
DeepSpeed ``TrainingEngine`` on it (ZoRRo: each prompt once) and returns SkyRL's metric names.
The training engine owns micro-batching (by tokens) and normalisation over the whole batch, so
SkyRL's ``micro_train_batch_size_per_gpu`` does not apply. Data parallelism is the engine's too:
with several ranks every rank must pass the same whole mini-batch (the engine shards it by prompt
groups); SkyRL's per-rank DP shards are refused at the first call (``ValueError``: the batch
differs between data-parallel ranks), so gather them first. Only one rank has been run.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from polynya.config.logprob import LogProbConfig
from polynya.config.train import TrainConfig

from .batch import rollout_from_training_batch, to_right_aligned


def _width(data: Mapping) -> int:
    return int(data["response_mask"].shape[1])


class PolicyWorker:
    """SkyRL's ``PolicyWorkerBase`` calls (``forward_backward`` / ``optim_step`` / ``forward``)."""

    def __init__(self, config: TrainConfig) -> None:
        from polynya.engines import TrainingEngine

        self.config = config
        self.engine = TrainingEngine(config)

    def forward_backward(self, data: Mapping) -> dict[str, float]:
        """Accumulate the gradient of SkyRL's policy loss over ``data``; SkyRL's metric names."""
        kl_on = self.engine.loss_spec.kl_coef > 0
        if kl_on and not torch.equal(data["loss_mask"].float(), data["response_mask"].float()):
            raise ValueError("the KL loss with a loss_mask narrower than the response (multi-turn "
                             "observation tokens, rows zeroed by filters or DP padding) or with "
                             "weights other than 1 is not supported by the polynya worker: SkyRL "
                             "averages the KL over the loss mask, polynya over the response")
        batch = rollout_from_training_batch(data, with_advantages=True, with_ref=kl_on)
        m = self.engine.forward_backward(batch)
        out = {"final_loss": m["loss"], "policy_loss": m["pg_loss"],
               "loss_metrics/clip_ratio": m["clip_frac"], "response_length": _width(data)}
        if "kl" in m:
            out["policy_kl"] = m["kl"]
        return out

    def optim_step(self) -> float:
        """One optimizer update; the gradient norm before clipping."""
        return self.engine.step()["grad_norm"]

    def forward(self, data: Mapping) -> torch.Tensor:
        """Current-policy log-probs of the responses, ``[B, R]`` right-aligned like SkyRL's."""
        stats = self.engine.compute_logprobs(rollout_from_training_batch(data, with_advantages=False))
        return to_right_aligned(stats.logprobs, stats.mask, _width(data))


class RefWorker:
    """SkyRL's ``RefWorkerBase.forward`` on polynya's forward-only ``LogProbEngine``.

    SkyRL's reference worker scores at temperature 1.0 whatever ``trainer.algorithm.temperature``
    is (``RefWorkerBase._forward_micro_batch``; the algorithm's temperature only with
    sample-support replay, which the polynya worker refuses), so its KL loss / KL reward compares
    the policy at that temperature with the reference at 1.0; a ``LogProbConfig`` with another
    temperature is refused (``ValueError``).
    """

    def __init__(self, config: LogProbConfig) -> None:
        from polynya.engines import LogProbEngine

        if config.temperature != 1.0:
            raise ValueError(f"LogProbConfig.temperature={config.temperature!r}: SkyRL's reference "
                             "worker takes its log-probs at temperature 1.0 (trainer.algorithm."
                             "temperature is the policy's only), so base_action_log_probs at another "
                             "temperature would change the KL term; set LogProbConfig.temperature=1.0")
        self.engine = LogProbEngine(config)

    def forward(self, data: Mapping) -> torch.Tensor:
        """Reference log-probs, ``[B, R]`` right-aligned (SkyRL's ``base_action_log_probs``)."""
        stats = self.engine.compute_logprobs(rollout_from_training_batch(data, with_advantages=False))
        return to_right_aligned(stats.logprobs, stats.mask, _width(data))
