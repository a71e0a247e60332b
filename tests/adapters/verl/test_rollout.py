"""The ``polynya`` rollout server answers verl's server calls correctly (CPU, native sampler).

Oracle: the same random model in plain torch — greedy tokens by argmax step by step, sampled
tokens' log-probs by ``log_softmax`` of full forwards. Checked: ``TokenOutput`` fields, sleep /
wake, abort (partial outputs, then a resend that completes the answer) / resume gating, weight
updates (new weights -> new tokens), vLLM's stop rules (EOS plus ``stop_token_ids``;
``ignore_eos`` per request and from ``rollout.ignore_eos``), per-replica seeds and refused
requests.
"""
from __future__ import annotations

import asyncio
import time

import pytest
import torch
from polynya.adapters.verl.rollout import PolynyaRolloutServer
from polynya.models import load_model, tiny_tokenizer
from verl.workers.config import RolloutConfig

MODEL, SEED, MAX_NEW = "tiny:qwen3", 0, 6
PROMPTS = [[5, 17, 33, 90, 101, 7], [5, 17, 33, 90, 250, 3, 44, 8, 9]]


def rollout_config(**kw) -> RolloutConfig:
    base = dict(name="polynya", mode="async", tensor_model_parallel_size=1, dtype="float32", prompt_length=32,
                response_length=MAX_NEW, engine_kwargs={"polynya": {"num_blocks": 64, "device": "cpu",
                                                                    "seed": SEED}})
    return RolloutConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def server():
    return PolynyaRolloutServer(rollout_config(), MODEL)


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL, dtype="float32", device="cpu", seed=SEED)


def greedy(model, prompt, n, eos: int | None = -1):
    """Argmax step by step, stopping at ``eos`` (-1: the model's; None: never)."""
    ids, eos = list(prompt), model.config.eos_token_id if eos == -1 else eos
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] == eos:
                break
    return ids[len(prompt):]


def run(coro):
    return asyncio.run(coro)


def test_generate_greedy_and_sampled_match_plain_torch(server, model):
    for prompt in PROMPTS:
        out = run(server.generate(prompt, {"temperature": 0.0, "top_p": 1.0, "top_k": -1}, "r0"))
        assert out.token_ids == greedy(model, prompt, MAX_NEW) and out.log_probs is None
        assert out.stop_reason == "completed" and out.extra_fields == {"global_steps": None}
    prompt = PROMPTS[1]
    out = run(server.generate(prompt, {"temperature": 1.0, "logprobs": True, "seed": 3, "max_tokens": 5}, "r1"))
    assert 1 <= len(out.token_ids) <= 5 and len(out.log_probs) == len(out.token_ids)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1]
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.log_probs), want, rtol=1e-4, atol=1e-4)


def test_concurrent_requests_each_get_their_own_answer(server, model):
    async def many():
        return await asyncio.gather(*[server.generate(p, {"temperature": 0.0}, f"c{i}")
                                      for i, p in enumerate(PROMPTS * 2)])
    outs = run(many())
    assert [o.token_ids for o in outs] == [greedy(model, p, MAX_NEW) for p in PROMPTS * 2]


def test_one_request_per_sample_decodes_in_one_batch(server, model):
    """verl's agent loop sends each sample as a request of its own: 24 at once all decode
    together (the engine's async API had 8 threads, so at most 8 rows per step)."""
    prompts = [[5 + i, 17, 33, 90 + i] for i in range(24)]

    async def many():
        return await asyncio.gather(*[server.generate(p, {"temperature": 0.0}, f"b{i}")
                                      for i, p in enumerate(prompts)])
    outs = run(many())
    assert [o.token_ids for o in outs] == [greedy(model, p, MAX_NEW) for p in prompts]
    assert server.engine.stats()["peak_decode_rows"] > 8


def test_sleep_refuses_then_wake_serves_the_same(server, model):
    run(server.sleep())
    with pytest.raises(RuntimeError, match="asleep"):
        run(server.generate(PROMPTS[0], {"temperature": 0.0}, "s0"))
    run(server.wake_up(tags=["weights", "kv_cache"]))
    run(server.clear_kv_cache())
    out = run(server.generate(PROMPTS[0], {"temperature": 0.0}, "s1"))
    assert out.token_ids == greedy(model, PROMPTS[0], MAX_NEW)


def test_abort_holds_new_requests_until_resume(server, model):
    async def scenario():
        assert await server.abort_all_requests() == {"aborted_count": 0, "request_ids": []}
        task = asyncio.create_task(server.generate(PROMPTS[0], {"temperature": 0.0}, "a0"))
        await asyncio.sleep(0.2)
        held = not task.done()
        await server.resume_generation()
        out = await task
        await server.abort_all_requests(reject_request=True)
        rejected = await server.generate(PROMPTS[0], {"temperature": 0.0}, "a1")
        await server.resume_generation()
        return held, out, rejected
    held, out, rejected = run(scenario())
    assert held and out.token_ids == greedy(model, PROMPTS[0], MAX_NEW)
    assert rejected.stop_reason == "aborted" and rejected.token_ids == []


