"""The RL round trip every client test runs, and small configs for tiny CPU engines."""

from __future__ import annotations

import torch

import polynya
from polynya import RolloutBatch, SamplingParams

MODEL = "tiny:qwen3"
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [5, 6, 7, 8, 9, 10, 11]]
FIXED_PROMPTS = [[17, 3, 99, 250, 7, 64], [300, 301, 5]]


def tiny_config(protocol: str, **kw) -> polynya.RLClientConfig:
    base = dict(
        dtype="float32",
        comm_protocol=protocol,
        bucket_bytes=1 << 16,
        timeout_s=120,
        train=dict(lr=2e-2, zero_stage=2, micro_batch_tokens=4096),
        sampling=dict(num_blocks=64, block_size=8, max_num_seqs=32),
    )
    base.update(kw)
    return polynya.RLClientConfig(MODEL, **base)


def rollout_batch(out, prompts) -> RolloutBatch:
    p = [pr for pr, g in zip(prompts, out) for _ in g]
    r = [s.token_ids for g in out for s in g]
    g = torch.Generator().manual_seed(0)
    return RolloutBatch(
        p,
        r,
        group_ids=[i for i, gr in enumerate(out) for _ in gr],
        advantages=torch.randn(len(r), generator=g),
    )


def greedy_vs_trainer(client) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler's log-probs of its greedy continuations of ``FIXED_PROMPTS`` (model
    distribution, temperature 1) and the trainer's log-probs of the same tokens, flattened.
    Two prompts: a data-parallel trainer needs at least one prompt group per rank."""
    out = client.generate(
        FIXED_PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, logprobs=True)
    )
    samples = [g[0] for g in out]
    stats = client.compute_logprobs(
        RolloutBatch(FIXED_PROMPTS, [s.token_ids for s in samples]), temperature=1.0
    )
    sampler = torch.cat([torch.tensor(s.logprobs) for s in samples])
    trainer = torch.cat([stats.logprobs[i, : len(s.token_ids)] for i, s in enumerate(samples)])
    return sampler, trainer


def rl_round_trip(client, *, replicas: int = 1) -> dict:
    """generate → compute_logprobs → forward_backward → step → sync_weights, with checks."""
    params = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=7, logprobs=True)
    out = client.generate(PROMPTS, params)
    assert [len(g) for g in out] == [3, 3, 3]
    batch = rollout_batch(out, PROMPTS)
    old = client.compute_logprobs(batch)
    # sampling log-probs (T=1, no filters) are the policy's: sampler and trainer agree before training
    for row, s in enumerate(x for g in out for x in g):
        torch.testing.assert_close(
            old.logprobs[row, : len(s.token_ids)], torch.tensor(s.logprobs), atol=2e-4, rtol=1e-4
        )
    batch.old_logprobs = old.logprobs
    metrics = client.forward_backward(batch)
    assert metrics["sequences"] == 9 and torch.isfinite(torch.tensor(metrics["loss"]))
    client.step()
    before = client.weight_checksums()
    assert all(c != before["trainer"] for c in before["samplers"]), "the step changed nothing"
    info = client.sync_weights()
    assert info["version"] == before["version"] + 1 and info["checksum"] == before["trainer"]
    after = client.weight_checksums()
    assert after["samplers"] == [after["trainer"]] * replicas
    assert after["versions"] == [info["version"]] * replicas
    lp_sampler, lp_trainer = greedy_vs_trainer(client)
    torch.testing.assert_close(lp_sampler, lp_trainer, atol=2e-4, rtol=1e-4)
    return info
