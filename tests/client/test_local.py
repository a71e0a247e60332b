"""The in-process client: RL round trip (colocated and split placement), async API, reference
log-probs, sleep/wake, save/load."""

import asyncio
import threading

import pytest
import torch

import polynya
from polynya import RolloutBatch, SamplingParams

from .common import PROMPTS, greedy_vs_trainer, rl_round_trip, tiny_config


@pytest.mark.parametrize("colocate", [True, False], ids=["colocated", "split"])
def test_local_round_trip(colocate):
    cfg = tiny_config("local", colocate=colocate, reference_model=True)
    with polynya.create_rl_client(cfg) as client:
        ref0 = client.compute_logprobs(RolloutBatch([PROMPTS[0]], [[3, 4, 5]]), model="reference")
        rl_round_trip(client)
        # the reference stays frozen; the policy moved
        ref1 = client.compute_logprobs(RolloutBatch([PROMPTS[0]], [[3, 4, 5]]), model="reference")
        pol = client.compute_logprobs(RolloutBatch([PROMPTS[0]], [[3, 4, 5]]))
        assert torch.equal(ref0.logprobs, ref1.logprobs)
        assert not torch.allclose(pol.logprobs, ref1.logprobs)
        info = (
            client.sync_weights()
        )  # a second sync of unchanged weights: new version, same checksum
        assert info["version"] == 2
    with pytest.raises(RuntimeError, match="shut down"):
        client.step()


def test_local_log_prob_engine_async_and_state(tmp_path):
    cfg = tiny_config("local", colocate=False, log_prob_gpus=1)
    client = polynya.create_rl_client(cfg)

    async def run():
        async with client:
            params = SamplingParams(n=2, max_tokens=5, seed=1)
            # concurrent generate calls share the sampler; the loop is never blocked
            ticks = 0

            async def ticker():
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0)

            t = asyncio.create_task(ticker())
            outs = await asyncio.gather(*(client.generate_async([p], params) for p in PROMPTS))
            t.cancel()
            assert ticks > 1 and [len(o[0]) for o in outs] == [2, 2, 2]
            batch = RolloutBatch(
                [p for p in PROMPTS for _ in range(2)],
                [s.token_ids for o in outs for s in o[0]],
                advantages=torch.randn(6),
            )
            await client.forward_backward_async(batch)
            await client.step_async()
            await client.sync_weights_async()
            sums = await client.weight_checksums_async()
            assert sums["logprob"] == [sums["trainer"]] == sums["samplers"]
            lp_engine = await client.compute_logprobs_async(batch)  # the synced log-prob engine
            lp_trainer = client.trainer.compute_logprobs(batch).logprobs
            torch.testing.assert_close(lp_engine.logprobs, lp_trainer, atol=1e-5, rtol=1e-5)
            await client.save_async(str(tmp_path / "ckpt"))
            saved = sums["trainer"]
            await client.forward_backward_async(batch)
            await client.step_async()
            assert (await client.weight_checksums_async())["trainer"] != saved
            await client.load_async(str(tmp_path / "ckpt"))
            assert (await client.weight_checksums_async())["trainer"] == saved
            await client.sleep_async("sampler")
            assert client.samplers[0].backend.asleep
            await client.generate_async([PROMPTS[0]], params)  # generate wakes it
            assert not client.samplers[0].backend.asleep
            await client.sleep_async("logprob")
            await client.wake_async("logprob")
            with pytest.raises(ValueError, match="engine"):
                await client.sleep_async("gpu")

    asyncio.run(run())


