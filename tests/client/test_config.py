"""RLClientConfig validation and prompt routing (no engines)."""

import contextlib

import pytest

import polynya
from polynya import SamplingParams
from polynya.cluster import ReplicaRouter, merge_routed
from polynya.cluster.placement import plan_layout


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(comm_protocol="grpc"), "comm_protocol"),
        (dict(dtype="float16"), "dtype"),
        (dict(training_gpus=0), "training_gpus"),
        (dict(log_prob_gpus=-1), "log_prob_gpus"),
        (dict(sampler="sglang"), "sampler"),
        (dict(colocate=True, training_gpus=2, sampling_gpus=1), "sampling_gpus"),
        (dict(colocate="yes"), "colocate"),
        (dict(offload_trainer=1), "offload_trainer"),
        (dict(server_url="localhost:80"), "server_url"),
        (dict(train=dict(zero_stage=5)), "zero_stage"),
        (dict(train=3), "train"),
        (dict(bucket_bytes=0), "bucket_bytes"),
        (dict(sync_peer_timeout_s=0), "sync_peer_timeout_s"),
    ],
)
def test_config_rejects(kw, match):
    with pytest.raises(ValueError, match=match):
        polynya.RLClientConfig("tiny:qwen3", **kw)


def test_config_propagates_shared_fields():
    cfg = polynya.RLClientConfig(
        "tiny:llama",
        dtype="float32",
        zorro_train=False,
        zorro_inference=False,
        train=dict(lr=0.1, seed=3),
        device="cpu",
    )
    assert (cfg.train.model, cfg.train.dtype, cfg.train.zorro, cfg.train.lr) == (
        "tiny:llama",
        "float32",
        False,
        0.1,
    )
    assert (cfg.sampling.model, cfg.sampling.fca, cfg.sampling.seed, cfg.sampling.device) == (
        "tiny:llama",
        False,
        3,
        "cpu",
    )
    assert cfg.logprob.seed == 3 and not cfg.logprob.zorro
    assert not hasattr(polynya.config, "RLClientConfig")  # the config layer is below the client


def test_routing_keeps_groups_and_balances():
    prompts = [[1, 2, 3], [4, 5], [1, 2, 3], [6] * 9, [7, 8]]
    with ReplicaRouter(2).route(prompts, SamplingParams(n=4, max_tokens=4)) as routes:
        pass
    assert sorted(i for r in routes for i in r) == list(range(5))
    where = {i: k for k, r in enumerate(routes) for i in r}
    assert where[0] == where[2]  # identical prompts share a replica (prefix cache)
    assert all(routes)  # both replicas get work
    merged = merge_routed(routes, [[f"out{i}" for i in r] for r in routes], 5)
    assert merged == [f"out{i}" for i in range(5)]


def test_router_spreads_calls_in_flight_and_keeps_groups():
    router, p = ReplicaRouter(2), SamplingParams(n=1, max_tokens=4)
    with contextlib.ExitStack() as held:
        a = held.enter_context(router.route([[1, 2, 3]], p))
        b = held.enter_context(router.route([[4, 5, 6]], p))  # replica 0 is busy with a
        c = held.enter_context(router.route([[1, 2, 3]], p))  # a's prompt: a's replica
        d = held.enter_context(router.route([[9, 9], [1, 2, 3]], p))  # split: group pinned
        assert a == [[0], []] and b == [[], [0]] and c == [[0], []]
        assert d == [[1], [0]] and router.load() == [21, 13]
    assert router.load() == [0, 0]
    with router.route([[1, 2, 3]], p) as e:  # nothing in flight: the first replica again
        assert e == [[0], []]
    with pytest.raises(ValueError, match="prompts\\[1\\]"), router.route([[1], "x"], p):
        pass  # bad input: nothing held
    with pytest.raises(RuntimeError, match="boom"), \
            router.route([[7] * 5], SamplingParams(n=2, max_tokens=3)):
        assert router.load() == [11, 0]
        raise RuntimeError("boom")  # a failed call gives its share back
    assert router.load() == [0, 0] and not router._running
    with pytest.raises(ValueError, match="SamplingParams"), router.route([[1]], {"n": 1}):
        pass
    assert router.load() == [0, 0]
    with pytest.raises(ValueError, match="num_replicas"):
        ReplicaRouter(0)


def test_layouts():
    co = plan_layout(2, 2, 2, True, "GPU")
    assert (
        co.trainer == co.sampler == co.logprob == [0, 1]
        and len(co.bundles) == 2
        and co.share < 1 / 3
    )
    split = plan_layout(1, 2, 1, False, "dev")
    assert (split.trainer, split.sampler, split.logprob, split.share) == ([0], [1, 2], [3], 1.0)


def test_the_api_token_stays_out_of_reprs():
    from polynya import RLClientConfig

    cfg = RLClientConfig("tiny:qwen3", comm_protocol="http", server_url="http://10.0.0.5:8000",
                         api_token="SECRET-TOKEN-123")
    assert cfg.api_token == "SECRET-TOKEN-123" and "SECRET-TOKEN-123" not in repr(cfg)
