"""``framework=verl``: the same recipe as a verl run with polynya's engines swapped in.

    polynya-recipe framework=verl task=gsm8k model=qwen3-0.6b run.steps=200   # writes the run
    polynya-recipe framework=verl task=gsm8k ... run.launch=true              # and launches it

Writes under ``<run.out_dir>/verl/``: ``train.parquet`` (the task's examples in verl's RL dataset
format: chat ``prompt``, ``data_source`` = task, ``reward_model.ground_truth``), ``overrides.txt``
(one Hydra override of verl's ``ppo_trainer.yaml`` per line) and ``run.sh``
(``python -m verl.trainer.main_ppo`` with them). The overrides are a translation of the recipe —
the same data, reward (``polynya.adapters.verl.reward`` calls the task's own ``reward`` with
``task.reward``), sampling, batch shape, learning rate and loss as ``framework=builtin`` — plus
``polynya.adapters.verl.overrides.SWAP``. Known differences: verl's GRPO divides by the unbiased
group std, the builtin driver by the biased one; verl adds a fixed 1e-6 to it (a changed
``run.advantage_eps`` is refused); a group of one sample gets its raw reward as advantage in
verl, where the builtin driver refuses ``run.group_size=1`` (its advantage would be 0);
and a completion the reward cannot judge (it raises, or returns NaN) is verl's to handle, not
left out of its group as the builtin driver and ``framework=trl`` do.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

from omegaconf import DictConfig

from ...adapters.verl.overrides import SWAP, engine_overrides
from . import reject_builtin_only, reject_fixed_eps, reject_loss_clamps
from ..schema import to_client_config
from ..tasks import get_task

_NORM_TO_AGG = {"token": "token-mean", "sequence": "seq-mean-token-mean", "constant": "seq-mean-token-sum-norm"}
_KL = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}
NO_CLIP = 1e9  # verl's clip_grad for polynya's grad_clip=0: a gradient norm no run reaches


def run(cfg: DictConfig) -> None:
    out = Path(cfg.run.out_dir) / "verl"
    overrides = write_run(cfg, out)
    print(f"verl run written to {out}: run.sh, overrides.txt ({len(overrides)} overrides), train.parquet",
          flush=True)
    if cfg.run.launch:
        subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *overrides], check=True)


def write_run(cfg: DictConfig, out: Path) -> list[str]:
    """Write the data, the overrides and ``run.sh``; return the overrides."""
    reject_builtin_only(cfg, "verl")
    reject_fixed_eps(cfg, "verl", 1e-6)
    client = to_client_config(cfg.client)
    _check(cfg, client)
    reject_loss_clamps(client.train.loss_config, "verl", "verl 0.9.1's losses clamp the log-ratio "
                                                         "to +-20 and k3 (low_var_kl) to +-10 themselves")
    out.mkdir(parents=True, exist_ok=True)
    data = write_data(cfg, out / "train.parquet")
    overrides = [*SWAP, *translate(cfg, client, data)]
    (out / "overrides.txt").write_text("\n".join(overrides) + "\n")
    cmd = " \\\n    ".join(["python3 -m verl.trainer.main_ppo", *map(shlex.quote, overrides)])
    (out / "run.sh").write_text(f"#!/usr/bin/env bash\n# written by polynya-recipe framework=verl\nset -e\n{cmd}\n")
    (out / "run.sh").chmod(0o755)
    return overrides


def _check(cfg: DictConfig, client) -> None:
    if not cfg.task.chat_template:
        raise ValueError("verl's RL dataset always applies the tokenizer's chat template: set task.chat_template=true")
    if client.model_name.startswith(("tiny:", "random:")):
        raise ValueError(f"verl loads models from an HF id or a local directory, not {client.model_name!r}: "
                         "choose e.g. model=qwen3-0.6b or client.model_name=/path/to/model")
    if not client.colocate:
        raise ValueError("framework=verl maps the colocated placement (verl's hybrid engine); "
                         "placement=split is not translated")
    if client.sampler != "native":
        raise ValueError("framework=verl runs polynya's native sampler (client.sampler=native)")


def write_data(cfg: DictConfig, path: Path) -> str:
    """The task's ``train_split`` examples as verl's RL parquet; returns its path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    task = cfg.task.name
    examples = get_task(task).load(cfg.task.train_split, cfg.task.source)
    rows = [{"data_source": task, "prompt": [{"role": "user", "content": ex.prompt}], "ability": task,
             "reward_model": {"style": "rule", "ground_truth": ex.answer},
             "extra_info": {"index": i, "prompt": ex.prompt, "meta": json.dumps(ex.meta)}}
            for i, ex in enumerate(examples)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path.resolve())


