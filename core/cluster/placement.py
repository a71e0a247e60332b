"""Placement groups for the two layouts (Ray is imported lazily).

- colocated: one bundle per GPU (``training_gpus`` bundles of one device each); training rank
  ``g``, sampler replica ``g`` and log-prob rank ``g`` share bundle ``g`` with fractional
  shares of its device and take turns (offload/onload, sleep/wake);
- split: one bundle per engine rank: trainers, then sampler replicas, then log-prob ranks.

On a CPU-only cluster a custom resource (``RLClientConfig.device_resource``) stands for a device.
"""

from __future__ import annotations

from dataclasses import dataclass

CONTROL_THREADS = 4  # a sampler actor's threads for everything but generate (receiver, stats, sleep)
GENERATE_GROUP = "generate"  # the sampler actor's concurrency group of generate calls


@dataclass
class Layout:
    """Bundle index and device share of every actor."""

    bundles: list[dict[str, float]]
    trainer: list[int]
    sampler: list[int]
    logprob: list[int]
    share: float  # fraction of a bundle's device each actor asks for


def plan_layout(
    training: int, sampling: int, log_prob: int, colocate: bool, resource: str
) -> Layout:
    if colocate:
        parts = 2 + (1 if log_prob else 0)
        idx = list(range(training))
        return Layout(
            [{resource: 1.0} for _ in idx],
            idx,
            list(idx),
            idx if log_prob else [],
            share=round(1.0 / parts - 1e-4, 4),
        )
    n = training + sampling + log_prob
    t = list(range(training))
    s = list(range(training, training + sampling))
    lp = list(range(training + sampling, n))
    return Layout([{resource: 1.0} for _ in range(n)], t, s, lp, share=1.0)


def create_placement_group(layout: Layout, timeout_s: float):
    """Reserve the bundles (``PACK``); ``TimeoutError`` when the cluster cannot hold them."""
    import ray
    from ray.util.placement_group import placement_group

    pg = placement_group(layout.bundles, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(pg)
        raise TimeoutError(
            f"the Ray cluster cannot place {layout.bundles} within {timeout_s:.0f} s "
            "(too few GPUs / device resources?)"
        ) from None
    return pg


def actor_options(pg, bundle: int, share: float, resource: str, **extra) -> dict:
    """``.options(...)`` for an actor on ``bundle`` holding ``share`` of its device."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=bundle
    )
    opts = dict(num_cpus=0, scheduling_strategy=strategy, **extra)
    if resource == "GPU":
        opts["num_gpus"] = share
    else:
        opts["resources"] = {resource: share}
    return opts


def start_actors(cfg, layout: Layout, pg) -> tuple[list, list, list]:
    """Trainer ranks, sampler replicas and log-prob ranks of ``cfg`` (an ``RLClientConfig``) on
    ``layout``'s bundles. Each rank group rendezvous at an address found on its first bundle."""
    import ray

    from . import workers

    kind = "cpu" if cfg.device == "cpu" or cfg.device_resource != "GPU" else "cuda"
    threads = cfg.cpu_threads or 1

    def opts(bundle: int, **kw) -> dict:
        return actor_options(pg, bundle, layout.share, cfg.device_resource, **kw)

    def rendezvous(bundle: int) -> tuple[str, int]:
        task = ray.remote(workers.node_address).options(**opts(bundle))
        return ray.get(task.remote(), timeout=cfg.timeout_s)

    addr, port = rendezvous(layout.trainer[0])
    ref_cfg = cfg.logprob if cfg.reference_model and not cfg.log_prob_gpus else None
    trainer = ray.remote(workers.TrainerWorker)
    trainers = [trainer.options(**opts(b)).remote(cfg.train, ref_cfg, r, cfg.training_gpus,
                                                  addr, port, kind, threads)
                for r, b in enumerate(layout.trainer)]
    # a generate call holds an actor thread until it returns: its own concurrency group, one
    # thread per call the engine batches (SamplerConfig.call_slots); the weight receiver, stats,
    # sleep and wake calls keep the default group's threads however many generates wait
    # (concurrency groups are set on the actor class: Ray's .options() does not take them)
    sampler = ray.remote(concurrency_groups={GENERATE_GROUP: cfg.sampling.call_slots})(
        workers.SamplerWorker)
    samplers = [sampler.options(**opts(b, max_concurrency=CONTROL_THREADS)).remote(
                    cfg.sampling, kind, threads)
                for b in layout.sampler]
    logprobs = []
    if cfg.log_prob_gpus:
        addr, port = rendezvous(layout.logprob[0])
        logprob = ray.remote(workers.LogProbWorker)
        logprobs = [logprob.options(**opts(b)).remote(cfg.logprob, cfg.reference_model, r,
                                                      cfg.log_prob_gpus, addr, port, kind, threads)
                    for r, b in enumerate(layout.logprob)]
    return trainers, samplers, logprobs