def test_colocated_handover_order():
    cfg = tiny_config("local", colocate=True, offload_trainer=True)  # "auto": its own test
    with polynya.create_rl_client(cfg) as client:
        client.generate([PROMPTS[0]], SamplingParams(max_tokens=2))
        assert client.trainer._offloaded and not client.samplers[0].backend.asleep
        lp_s, lp_t = greedy_vs_trainer(client)  # compute_logprobs puts the sampler to sleep
        assert client.samplers[0].backend.asleep and not client.trainer._offloaded
        torch.testing.assert_close(lp_s, lp_t, atol=2e-4, rtol=1e-4)
        with pytest.raises(ValueError, match="reference"):
            client.compute_logprobs(RolloutBatch([[1, 2]], [[3]]), model="reference")


def test_failed_sync_never_reuses_its_version(monkeypatch):
    """A sync that one replica rejects leaves the other on the new version; the next sync takes a
    fresh number, so neither replica sees it as stale."""
    import polynya.client.local as local_mod
    from polynya.sync import SyncError, apply_update

    cfg = tiny_config("local", colocate=False, sampling_gpus=2)
    with polynya.create_rl_client(cfg) as client:
        calls = []

        def flaky(engine, staged):
            calls.append(engine)
            if len(calls) == 2:
                raise SyncError("injected: replica 1 rejects")
            return apply_update(engine, staged)

        monkeypatch.setattr(local_mod, "apply_update", flaky)
        with pytest.raises(SyncError, match="injected"):
            client.sync_weights()
        assert [s.stats()["weight_version"] for s in client.samplers] == [1, 0]
        assert client.version == 0
        monkeypatch.setattr(local_mod, "apply_update", apply_update)
        assert client.sync_weights()["version"] == 2
        sums = client.weight_checksums()
        assert sums["versions"] == [2, 2] and sums["samplers"] == [sums["trainer"]] * 2


