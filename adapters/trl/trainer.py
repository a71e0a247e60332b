"""``polynya.adapters.trl.GRPOTrainer``: TRL's ``GRPOTrainer`` on polynya's engines.

    from polynya.adapters.trl import GRPOTrainer          # instead of: from trl import GRPOTrainer
    from polynya.config import SamplerConfig
    trainer = GRPOTrainer(model, reward_funcs, args=GRPOConfig(...), train_dataset=ds,
                          sampler_config=SamplerConfig(model_path, dtype="bfloat16"), zorro=True)
    trainer.train()

Everything TRL does stays TRL's (datasets, rewards, advantages, loss types, logging, callbacks,
accelerate/DeepSpeed set-up). Three of its hooks are translated to polynya:

- ``_generate_single_turn``: TRL's prompts (each repeated ``num_generations`` times in a row) go
  to polynya's native sampler in-process as one request per prompt with ``n`` = its repeats
  (prefilled once, ``n`` forks share its KV blocks), sampled as transformers' ``generate`` would
  with TRL's ``generation_config`` (``GRPOConfig``'s settings with ``generation_kwargs`` merged
  over them, as TRL does) completed by the policy's (``translate.sampling_params``: a ``min_p``
  inherited from the checkpoint's ``generation_config.json`` is applied, as there). Of
  ``generation_kwargs``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``do_sample``
  (``False``: greedy, the first argmax), ``max_new_tokens`` and ``min_new_tokens`` are
  translated; accepted as they leave the tokens unchanged: ``eos_token_id`` equal to TRL's EOS
  ids, the off values of the refused settings below, ``use_cache``, ``pad_token_id``,
  ``bos_token_id``, ``output_scores``, ``output_logits``, ``renormalize_logits``. Log-probs keep
  ``GRPOConfig.temperature``, as TRL's own do. Completions come back in TRL's row order
  and, as from TRL's own non-vLLM generation, without sampling log-probs (TRL would read them
  as vLLM's: its off-policy sequence mask, ``off_policy_mask_threshold``, would compare against
  the sampler instead of the old policy). Before generating, the sampler gets the trainer's
  current weights if an optimizer step happened since the last push, verified by checksum.
- ``_get_per_token_logps_and_entropies``: the padded batch becomes a ``RolloutBatch`` and goes
  through ``polynya.compute_logprobs`` (ZoRRo: each prompt computed once per micro-batch).
- ``_prepare_inputs``: TRL shuffles the generation batch row by row and splits it into
  ``steps_per_generation`` micro-batches; here whole groups are shuffled, so every micro-batch
  holds whole prompt groups (what lets ZoRRo share the prompt). That leaves the accumulated
  loss and gradient unchanged only where TRL's loss is a sum of per-row terms over fixed
  denominators (``grpo``, ``dr_grpo``, ``dapo``, ``cispo``, ``sapo``, ``luspo``, ``vespo``);
  where it normalises or thresholds per micro-batch (``loss_type="bnpo"``, the entropy bonus
  ``entropy_coef`` / ``use_adaptive_entropy``, ``top_entropy_quantile < 1``) the split is TRL's
  own row shuffle (``micro_batches_follow_trl``), so every micro-batch is one TRL would form.

Not supported (refused at construction with the reason): vLLM (``use_vllm``), PEFT, vision-
language models, MoE router aux loss, ``cast_lm_head_to_fp32``, ``repetition_penalty != 1``
(``GRPOConfig``'s unless ``generation_kwargs`` overrides it), every other ``generation_kwargs``
key (each named with why: unknown keys such as vLLM's ``min_tokens``, ``max_length``, and
``translate._NO_COUNTERPART``'s when on), generation settings the sampler cannot reproduce
(``min_p`` with ``top_p < 1``, other EOS ids than TRL's, a logits processor such as
``no_repeat_ngram_size`` inherited from the model's ``generation_config``, ``temperature=0``
while sampling), a sampler checkpoint configured unlike the policy (e.g. a
``rope_parameters`` given in ``model_init_kwargs``), a sampler whose ``max_model_len`` cannot hold
``max_completion_length`` (or a larger ``generation_kwargs`` ``max_new_tokens``),
multi-process DDP/FSDP (DeepSpeed is the data-parallel path). A prompt that leaves the sampler less
than that many tokens is refused when it is tokenized (``ValueError``, nothing
generated).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import torch
import trl
from transformers import TrainerCallback
from trl.trainer.utils import (
    split_pixel_values_by_grid,
    split_tensor_dict,
    unsplit_pixel_values_by_grid,
)

from ...compiled_layers import compile_layers as compile_model_layers
from ...compiled_layers import compile_reason
from ...config.sampler import SamplerConfig
from ...engines.sample import SamplingEngine
from ...fused import fuse_model
from ...logprobs import _device, compute_logprobs
from ...models import model_config
from ...sync.push import WeightPush
from ...types import SamplingParams
from .translate import (
    check_groups,
    config_differences,
    generation_kwargs_problems,
    group_chunks,
    group_permutation,
    permute_rows,
    rollout_batch,
    sampling_params,
    to_trl_layout,
    unique_prompts,
)


class _PushWeights(TrainerCallback):
    """After every optimizer step, the sampler gets the trainer's weights (checked); after
    training, the push's staging buffer is freed."""

    def __init__(self, trainer: GRPOTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.push_weights()

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer._push.release()  # the staging buffer (if any) is not needed until the next push


class GRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` with generation, log-probs and batching on polynya (module docstring).

    Args:
        *args, **kwargs: exactly ``trl.GRPOTrainer``'s.
        sampler_config: the native sampler (``SamplerConfig``); default: the policy's own
            checkpoint (``model`` if a path/id, else ``model.config._name_or_path``) in the
            policy's dtype on the accelerator's device, sampling seed ``args.seed`` + the
            process index. Its weights are replaced by the policy's at construction either way.
        zorro: log-probs with ZoRRo (shared prompts computed once); False: one row per sample.
        fused_kernels: the policy's and the reference model's RMSNorms and RoPE run as fused
            Triton kernels on CUDA (``polynya.fused.fuse_model``: HF's exact math in fewer
            launches); default off. CPU runs are unchanged either way.
        compile_layers: the policy's and the reference model's decoder layers run as two
            ``torch.compile`` regions around their attention (``polynya.compiled_layers``: fused
            element-wise kernels around the GEMMs, attention unchanged; ~15 s of compiling at
            the first step; 1.16-1.25x the eager adapter's GSM8K-like step on an H200).
            ``None`` (default): on when the models are on a CUDA device, their decoder layers
            are supported (Llama, Qwen2, Qwen3, Mistral), ``fused_kernels`` and TRL's
            ``torch_compile`` are off, DeepSpeed is not at ZeRO-3 and the run is one process (what the H200 runs verified); off
            otherwise (``compiled_layers`` says which). ``True`` insists
            (a ``ValueError`` where it cannot), ``False`` keeps the eager forwards.
    """

    def __init__(self, *args, sampler_config: SamplerConfig | None = None, zorro: bool = True,
                 fused_kernels: bool = False, compile_layers: bool | None = None, **kwargs):
        for name, value in (("zorro", zorro), ("fused_kernels", fused_kernels)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")
        if compile_layers is not None and not isinstance(compile_layers, bool):
            raise ValueError(f"compile_layers must be a bool or None, got {compile_layers!r}")
        if fused_kernels and compile_layers:
            raise ValueError("fused_kernels and compile_layers both replace the layers' forwards: "
                             "pick one")
        if sampler_config is not None and not isinstance(sampler_config, SamplerConfig):
            raise ValueError(f"sampler_config must be a polynya SamplerConfig, got {type(sampler_config).__name__}")
        _check_args(kwargs.get("args", args[2] if len(args) > 2 else None), kwargs)
        super().__init__(*args, **kwargs)
        self.zorro = zorro
        self._check_trainer()
        self._sampling = sampling_params(self._generation_in_effect(), self.eos_token_ids)
        config = self._sampler_config(sampler_config, args, kwargs)
        self._check_same_model(config.model)
        models = [self.accelerator.unwrap_model(m) for m in (self.model, self.ref_model) if m is not None]
        if compile_layers is None:
            compile_layers = self._why_not_compiled(models, fused_kernels) is None
        elif compile_layers and (why := self._compile_refusal(models)):
            raise ValueError(f"compile_layers=True cannot run: {why} (pass compile_layers=False, or "
                             "run without GRPOConfig(torch_compile=True) and ZeRO-3)")
        self.compiled_layers = compile_layers
        if compile_layers:
            for model in models:
                compile_model_layers(model)
        if fused_kernels:
            for model in models:
                fuse_model(model)
        with _plain_model_loading(self.args):
            self.sampler = SamplingEngine(config)
        self._check_room(1)
        self._pushed_step: int | None = None
        self._push = WeightPush()
        self.push_weights()
        self.add_callback(_PushWeights(self))

    # ------------------------------------------------------------------ set-up checks
    def _compile_refusal(self, models: list[torch.nn.Module]) -> str | None:
        """Why the layers cannot be compiled in this run at all (``True`` is refused with it)."""
        if self.args.torch_compile:
            return "TRL's torch_compile is on"
        if self.is_deepspeed_enabled and self._dist.is_zero3:
            return "DeepSpeed ZeRO-3"
        return next(filter(None, map(compile_reason, models)), None)

    def _why_not_compiled(self, models: list[torch.nn.Module], fused_kernels: bool) -> str | None:
        """Why ``compile_layers=None`` leaves the models eager, or None to compile them."""
        if fused_kernels:
            return "fused_kernels is on"
        if why := self._compile_refusal(models):
            return why
        if self.accelerator.num_processes > 1:
            return "several processes (verified on one GPU only: pass compile_layers=True)"
        if any(_device(m).type != "cuda" for m in models):
            return "not on a CUDA device"
        return None

    def _check_trainer(self) -> None:
        if self._is_vlm:
            raise ValueError("polynya's TRL adapter supports text-only models; vision-language "
                             "models need trl.GRPOTrainer")
        if self.aux_loss_enabled:
            raise ValueError("the MoE router aux loss (router_aux_loss_coef != 0) is not computed by "
                             "polynya.compute_logprobs; set router_aux_loss_coef=0")
        if self.accelerator.num_processes > 1 and not self.is_deepspeed_enabled:
            raise ValueError("with several processes polynya's TRL adapter needs DeepSpeed "
                             "(accelerate launch --config_file <deepspeed zero config>): log-probs "
                             "run on the unwrapped model, which DDP/FSDP would not synchronise")
        g = self.num_generations
        if self.args.per_device_train_batch_size % g:
            raise ValueError(f"per_device_train_batch_size={self.args.per_device_train_batch_size} must "
                             f"be a multiple of num_generations={g} so every micro-batch holds whole "
                             "prompt groups")

    def _check_same_model(self, spec: str) -> None:
        """``ValueError`` unless the sampler's checkpoint is configured as the policy is: a
        config field set at load (``GRPOConfig.model_init_kwargs``, e.g. ``rope_parameters``) is
        in the policy but not in the checkpoint the sampler loads, which would then sample from
        another model with the same weights (the weight push checks weights only)."""
        policy = self.accelerator.unwrap_model(self.model).config.to_dict()
        diff = config_differences(policy, model_config(spec).to_dict())
        if diff:
            raise ValueError(f"the sampler's checkpoint {spec!r} is configured unlike the policy "
                             f"({'; '.join(diff)}), so it would sample from another model: save the "
                             "policy (model.save_pretrained(dir)) and pass SamplerConfig(dir, ...)")

    def _generation_in_effect(self):
        """TRL's ``generation_config`` as transformers' ``generate`` completes it on TRL's own
        generation path: unset fields from the policy's ``generation_config`` (its checkpoint's
        ``generation_config.json``), then transformers' defaults."""
        policy = self.accelerator.unwrap_model(self.model)
        return policy._prepare_generation_config(self.generation_config)[0]

    def _check_room(self, prompt_len: int) -> None:
        """``ValueError`` unless a prompt of ``prompt_len`` tokens leaves the sampler room for all
        the tokens TRL's own generation would keep (it would end a completion early at its
        ``max_model_len``; TRL's would not): ``max_completion_length``, or ``generation_kwargs``'
        ``max_new_tokens`` where larger (a turn generates that many; a tool-calling rollout's
        completion keeps up to ``max_completion_length`` over its turns)."""
        longest = self.sampler.max_model_len
        budget = max(self._sampling.max_tokens, self.max_completion_length)
        name = ("max_completion_length" if budget == self.max_completion_length
                else "generation_kwargs max_new_tokens")
        if prompt_len + budget > longest:
            raise ValueError(f"a prompt of {prompt_len} tokens plus {name}={budget} exceeds the "
                             f"sampler's max_model_len={longest}: its completions would be cut "
                             "short; raise SamplerConfig.max_model_len / kv_cache_memory_gb or "
                             f"lower {name}")

    def _sampler_config(self, config: SamplerConfig | None, args, kwargs) -> SamplerConfig:
        policy = self.accelerator.unwrap_model(self.model)
        device = str(self.accelerator.device)
        if config is None:
            model = kwargs.get("model", args[0] if args else None)
            spec = model if isinstance(model, str) else policy.config._name_or_path
            if not spec:
                raise ValueError("cannot tell which checkpoint the sampler should load: pass "
                                 "sampler_config=SamplerConfig(<path or id>, ...)")
            dtype = str(policy.dtype).removeprefix("torch.")
            seed = self.args.seed + self.accelerator.process_index  # distinct samples per rank
            return SamplerConfig(spec, dtype=dtype, device=device, seed=seed)
        return config if config.device is not None else dataclasses.replace(config, device=device)

    # ------------------------------------------------------------------ weights
    def push_weights(self) -> None:
        """Copy the policy's weights into the sampler (cast to its dtype; gathered under
        ZeRO-3), verified: the sampler checks NaN/inf and the policy's checksum before it
        copies anything, and its checksum afterwards must equal the policy's; ``SyncError``
        (sampler unchanged when refused) if not. No-op when the optimizer has not stepped since
        the last push. ``polynya.sync.push.WeightPush`` does the work in a fixed number of
        launches; when a cast or a ZeRO-3 gather is needed it keeps a staging buffer of one
        copy of the weights in the sampler's dtype between pushes."""
        if self._pushed_step == self.state.global_step:
            return
        start = time.perf_counter()
        policy = self.accelerator.unwrap_model(self.model)
        gather = self._dist.gather_params if self._dist.is_zero3 else None
        self._push(self.sampler, policy.named_parameters(), gather=gather)
        self._pushed_step = self.state.global_step
        self._metrics["train"]["polynya/sync_s"].append(time.perf_counter() - start)

    # ------------------------------------------------------------------ generation
    def _sampling_params(self, n: int) -> SamplingParams:
        """TRL's generation settings as transformers would sample with them (``translate.
        sampling_params``, resolved at construction), ``n`` samples per prompt."""
        return dataclasses.replace(self._sampling, n=n)

    def _tokenize_prompts(self, prompts: list):
        """TRL's tokenization, then ``ValueError`` (nothing generated) for a prompt that leaves the
        sampler less room than ``_check_room`` asks. Only the first turn's prompts are checked:
        later turns of a tool-calling rollout keep at most what is left of
        ``max_completion_length`` (TRL cuts the rest), which then always fits."""
        prompt_ids, images, multimodal_fields = super()._tokenize_prompts(prompts)
        self._check_room(max(map(len, prompt_ids), default=0))
        return prompt_ids, images, multimodal_fields

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                              has_tool_images=False):
        """Completions of TRL's prompts, and ``None`` for their log-probs, as TRL's own non-vLLM
        generation returns (given, TRL would treat them as vLLM's sampling log-probs)."""
        if images is not None or multimodal_fields or has_tool_images:
            raise ValueError("polynya's TRL adapter generates from text prompts only")
        self.push_weights()
        prompts, counts = unique_prompts(prompt_ids)
        params = [self._sampling_params(n) for n in counts]
        groups = self.sampler.generate(prompts, params)
        return [list(s.token_ids) for g in groups for s in g], None

    # ------------------------------------------------------------------ log-probs
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           batch_size=None, compute_entropy=False,
                                           compute_aux_loss=False, **multimodal):
        given = [k for k, v in multimodal.items() if v is not None]
        if given or compute_aux_loss:
            raise ValueError(f"polynya's TRL adapter computes text-only log-probs; got {given or 'aux loss'}")
        batch = rollout_batch(input_ids, attention_mask, logits_to_keep)
        policy = self.accelerator.unwrap_model(model)
        logps, ents = [], []
        for rows in group_chunks(batch, batch_size or len(batch)):
            part = batch.select(rows) if len(rows) != len(batch) else batch
            with self.accelerator.autocast():  # TRL's precision: bf16 autocast when args.bf16
                stats = compute_logprobs(policy, part, zorro=self.zorro, entropy=compute_entropy,
                                         temperature=self.temperature)
            logps.append(to_trl_layout(stats.logprobs, logits_to_keep))
            if compute_entropy:
                ents.append(to_trl_layout(stats.entropy, logits_to_keep))
        return torch.cat(logps), (torch.cat(ents) if compute_entropy else None), None

    # ------------------------------------------------------------------ batching
    @property
    def micro_batches_follow_trl(self) -> bool:
        """Whether the generation batch is split by TRL's own row shuffle instead of by whole
        prompt groups: when TRL's loss depends on which rows share a micro-batch (a per-micro-
        batch token mean: ``loss_type="bnpo"`` and the entropy bonus; a per-micro-batch entropy
        quantile: ``top_entropy_quantile < 1``) and there is more than one micro-batch."""
        per_micro_batch = (self.loss_type == "bnpo" or self._entropy_bonus_enabled
                           or self.top_entropy_quantile < 1.0)
        return per_micro_batch and self.args.steps_per_generation > 1

    def _prepare_inputs(self, generation_batch: dict[str, Any]) -> dict[str, Any]:
        if not self.model.training or self.micro_batches_follow_trl:
            return super()._prepare_inputs(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = split_pixel_values_by_grid(self._generate_and_score_completions(generation_batch))
            check_groups(batch["prompt_ids"], batch["prompt_mask"], self.num_generations)
            perm = group_permutation(batch["prompt_ids"].shape[0], self.num_generations)
            batch = permute_rows(batch, perm)
            parts = split_tensor_dict(batch, self.args.steps_per_generation)
            self._buffered_inputs = [unsplit_pixel_values_by_grid(p) for p in parts]
        return self._buffered_inputs[self._step % self.args.steps_per_generation]


@contextlib.contextmanager
def _plain_model_loading(args):
    """Under DeepSpeed ZeRO-3, transformers partitions every model it builds (``zero.Init``) while
    the run's DeepSpeed config is registered; the sampler needs whole weights, so the config is
    unregistered (transformers' own setters) while the sampler loads, then registered again."""
    hf_config = getattr(args, "hf_deepspeed_config", None)
    if hf_config is None:
        yield
        return
    from transformers.integrations.deepspeed import (
        set_hf_deepspeed_config,
        unset_hf_deepspeed_config,
    )

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        set_hf_deepspeed_config(hf_config)


def _check_args(args, kwargs: dict) -> None:
    """Refuse TRL settings whose meaning the adapter cannot keep (before TRL builds anything)."""
    if kwargs.get("peft_config") is not None:
        raise ValueError("PEFT is not supported by polynya's TRL adapter yet (the sampler would need "
                         "merged adapter weights); use trl.GRPOTrainer")
    if args is None:
        return
    problems = []
    if args.use_vllm:
        problems.append("use_vllm=True (the adapter generates on polynya's sampler; set use_vllm=False)")
    if getattr(args, "use_transformers_continuous_batching", False):
        problems.append("use_transformers_continuous_batching=True")
    overridden = args.generation_kwargs or {}  # TRL's own generation lets them win
    if args.repetition_penalty != 1.0 and "repetition_penalty" not in overridden:
        problems.append(f"repetition_penalty={args.repetition_penalty} (the native sampler has none)")
    problems += [f"generation_kwargs {p}" for p in generation_kwargs_problems(args.generation_kwargs)]
    if args.cast_lm_head_to_fp32:
        problems.append("cast_lm_head_to_fp32=True")
    if problems:
        raise ValueError("polynya's TRL adapter cannot honour: " + "; ".join(problems))