def test_abort_all_requests_returns_partial_outputs_and_resend_completes(model):
    """As verl's vLLM server: ``abort_all_requests`` stops the running requests, each answering
    with its partial tokens and log-probs and ``stop_reason="aborted"``; new requests wait for
    ``resume_generation``; resending prompt + partial tokens (verl's agent loop) completes the
    uninterrupted greedy answer."""
    total = 200
    server = PolynyaRolloutServer(rollout_config(response_length=total), MODEL)
    runner = server.engine.backend.runner
    run_step = runner.run

    def slow_step(*args, **kwargs):  # >= 2 s for the 200 steps: the abort always lands mid-way,
        time.sleep(0.01)             # however late a loaded machine schedules it
        return run_step(*args, **kwargs)

    runner.run = slow_step
    params = {"temperature": 0.0, "logprobs": True, "ignore_eos": True, "max_tokens": total}

    async def scenario():
        running = [asyncio.create_task(server.generate(p, params, f"x{i}")) for i, p in enumerate(PROMPTS)]

        async def until(key: str, value: int) -> int:
            while (got := server.engine.stats()[key]) < value:
                assert not any(t.done() for t in running)
                await asyncio.sleep(0.002)
            return got

        await until("prefill_tokens", sum(map(len, PROMPTS)))  # both prompts are in
        await until("decode_steps", await until("decode_steps", 0) + 3)  # each has >= 4 tokens
        answer = await server.abort_all_requests()
        assert all(t.done() for t in running), "abort_all_requests returned before its requests"
        held = asyncio.create_task(server.generate(PROMPTS[0], {"temperature": 0.0, "max_tokens": 3}, "h"))
        await asyncio.sleep(0.2)
        assert not held.done()
        stats = server.engine.stats()
        await server.resume_generation()
        resent = []
        for i, (p, t) in enumerate(zip(PROMPTS, running)):  # verl's resend: prompt + partial
            done = t.result().token_ids
            resent.append(server.generate(p + done, {**params, "max_tokens": total - len(done)}, f"x{i}"))
        return answer, [t.result() for t in running], await held, stats, await asyncio.gather(*resent)

    answer, outs, held, stats, resent = run(scenario())
    assert answer == {"aborted_count": 2, "request_ids": ["x0", "x1"]}
    assert stats["blocks_in_use"] == 0 and stats["aborted_requests"] == 2
    assert held.stop_reason == "completed" and held.token_ids == greedy(model, PROMPTS[0], 3)
    for prompt, out, rest in zip(PROMPTS, outs, resent):
        assert out.stop_reason == "aborted" and 4 <= len(out.token_ids) < total
        full = out.token_ids + rest.token_ids
        assert rest.stop_reason == "completed" and full == greedy(model, prompt, total, eos=None)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + full])).logits[0, len(prompt) - 1:-1]
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(full)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.log_probs + rest.log_probs), want, rtol=0, atol=1e-4)


def test_update_weights_serves_the_new_model():
    server = PolynyaRolloutServer(rollout_config(), MODEL)
    new = load_model(MODEL, dtype="float32", device="cpu", seed=SEED + 1)
    before = run(server.generate(PROMPTS[1], {"temperature": 0.0}, "w0")).token_ids
    run(server.update_weights([(n, p.detach()) for n, p in new.named_parameters()], global_steps=3))
    out = run(server.generate(PROMPTS[1], {"temperature": 0.0}, "w1"))
    assert out.token_ids == greedy(new, PROMPTS[1], MAX_NEW) != before
    assert out.extra_fields["global_steps"] == 3


@pytest.mark.parametrize("params, kwargs, message", [
    ({"repetition_penalty": 1.3}, {}, "repetition_penalty"),
    ({"frequency_penalty": 0.5}, {}, "frequency_penalty"),
    ({"ignore_eos": "yes"}, {}, "ignore_eos"),
    ({}, {"image_data": ["img"]}, "token ids only"),
])
def test_unsupported_requests_are_refused(server, params, kwargs, message):
    with pytest.raises(ValueError, match=message):
        run(server.generate(PROMPTS[0], params, "bad", **kwargs))


def test_prompt_without_room_is_refused(server):
    with pytest.raises(ValueError, match="no room"):
        run(server.generate(list(range(2, 2 + 38)), {}, "long"))
    with pytest.raises(ValueError, match="tensor_model_parallel_size=1"):
        PolynyaRolloutServer(rollout_config(tensor_model_parallel_size=2), MODEL)