def translate(cfg: DictConfig, client, data: str) -> list[str]:
    """The recipe's settings as verl overrides (besides ``SWAP``)."""
    from ...adapters.verl import reward
    from ...losses import resolve_loss

    rc, train = cfg.run, client.train
    spec = resolve_loss(train.loss, train.loss_config)
    actor = "actor_rollout_ref.actor"
    lines = [
        f"data.train_files={data}", f"data.val_files={data}", "data.filter_overlong_prompts=true",
        f"data.train_batch_size={rc.prompts_per_step}", f"data.max_prompt_length={cfg.task.max_prompt_tokens}",
        f"data.max_response_length={rc.max_new_tokens}", f"data.seed={rc.seed}",
        f"actor_rollout_ref.model.path={client.model_name}",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={str(train.gradient_checkpointing).lower()}",
        f"actor_rollout_ref.rollout.n={rc.group_size}", f"actor_rollout_ref.rollout.temperature={train.temperature}",
        f"actor_rollout_ref.rollout.top_p={rc.top_p}", f"actor_rollout_ref.rollout.top_k={rc.top_k}",
        f"actor_rollout_ref.rollout.dtype={client.dtype}",
        f"{actor}.optim.lr={train.lr}", f"{actor}.optim.weight_decay={train.optim.weight_decay}",
        # polynya's grad_clip=0 (no clipping) as verl reads it: a bound no norm reaches (verl's
        # engine would clip to 0, zeroing every gradient; the adapter refuses clip_grad <= 0)
        f"{actor}.optim.clip_grad={train.optim.grad_clip or NO_CLIP}",
        f"{actor}.ppo_mini_batch_size={rc.prompts_per_step}", f"{actor}.ppo_epochs=1",
        f"{actor}.ppo_max_token_len_per_gpu={train.micro_batch_tokens}",
        f"{actor}.clip_ratio_low={spec.clip_low}", f"{actor}.clip_ratio_high={spec.clip_high}",
        f"{actor}.loss_agg_mode={_NORM_TO_AGG[spec.norm]}", f"{actor}.entropy_coeff={spec.entropy_coef}",
        f"{actor}.use_kl_loss={str(spec.kl_coef > 0).lower()}", f"{actor}.kl_loss_coef={spec.kl_coef}",
        f"{actor}.kl_loss_type={_KL[spec.kl_estimator]}",
        *engine_overrides(zero_stage=train.zero_stage, zorro=client.zorro_train, dtype=client.dtype),
        "algorithm.adv_estimator=grpo", f"algorithm.norm_adv_by_std_in_grpo={str(rc.scale_advantages).lower()}",
        "algorithm.use_kl_in_reward=false",
        f"reward.custom_reward_function.path={reward.__file__}", "reward.custom_reward_function.name=compute_score",
        *[f"+reward.custom_reward_function.reward_kwargs.{k}={v}" for k, v in cfg.task.reward.items()],
        f"trainer.total_training_steps={rc.steps}", "trainer.nnodes=1",
        f"trainer.n_gpus_per_node={client.training_gpus}", "trainer.project_name=polynya",
        f"trainer.experiment_name={cfg.task.name}", "trainer.logger=[console]",
        f"trainer.default_local_dir={Path(rc.out_dir).resolve() / 'verl' / 'checkpoints'}",
        f"trainer.save_freq={rc.checkpoint_every or -1}", "trainer.test_freq=-1", "trainer.val_before_train=false",
    ]
    if spec.sequence_ratio:
        lines.append(f"{actor}.policy_loss.loss_mode=gspo")
    if spec.norm == "constant":
        lines.append(f"{actor}.loss_scale_factor={spec.max_response_len or rc.max_new_tokens}")
    return lines
