"""Helpers shared by the engine tests and the torchrun worker: batches, engines, state snapshots."""
from __future__ import annotations

import pytest
import torch
from polynya import RolloutBatch
from polynya.config.train import LossConfig, OptimConfig, TrainConfig
from polynya.engines import _deepspeed as dsu

CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MODEL = "tiny:qwen3"
VOCAB = 512


def make_batch(seed: int, *, groups: int = 4, per_group: int = 3, adv_per_token: bool = False,
               old: bool = False) -> RolloutBatch:
    """Ragged groups sharing prompts; every prompt starts with the same chat-template-like head,
    every other one also with a system prefix; random advantages."""
    g = torch.Generator().manual_seed(seed)
    template = torch.randint(2, VOCAB, (3,), generator=g).tolist()
    system = torch.randint(2, VOCAB, (5,), generator=g).tolist()
    prompts, responses = [], []
    for k in range(groups):
        q = torch.randint(2, VOCAB, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        prompt = template + (system + q if k % 2 == 0 else q)
        for _ in range(per_group):
            n = int(torch.randint(2, 10, (1,), generator=g))
            prompts.append(prompt)
            responses.append(torch.randint(2, VOCAB, (n,), generator=g).tolist())
    b, r = len(prompts), max(len(x) for x in responses)
    adv = torch.randn((b, r) if adv_per_token else (b,), generator=g)
    old_lp = -torch.rand(b, r, generator=g) * 3 - 4 if old else None
    return RolloutBatch(prompts, responses, advantages=adv, old_logprobs=old_lp)


def train_config(stage: int, **kw) -> TrainConfig:
    base = dict(dtype="float32", zero_stage=stage, lr=5e-3, loss="grpo", seed=0,
                optim=OptimConfig(grad_clip=0.0, eps=1e-3), loss_config=LossConfig(), micro_batch_tokens=48)
    base.update(kw)
    return TrainConfig(MODEL, **base)


def full_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, gathered one at a time under ZeRO-3, copied to CPU."""
    out = {}
    for name, p in module.named_parameters():
        with dsu.gathered([p]):
            out[name] = p.data.detach().clone().cpu()
    return out


def optimizer_state(engine) -> list[torch.Tensor]:
    """The tensors of the (ZeRO-wrapped) optimizer state, copied: exp_avg, exp_avg_sq, fp32
    master partitions where the wrapper has them."""
    opt = engine.engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    out = [st[k].detach().clone() for st in inner.state.values() for k in ("step", "exp_avg", "exp_avg_sq")
           if torch.is_tensor(st.get(k))]
    for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition"):
        out += [t.detach().clone() for t in getattr(opt, attr, []) or [] if torch.is_tensor(t)]
    return out


def assert_same_tensors(a, b) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        a, b = list(a.values()), list(b.values())
    assert len(a) == len(b) and len(a) > 0
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def reassemble(pieces, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Named tensors (CPU) from ``export_weights`` pieces."""
    out = {}
    for names, flat in pieces:
        off = 0
        for n in names:
            k = shapes[n].numel()
            out[n] = flat[off:off + k].view(shapes[n]).cpu().clone()
            off += k
        assert off == flat.numel()
    return out


def dp_scenario(stage: int, ckpt_dir: str) -> dict:
    """The data-parallel check, run identically on 1 rank (in pytest) and 2 ranks (torchrun):
    3 DAPO steps on one off-policy batch, ZoRRo on vs off, export, save/load, log-prob engine."""
    import polynya
    from polynya.config.logprob import LogProbConfig
    from polynya.engines.logprob import LogProbEngine
    from polynya.engines.train import TrainingEngine
    from polynya.models import load_model

    cfg = train_config(stage, loss="dapo", lr=3e-3, micro_batch_tokens=40)  # 1e-2 oscillates on this batch
    engine = TrainingEngine(cfg)
    plain = make_batch(30, groups=5)
    lp = engine.compute_logprobs(plain).logprobs.cpu()
    noise = 0.05 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(2))
    batch = RolloutBatch(plain.prompts, plain.responses, advantages=plain.advantages,
                         old_logprobs=(lp + noise) * plain.response_mask())
    off = TrainingEngine(train_config(stage, loss="dapo", lr=3e-3, micro_batch_tokens=40, zorro=False))
    zorro_off = (off.forward_backward(batch)["loss"], off.step()["grad_norm"])
    steps = []
    for i in range(3):
        m = engine.forward_backward(batch)
        steps.append((m["loss"], engine.step()["grad_norm"]))
        if i == 0:
            engine.save(ckpt_dir)
    resumed = TrainingEngine(cfg)
    resumed.load(ckpt_dir)
    resumed_steps = [(resumed.forward_backward(batch)["loss"], resumed.step()["grad_norm"]) for _ in range(2)]
    truth = full_weights(engine.module)
    exported = reassemble(engine.export_weights(20_000), {n: t.shape for n, t in truth.items()})
    ref = LogProbEngine(LogProbConfig(MODEL, dtype="float32", zero_stage=3 if stage == 3 else 0,
                                      micro_batch_tokens=40))
    got = ref.compute_logprobs(plain, entropy=True)
    with torch.no_grad():
        want = polynya.compute_logprobs(load_model(MODEL, dtype="float32"), plain, entropy=True)
    ref.load_weights(engine.export_weights(30_000))  # trainer -> log-prob engine, both sharded
    synced = ref.weight_checksum() == engine.weight_checksum()
    return {"steps": steps, "zorro_off": zorro_off, "resumed_steps": resumed_steps, "weights": truth,
            "export_exact": list(exported) == list(truth) and all(torch.equal(exported[n], truth[n]) for n in truth),
            "checksum": engine.weight_checksum(),
            "checksum_resumed": resumed.weight_checksum(), "synced": synced,
            "logprob_err": float((got.logprobs.cpu() - want.logprobs).abs().max()),
            "entropy_err": float((got.entropy.cpu() - want.entropy).abs().max())}