EOS_NEW = 10  # response_length of the EOS tests: the greedy answer meets EOS early, then goes on


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory, model):
    """The tiny model saved as a directory (every replica serves the same weights, whatever its
    seed) with its EOS id moved to an early greedy token of ``PROMPTS[0]``. Returns the path, the
    EOS-free greedy answer of ``EOS_NEW`` tokens, the EOS position in it, a later position
    holding a token not seen before it, and an id the answer never holds (a tool parser's)."""
    free = greedy(model, PROMPTS[0], EOS_NEW, eos=None)
    first = [i for i in range(EOS_NEW) if free[i] not in free[:i]]  # first occurrences
    pos, later = next(i for i in first if i >= 2), first[-1]
    assert free[1] != free[0] and later > pos, free
    eos = free[pos]
    saved = load_model(MODEL, dtype="float32", device="cpu", seed=SEED)
    saved.config.eos_token_id = saved.generation_config.eos_token_id = eos
    path = tmp_path_factory.mktemp("eos_model")
    saved.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    tool_stop = next(t for t in range(2, 512) if t not in free)
    return str(path), free, pos, later, tool_stop


def test_stop_token_ids_stop_besides_eos_as_vllm(eos_model):
    """vLLM's rule (verl's tool agent loop adds its parser's stop ids to every turn): a request's
    ``stop_token_ids`` stop generation *as well as* the model's EOS, never instead of it."""
    path, free, pos, later, tool_stop = eos_model
    server = PolynyaRolloutServer(rollout_config(response_length=EOS_NEW), path)
    g = {"temperature": 0.0}

    def tokens(params, rid):
        out = run(server.generate(PROMPTS[0], {**g, **params}, rid))
        assert out.stop_reason == "completed"
        return out.token_ids

    assert tokens({}, "e0") == free[:pos + 1]  # EOS, the last token returned
    assert tokens({"stop_token_ids": [tool_stop]}, "e1") == free[:pos + 1]  # still stops at EOS
    assert tokens({"stop_token_ids": []}, "e2") == free[:pos + 1]
    assert tokens({"stop_token_ids": [free[1]]}, "e3") == free[:2]  # a stop id before EOS
    # ignore_eos drops EOS only: past it to max_tokens, or to the request's stop id
    assert tokens({"ignore_eos": True, "stop_token_ids": [tool_stop]}, "e4") == free
    assert tokens({"ignore_eos": True, "stop_token_ids": [free[later]]}, "e5") == free[:later + 1]
    # min_tokens as vLLM: EOS held back until the answer has that many tokens
    held = tokens({"min_tokens": pos + 1}, "e6")
    assert held[:pos] == free[:pos] and free[pos] not in held[:pos + 1]
    with pytest.raises(ValueError, match="min_tokens"):
        tokens({"min_tokens": -1}, "e7")


def test_rollout_ignore_eos_applies_to_every_request(eos_model):
    """``actor_rollout_ref.rollout.ignore_eos=true`` is every request's default, as verl's vLLM
    server applies it (``setdefault``): EOS passed, stop ids kept, a request's own value wins."""
    path, free, pos, later, tool_stop = eos_model
    server = PolynyaRolloutServer(rollout_config(response_length=EOS_NEW, ignore_eos=True), path)
    g = {"temperature": 0.0}
    out = run(server.generate(PROMPTS[0], g, "i0"))
    assert out.token_ids == free and free[pos] in out.token_ids[:-1] and out.stop_reason == "completed"
    assert run(server.generate(PROMPTS[0], {**g, "stop_token_ids": [free[later]]}, "i1")).token_ids == \
        free[:later + 1]
    assert run(server.generate(PROMPTS[0], {**g, "ignore_eos": False}, "i2")).token_ids == free[:pos + 1]


@pytest.mark.parametrize("polynya_seed, seeds", [(None, [7, 8, 7]), (3, [3, 4, 3])])
def test_replicas_sample_from_their_own_seeds(eos_model, polynya_seed, seeds):
    """Replica r samples from ``base + r`` (base: ``engine_kwargs.polynya.seed``, else
    ``rollout.seed``; verl's vLLM server uses ``replica_rank + rollout.seed``): two replicas given
    the same prompts draw different samples, a replica of the same rank the same ones."""
    path, free, pos, _, _ = eos_model
    extra = {"num_blocks": 64, "device": "cpu"} | ({} if polynya_seed is None else {"seed": polynya_seed})
    config = rollout_config(response_length=EOS_NEW, seed=7, engine_kwargs={"polynya": extra})
    servers = [PolynyaRolloutServer(config, path, replica_rank=r) for r in (0, 1, 0)]
    assert [s.engine.config.seed for s in servers] == seeds
    params = {"temperature": 1.0, "ignore_eos": True}
    outs = [[run(s.generate(PROMPTS[0], params, f"s{i}")).token_ids for i in range(2)] for s in servers]
    assert all(len(o) == EOS_NEW for per in outs for o in per)
    assert outs[0] != outs[1] and outs[0][0] != outs[1][0] and outs[0][1] != outs[1][1]
    assert outs[2] == outs[0]
    # the same weights: only the sampling differs
    assert run(servers[1].generate(PROMPTS[0], {"temperature": 0.0}, "g")).token_ids == free[:pos + 1]
