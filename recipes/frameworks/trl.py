"""``framework=trl``: the recipe's task, data, reward and hyper-parameters through TRL's
``GRPOTrainer`` on polynya's engines (``polynya.adapters.trl``; ``pip install 'polynya[trl]'``).

    polynya-recipe framework=trl task=toy          # CPU, tiny model, a few minutes

Translation (nothing else): the task's prompts (loaded and filtered by the built-in driver's own
code, ``GRPODriver(cfg).examples``; no engine is built) become a TRL dataset, the task's ``reward`` a TRL reward function;
``run`` and ``client.train`` map onto ``GRPOConfig`` (one optimizer step per
``prompts_per_step x group_size`` batch, as the built-in driver); ``client.sampling`` is the
sampler's ``SamplerConfig`` and ``client.zorro_train`` turns ZoRRo on or off. A ``tiny:`` /
``random:`` model is written once to ``<out_dir>/init_model`` (TRL loads checkpoints by path).
TRL runs single-process here (``client.train.zero_stage`` is not translated); metrics go to
``<out_dir>/metrics.jsonl`` with the built-in driver's names for the shared ones.
"""
from __future__ import annotations

import dataclasses
import json
import os

from omegaconf import DictConfig

from ...losses import resolve_loss
from ...models import is_synthetic, load_model, load_tokenizer
from ..driver import GRPODriver
from ..schema import to_client_config
from ..tasks.common import describe, judge
from . import reject_builtin_only, reject_fixed_eps, reject_loss_clamps
from ..metrics import MetricsLogger

# polynya loss -> (TRL loss_type, importance_sampling_level)
_LOSSES = {"grpo": ("grpo", "token"), "dapo": ("dapo", "token"), "dr_grpo": ("dr_grpo", "token"),
           "gspo": ("grpo", "sequence")}
# TRL's log keys -> the built-in driver's metric names
_NAMES = {"reward": "reward_mean", "reward_std": "reward_std", "completions/mean_length": "response_len",
          "completions/clipped_ratio": "truncated_frac", "step_time": "step_s"}


