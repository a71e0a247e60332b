"""torchrun worker for ``test_trl_deepspeed.py``: 2 GRPO steps of the TRL adapter under DeepSpeed
ZeRO-``argv[3]`` (accelerate, gloo on CPU); each rank writes what it saw to ``argv[1].rank<r>``."""
import json
import os
import sys

import torch
import trl
from datasets import Dataset
from polynya.adapters.trl import GRPOTrainer
from polynya.config import SamplerConfig
from polynya.checksum import checksum_named_tensors
from polynya.models import tiny_tokenizer

from tests.adapters.test_trl_trainer import QUESTIONS, SYSTEM, reward_digits

if __name__ == "__main__":
    out, model_dir, stage = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ds_config = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto",
                 "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": False}}
    args = trl.GRPOConfig(output_dir=os.path.join(os.path.dirname(out), "run"), per_device_train_batch_size=4,
                          gradient_accumulation_steps=1, num_generations=4, max_completion_length=6, max_steps=2,
                          learning_rate=5e-3, logging_steps=1, report_to=[], use_cpu=True, bf16=False,
                          save_strategy="no", seed=0, beta=0.0, deepspeed=ds_config, disable_tqdm=True)
    data = Dataset.from_list([{"prompt": [SYSTEM, {"role": "user", "content": q}]} for q in QUESTIONS])
    trainer = GRPOTrainer(model_dir, reward_funcs=reward_digits, args=args, train_dataset=data,
                          processing_class=tiny_tokenizer(),
                          sampler_config=SamplerConfig(model_dir, dtype="float32", kv_cache_memory_gb=0.05))
    inner, diffs, prompts = trainer._get_per_token_logps_and_entropies, [], []

    def spy(model, ids, mask, keep, **kw):
        got = inner(model, ids, mask, keep, **kw)
        with torch.no_grad():
            ref = trl.GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, ids, mask, keep,
                                                                    compute_entropy=True)
        m = mask[:, -keep:].bool()
        diffs.append(float((got[0].detach()[m] - ref[0][m]).abs().max()))
        prompts.append(len({tuple(r[k.bool()].tolist()) for r, k in zip(ids[:, :-keep], mask[:, :-keep])}))
        return got

    trainer._get_per_token_logps_and_entropies = spy
    trainer.train()
    policy = trainer.accelerator.unwrap_model(trainer.model)
    with trainer._dist.gather_params(list(policy.parameters())):
        same = checksum_named_tensors(policy.named_parameters()) == trainer.sampler.weight_checksum()
    result = {"engine": type(trainer.model_wrapped).__name__, "steps": trainer.state.global_step,
              "diffs": diffs, "prompts_per_micro_batch": prompts, "checksum_equal": same,
              "sampler_requests": trainer.sampler.stats()["requests"]}
    with open(f"{out}.rank{os.environ['RANK']}", "w") as f:
        json.dump(result, f)