@pytest.mark.parametrize("replicas", [1, 2])
def test_concurrent_async_calls_batch_in_the_engines(monkeypatch, replicas):
    """40 one-prompt ``generate_async`` calls (an HTTP server's or an agent loop's requests) are
    all inside the samplers at once — a thread each, more than the default executor's 32 — and
    spread over the replicas; each answer equals the same call made alone."""
    calls = 40
    cfg = tiny_config("local", colocate=False, sampling_gpus=replicas,
                      sampling=dict(num_blocks=160, block_size=8, max_num_seqs=48))
    prompts = [[3 + i, 50 + i, 7, 9 + 2 * i] for i in range(calls)]
    params = [SamplingParams(max_tokens=12, seed=i, stop_token_ids=(), logprobs=True)
              for i in range(calls)]
    with polynya.create_rl_client(cfg) as client:
        alone = [client.generate([p], q)[0] for p, q in zip(prompts, params)]
        before = [s.stats() for s in client.samplers]
        barrier = threading.Barrier(calls, timeout=60)  # broken (and the test failed) unless
        for s in client.samplers:                       # every call is inside at once
            real = s.generate

            def held(*a, _real=real, **kw):
                barrier.wait()
                return _real(*a, **kw)

            monkeypatch.setattr(s, "generate", held)

        async def run():
            return await asyncio.gather(*(client.generate_async([p], q)
                                          for p, q in zip(prompts, params)))

        together = [out[0] for out in asyncio.run(run())]
        after = [s.stats() for s in client.samplers]
    assert [[x.token_ids for x in o] for o in together] == [[x.token_ids for x in o] for o in alone]
    for o, a in zip(together, alone):
        torch.testing.assert_close(torch.tensor(o[0].logprobs), torch.tensor(a[0].logprobs),
                                   atol=1e-5, rtol=0)
    served = [a["requests"] - b["requests"] for a, b in zip(after, before)]
    assert served == [calls // replicas] * replicas, served  # routed while all are in flight
    peaks = [a["peak_decode_rows"] for a in after]
    assert all(peak >= n // 2 for peak, n in zip(peaks, served)), (peaks, served)


def test_a_bad_prompt_fails_the_call_before_any_replica_runs():
    cfg = tiny_config("local", colocate=False, sampling_gpus=2)
    with polynya.create_rl_client(cfg) as client:
        client.generate([PROMPTS[0]], SamplingParams(max_tokens=2))  # engines up
        before = [s.stats() for s in client.samplers]
        bad = [PROMPTS[1], [7] * 40, [1, 100000]]  # the last one is out of the vocabulary
        with pytest.raises(ValueError, match=r"prompts\[2\]"):  # the caller's index
            client.generate(bad, SamplingParams(max_tokens=30))
        after = [s.stats() for s in client.samplers]
        assert [a["requests"] for a in after] == [b["requests"] for b in before]
        assert client._router.load() == [0, 0] and client._generating == 0


def test_a_failed_share_stops_the_rest_of_the_call(monkeypatch):
    """One replica fails its share of a named call: the other replica's share is aborted, the
    call raises that failure once both are done, and the router holds nothing after."""
    import time

    cfg = tiny_config("local", colocate=False, sampling_gpus=2)
    with polynya.create_rl_client(cfg) as client:
        def broken(*a, **kw):
            time.sleep(0.2)
            raise RuntimeError("replica 1 failed")

        monkeypatch.setattr(client.samplers[1], "generate", broken)
        before = client.samplers[0].stats()
        with pytest.raises(RuntimeError, match="replica 1 failed"):
            asyncio.run(client.generate_async([[5] * 6, [9] * 8],
                                              SamplingParams(max_tokens=400, stop_token_ids=())))
        after = client.samplers[0].stats()
        assert after["aborted_requests"] == before["aborted_requests"] + 1
        assert after["decode_tokens"] - before["decode_tokens"] < 399 and after["blocks_in_use"] == 0
        assert client._router.load() == [0, 0] and client._generating == 0


def test_auto_offload_keeps_a_cpu_trainer_and_asks_for_the_samplers_room(monkeypatch):
    """``offload_trainer="auto"`` (the default): the hand-over asks the trainer to make room
    for the samplers' wake; on the CPU it never moves (its states already live in host
    memory). A trainer that reports it had to offload is onloaded before training."""
    cfg = tiny_config("local")
    assert cfg.offload_trainer == "auto"
    with polynya.create_rl_client(cfg) as client:
        assert client.handover.sampler_room == {0: 0, 1: 0, 2: 0}  # CPU samplers need no device room
        asked = []
        real = client.trainer.make_room
        monkeypatch.setattr(client.trainer, "make_room", lambda n: asked.append(n) or real(n))
        client.generate([PROMPTS[0]], SamplingParams(n=2, max_tokens=3, seed=0))
        assert asked == [0] and client.handover.trainer_resident and not client.trainer._offloaded
        assert client.handover.offloads == 0
        rl_round_trip(client)

        def short_of_room(n):  # what a GPU trainer does when the samplers' room is not free
            client.trainer.offload()
            return True

        monkeypatch.setattr(client.trainer, "make_room", short_of_room)
        client.generate([PROMPTS[0]], SamplingParams(n=2, max_tokens=3, seed=0))
        assert client.trainer._offloaded and not client.handover.trainer_resident
        assert client.handover.offloads == 1
        rl_round_trip(client)  # onloaded for training, sync and log-probs
        assert not client.trainer._offloaded


@pytest.mark.parametrize("offload", [True, False], ids=["offload", "resident"])
def test_offload_trainer_decides_the_colocated_hand_over(offload):
    """``offload_trainer=False`` keeps the trainer on the device while the samplers generate
    (no offload / onload in the hand-over); the RL round trip works either way."""
    cfg = tiny_config("local", offload_trainer=offload)
    with polynya.create_rl_client(cfg) as client:
        client.generate([PROMPTS[0]], SamplingParams(n=2, max_tokens=3, seed=0))
        assert client.handover.trainer_resident is (not offload)
        assert client.trainer._offloaded is offload
        rl_round_trip(client)
        client.generate([PROMPTS[0]], SamplingParams(n=2, max_tokens=3, seed=0))
        assert client.trainer._offloaded is offload