def run(cfg: DictConfig) -> None:
    try:
        import torch
        from datasets import Dataset
        from transformers import PrinterCallback, TrainerCallback

        from ...adapters.trl import GRPOTrainer
    except ImportError as exc:
        raise ImportError(f"framework=trl needs TRL: pip install 'polynya[trl]' ({exc})") from exc

    reject_builtin_only(cfg, "trl")
    reject_fixed_eps(cfg, "trl", 1e-4)
    reject_loss_clamps(to_client_config(cfg.client).train.loss_config, "trl",
                       "TRL's GRPOTrainer clamps neither log-ratios nor its KL estimate")
    data = GRPODriver(cfg)  # the built-in driver's task, filtered prompts, reward options, config
    client, task, examples, tokenizer = data.client_config, data.task, data.examples, data.tokenizer
    rc, out_dir, reward_kwargs = cfg.run, cfg.run.out_dir, data.reward_kwargs
    os.makedirs(out_dir, exist_ok=True)
    model_path = _model_path(client, out_dir)

    task_reward = reward_function(task, examples, reward_kwargs)
    dataset = Dataset.from_list([{"prompt": _prompt(ex.prompt, cfg.task.chat_template, tokenizer),
                                  "example_index": i} for i, ex in enumerate(examples)])
    cuda = torch.cuda.is_available() and client.train.device != "cpu"
    sampling = client.sampling
    if is_synthetic(sampling.model):
        sampling = dataclasses.replace(sampling, model=model_path)
    start = _resumed_step(out_dir, rc.resume)  # before anything in out_dir changes
    logger = MetricsLogger(out_dir, total_steps=rc.steps, start_step=start, progress=rc.progress,
                           tensorboard=rc.tensorboard)

    class Metrics(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                logger.log(state.global_step - 1, {_NAMES.get(k, k): v for k, v in logs.items()})

    trainer = GRPOTrainer(model_path, reward_funcs=task_reward, args=grpo_config(cfg, client, cuda),
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[Metrics()],
                          sampler_config=sampling, zorro=client.zorro_train)
    trainer.remove_callback(PrinterCallback)  # MetricsLogger prints each step instead
    try:
        trainer.train(resume_from_checkpoint=True if start else None)
    finally:
        logger.close()
    print(f"metrics: {os.path.abspath(logger.path)}", flush=True)


def reward_function(task, examples: list, reward_kwargs: dict):
    """The task's ``reward`` as a TRL reward function (``rewards/<task>_reward/mean`` in TRL's
    logs). A completion the reward cannot judge (it raised, or returned NaN/inf) gets ``None``,
    which TRL (>= 1.16) leaves out of its group's mean and std and trains with advantage 0, as
    the built-in driver does; a warning names the first such prompt of each batch."""
    def reward(completions, example_index, **kwargs):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        out, failures = [], []
        for text, i in zip(texts, example_index, strict=True):
            r, why = judge(task, text, examples[i], reward_kwargs)
            out.append(None if why is not None else r)
            if why is not None:
                failures.append((i, why))
        if failures:
            i, why = failures[0]
            print(f"warning: {len(failures)} of {len(out)} completions could not be judged (scored None: "
                  f"left out of their groups); first: train example {i} ({describe(examples[i])}): {why}",
                  flush=True)
        return out

    reward.__name__ = f"{task.NAME}_reward"
    return reward


def _resumed_step(out_dir: str, resume: bool) -> int:
    """The step TRL resumes ``out_dir``'s run at (its latest ``checkpoint-N``'s ``global_step``),
    0 for a fresh run; ``ValueError`` when ``out_dir`` holds a run that would be overwritten
    (``run.resume=false``, or no checkpoint to resume from): its metrics and checkpoints would
    mix with the new run's."""
    checkpoints = sorted((int(d.split("-", 1)[1]), d) for d in os.listdir(out_dir)
                         if d.startswith("checkpoint-") and d.split("-", 1)[1].isdigit())
    if resume and checkpoints:
        with open(os.path.join(out_dir, checkpoints[-1][1], "trainer_state.json")) as f:
            return int(json.load(f)["global_step"])
    if checkpoints or os.path.exists(os.path.join(out_dir, "metrics.jsonl")):
        why = "run.resume=false" if checkpoints else "it has no TRL checkpoint to resume from"
        raise ValueError(f"{os.path.abspath(out_dir)} already holds a run (metrics.jsonl / checkpoint-*) and "
                         f"{why}: pass a new run.out_dir=... (or delete that run first)")
    return 0


def grpo_config(cfg: DictConfig, client, cuda: bool):
    """The recipe's ``run`` / ``client.train`` settings as TRL's ``GRPOConfig``."""
    from trl import GRPOConfig

    rc, train = cfg.run, client.train
    loss, opt = train.loss, train.optim
    if loss not in _LOSSES:
        raise ValueError(f"client.train.loss={loss!r} has no TRL GRPOTrainer equivalent; use one of {sorted(_LOSSES)}")
    spec = resolve_loss(loss, train.loss_config)
    if spec.entropy_coef or spec.kl_estimator != "k3" or spec.norm != resolve_loss(loss).norm:
        raise ValueError("framework=trl: the recipe maps no entropy bonus to TRL (its entropy_coef "
                         "is a per-micro-batch token mean), TRL estimates KL with k3 and normalises "
                         "as its loss_type does; leave loss_config.entropy_coef, kl_estimator and "
                         "norm at their defaults")
    loss_type, level = _LOSSES[loss]
    batch = rc.prompts_per_step * rc.group_size
    return GRPOConfig(
        output_dir=rc.out_dir, max_steps=rc.steps, seed=rc.seed, data_seed=rc.seed,
        per_device_train_batch_size=batch, gradient_accumulation_steps=1, num_generations=rc.group_size,
        max_completion_length=rc.max_new_tokens, temperature=train.temperature, top_p=rc.top_p,
        top_k=0 if rc.top_k == -1 else rc.top_k,
        scale_rewards="group" if rc.scale_advantages else "none",
        loss_type=loss_type, importance_sampling_level=level, epsilon=spec.clip_low,
        epsilon_high=spec.clip_high, beta=spec.kl_coef,
        learning_rate=train.lr, adam_beta1=opt.betas[0], adam_beta2=opt.betas[1], adam_epsilon=opt.eps,
        weight_decay=opt.weight_decay, lr_scheduler_type=opt.schedule, warmup_steps=opt.warmup_steps,
        max_grad_norm=opt.grad_clip or None,
        gradient_checkpointing=train.gradient_checkpointing,
        use_cpu=not cuda, bf16=cuda and client.dtype == "bfloat16",
        model_init_kwargs={"dtype": client.dtype},
        logging_steps=1, report_to=[], disable_tqdm=True,
        save_strategy="steps" if rc.checkpoint_every else "no", save_steps=rc.checkpoint_every or 500,
        save_total_limit=rc.keep_checkpoints,
    )


def _prompt(text: str, chat: bool, tokenizer):
    if chat and getattr(tokenizer, "chat_template", None):
        return [{"role": "user", "content": text}]
    return text


def _model_path(client, out_dir: str) -> str:
    """``client.model_name`` as a path TRL can load: a ``tiny:`` / ``random:`` spec is built with
    the training engine's seed and saved (with its tokenizer) to ``<out_dir>/init_model``."""
    spec = client.model_name
    if not is_synthetic(spec):
        return spec
    path = os.path.join(out_dir, "init_model")
    if not os.path.exists(os.path.join(path, "config.json")):
        load_model(spec, seed=client.train.seed).save_pretrained(path)
        load_tokenizer(spec).save_pretrained(path)
    return path
