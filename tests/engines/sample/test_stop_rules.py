"""Stop rules end to end: ``SamplingParams.stop_at_eos`` on the native engine, and the
vLLM-style routes (``/v1/completions``, ``/inference/v1/generate``), where stop ids add to the
model's EOS unless ``ignore_eos`` (tiny random qwen3, fp32, CPU, greedy)."""
from __future__ import annotations

import pytest
from polynya import SamplingParams
from polynya.client.ecosystem import generate_params
from polynya.client.openai_compat import _COMPLETION_KEYS, sampling_params

from .test_native_engine import make_engine, ragged_prompts


@pytest.fixture(scope="module")
def run():
    """``run(params)`` -> the greedy completion of one prompt, with the engine's EOS set to
    the 4th token the free run emits (so EOS is hit at a known place)."""
    engine = make_engine()
    prompt = ragged_prompts(11, [6])[0]
    free = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=()))[0][0]
    eos, other = free.token_ids[3], free.token_ids[7]
    assert eos not in free.token_ids[:3] and other not in free.token_ids[:7]
    engine.backend.default_stop_ids = frozenset({eos})

    def run(params: SamplingParams):
        out = engine.generate([prompt], params)[0][0]
        return out.token_ids, out.finish_reason
    run.free, run.eos, run.other = free.token_ids, eos, other
    return run


def test_engine_stop_rules(run):
    greedy = dict(temperature=0, max_tokens=12)
    at_eos, at_other = (run.free[:4], "stop"), (run.free[:8], "stop")
    assert run(SamplingParams(**greedy)) == at_eos
    assert run(SamplingParams(**greedy, stop_token_ids=[run.other])) == at_other  # replaces EOS
    assert run(SamplingParams(**greedy, stop_token_ids=[run.other], stop_at_eos=True)) == at_eos
    assert run(SamplingParams(**greedy, stop_at_eos=False)) == (run.free, "length")
    assert run(SamplingParams(**greedy, stop_token_ids=[run.other], stop_at_eos=False)) == at_other


@pytest.mark.parametrize("translate", [
    generate_params,
    lambda body: sampling_params(body, _COMPLETION_KEYS),
], ids=["inference_generate", "openai_completions"])
def test_vllm_requests_add_stop_ids_to_eos(run, translate):
    """A vLLM request's ``stop_token_ids`` add to EOS (verl's tool loop sends its parser's ids
    with every turn: a turn that ends in EOS must still end there)."""
    base = {"temperature": 0, "max_tokens": 12}
    assert run(translate({**base, "stop_token_ids": [run.other]})) == (run.free[:4], "stop")
    assert run(translate({**base, "stop_token_ids": [run.other], "ignore_eos": True})) == (run.free[:8], "stop")
    assert run(translate({**base, "ignore_eos": True})) == (run.free, "length")
    assert run(translate(base)) == (run.free[:4], "stop")


def test_generate_route_takes_skyrls_dict_and_vllms_top_k_off():
    """SkyRL's generator dict (min_tokens=1, include_stop_str_in_output, skip_special_tokens,
    logprobs=1, stop=None) is accepted as before; top_k=0 is vLLM's "off"; max_tokens defaults
    to vLLM's 16."""
    skyrl = {"min_tokens": 1, "skip_special_tokens": True, "include_stop_str_in_output": True,
             "max_tokens": 9, "temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0,
             "logprobs": 1, "stop": None}
    p = generate_params(skyrl)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.logprobs, p.stops_at_eos) == (9, 0.7, 0.9, -1, True, True)
    assert generate_params({}).max_tokens == 16 and not generate_params({}).logprobs


def test_openai_answers_report_vllms_stop_reason():
    """``stop_reason`` as vLLM's ``check_stop`` sets it: the stop id that ended a choice; None at
    the tokenizer's EOS (unless ``ignore_eos``), at the length limit, or for an abort. The
    model's other EOS ids are stop ids there (vLLM adds them to ``stop_token_ids``)."""
    from types import SimpleNamespace

    from polynya.client.openai_compat import chat_response, completion_response, stop_reason
    from polynya.types import Sample

    tok = SimpleNamespace(eos_token_id=2, decode=lambda ids, skip_special_tokens=True: "")
    p = SamplingParams(stop_token_ids=[7], stop_at_eos=True)  # a vLLM request: [7] + EOS

    def ended(*ids, why="stop"):
        return Sample(list(ids), None, why)

    assert stop_reason(ended(5, 7), p, tok) == 7
    assert stop_reason(ended(5, 2), p, tok) is None  # the tokenizer's EOS
    assert stop_reason(ended(5, 9), p, tok) == 9  # another EOS id of the model's
    assert stop_reason(ended(5, 7, why="length"), p, tok) is None
    assert stop_reason(ended(why="abort"), p, tok) is None
    ignore = SamplingParams(stop_token_ids=[2], stop_at_eos=False)  # ignore_eos, EOS as a stop id
    assert stop_reason(ended(5, 2), ignore, tok) == 2
    assert stop_reason(ended(5, 7), p, None) == 7 and stop_reason(ended(5, 9), p, None) is None
    body = {"prompt": [1]}
    out = completion_response(body, [[1], [1]], [[ended(5, 7)], [ended(5, 2)]], tok, "m", False, p)
    assert [c["stop_reason"] for c in out["choices"]] == [7, None]
    chat = chat_response(body, [1], [ended(5, 7), ended(6, why="length")], tok, "m", False, p)
    assert [c["stop_reason"] for c in chat["choices"]] == [7, None]
