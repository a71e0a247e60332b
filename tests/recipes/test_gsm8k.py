"""GSM8K task: loaders (bundled, local files, mocked HF id), answer extraction and scoring."""
import json
import random
import sys
import types
from decimal import Decimal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from polynya.recipes.tasks import Example, get_task, gsm8k

EX = Example("q", "72")


def test_get_task_returns_module():
    assert get_task("gsm8k") is gsm8k and gsm8k.NAME == "gsm8k"
    with pytest.raises(ValueError, match="unknown task 'gsm9k'"):
        get_task("gsm9k")


def test_bundled_sample_loads_and_its_solutions_score_full():
    train, test = gsm8k.load("train"), gsm8k.load("test")
    assert (len(train), len(test)) == (200, 50)
    assert len({e.prompt for e in train + test}) == 250
    for e in train + test:
        assert e.prompt.endswith(gsm8k.INSTRUCTION) and e.answer.lstrip("-").isdigit()
        for convention in gsm8k.CONVENTIONS:
            assert gsm8k.reward(e.meta["solution"], e, convention=convention) == 1.0
            assert gsm8k.reward(e.meta["solution"] + "1", e, convention=convention) == 0.0
            assert gsm8k.reward(e.meta["solution"] + "1", e, convention=convention, format_score=0.1) == 0.1


LONG_TAIL = " and that is how I checked it." * 11  # > 300 characters after the answer
# (completion, ground truth, verl score, value score); format_score 0 (verl's default)
CASES = [
    ("3 + 4 = 7 so 72 in all.\n#### 72", "72", 1, 1),
    ("#### 72", "72", 1, 1),
    ("#### 3.50", "3.5", 0, 1),
    ("#### 072", "72", 0, 1),
    ("#### .5", "0.5", 0, 1),
    ("#### 72.", "72", 0, 1),
    ("#### $18", "18", 0, 1),
    ("#### -$5", "-5", 0, 1),
    ("####18", "18", 0, 1),
    ("#### 18" + LONG_TAIL, "18", 0, 1),
    ("#### 1,234", "1234", 1, 1),
    ("#### -5", "-5", 1, 1),
    ("#### 5", "-5", 0, 0),
    ("#### 71", "72", 0, 0),
    ("#### 71\nwait, recount\n#### 72", "72", 1, 1),  # the last #### wins
    ("#### 72\nno: #### 71", "72", 0, 0),
    ("The answer is 72.", "72", 0, 0),  # strict needs ####
    ("####", "72", 0, 0),
    ("#### seventy-two", "72", 0, 0),
    ("", "72", 0, 0),
    # commas: verl deletes every comma of a strict match; "value" takes commas only as
    # thousands separators, so a run that is no number is no answer (never 45, 12345, 100050)
    ("#### 4,5", "45", 1, 0),
    ("#### 1,2345", "12345", 1, 0),
    ("#### 1000,50", "100050", 1, 0),
    ("#### 1,000,00", "100000", 1, 0),
    ("#### 1,000,000", "1000000", 1, 1),
    ("#### 12,345.5", "12345.5", 1, 1),
    ("#### 1,000.", "1000", 0, 1),
    ("#### 72, done", "72", 1, 1),
    ("#### 7.0", "7", 0, 1),
    ("#### -0.5", "-0.5", 1, 1),
    ("#### -.5", "-0.5", 0, 1),
    ("#### 72 apples", "72", 1, 1),
    ("#### 1.2.3", "72", 0, 0),
    ("#### 1e3", "1000", 0, 0),
    ("#### 1/2", "0.5", 0, 0),                  # fractions are not evaluated
    ("#### 72\nno: #### 1,2", "72", 0, 0),     # the last #### decides, even when malformed
    ("#### 72\nso #### 7,2", "72", 1, 0),
    # review 2026-12: a number glued to a fraction slash, an exponent, a power or a "_" group
    # is no answer under "value" (it was read as its first part: "1/2" scored for 1)
    ("#### 1/2", "1", 1, 0),
    ("#### 1 / 2", "1", 1, 0),
    ("#### 3⁄4", "3", 1, 0),
    ("#### 1e3", "1", 1, 0),
    ("#### 2^3", "2", 1, 0),
    ("#### 10²", "10", 1, 0),
    ("#### 1_000", "1", 1, 0),
    ("#### 72/month", "72", 1, 1),              # a unit after the slash: still 72
    ("#### 72 / week", "72", 1, 1),
    # signs: U+2212 (the typographic minus) and "+" are read as signs under "value"
    ("#### \u22125", "-5", 0, 1),
    ("#### \u22125", "5", 0, 0),
    ("#### +5", "5", 0, 1),
    ("#### \u2212$5", "-5", 0, 1),
]


@pytest.mark.parametrize("completion,truth,verl,value", CASES)
def test_strict_scores_in_both_conventions(completion, truth, verl, value):
    ex = Example("q", truth)
    assert gsm8k.reward(completion, ex) == verl  # verl is the default
    assert gsm8k.reward(completion, ex, convention="verl") == verl
    assert gsm8k.reward(completion, ex, convention="value") == value


@pytest.mark.parametrize("completion,verl,value", [
    ("The answer is 72.", 0, 1),   # verl: "72." is the last number string
    ("It costs $72", 1, 1),
    ("5 - 3 = 2, then 72", 1, 1),
    ("72 apples, minus 3", 0, 0),  # last number is 3
    ("no numbers here", 0, 0),
    ("so 72" + LONG_TAIL, 0, 1),
    ("72, done.", 0, 1),                 # verl compares "72," as a string
    ("paid 1,000 then 72.", 0, 1),
    ("72 or 1.2.3", 0, 0),               # the last number decides; "1.2.3" is none
    ("72 then 7,2", 0, 0),               # verl keeps "7,2" as is; "value": no number
    ("wait...72", 0, 0),                 # glued to the periods before it: not a number
])
def test_flexible_scores(completion, verl, value):
    assert gsm8k.reward(completion, EX, method="flexible") == verl
    assert gsm8k.reward(completion, EX, method="flexible", convention="value") == value


@pytest.mark.parametrize("completion,truth,verl,value", [
    ("so each gets 1/2", "2", 1, 0),        # the denominator is no answer
    ("so each gets 1 / 2", "2", 1, 0),
    ("about 1e3", "3", 1, 0),               # nor an exponent
    ("about 1e-3", "-3", 1, 0),
    ("that is 10^2", "2", 1, 0),            # nor a power
    ("it drops to \u22125", "5", 1, 0),      # verl reads 5: its regex knows "-" only
    ("it drops to \u22125", "-5", 0, 1),
    ("a gain of +5", "5", 1, 1),
    ("10 / 2 = 5", "5", 1, 1),              # a number after "=" is still read
    ("paid $30/hour for 2 hours", "2", 1, 1),
])
def test_flexible_reads_no_part_of_a_fraction_exponent_or_power(completion, truth, verl, value):
    ex = Example("q", truth)
    assert gsm8k.reward(completion, ex, method="flexible") == verl
    assert gsm8k.reward(completion, ex, method="flexible", convention="value") == value


def test_verl_flexible_quirk_only_periods_earn_format_score():
    # verl's flexible loop keeps "." when no real number is left: wrong answer, not "none found"
    assert gsm8k.reward("no number at all. really.", EX, method="flexible", format_score=0.1) == 0.1
    assert gsm8k.reward("no number at all", EX, method="flexible", format_score=0.1) == 0.0
    assert gsm8k.reward("no number at all. really.", EX, method="flexible", format_score=0.1,
                        convention="value") == 0.0


def test_value_malformed_last_answer_is_no_answer_not_an_earlier_one():
    for completion in ("#### 72\n#### 7,2", "72 then 4,5"):
        method = "strict" if "####" in completion else "flexible"
        assert gsm8k.extract_answer(completion, method, "value") is None
        assert gsm8k.reward(completion, EX, convention="value", method=method,
                            format_score=0.1) == 0.0  # nothing extracted: not even format_score


def _spell(value: Decimal, rng: random.Random) -> str:
    """``value`` written as a person might: thousands commas or not, trailing zeros, ``$``."""
    sign, text = ("-" if value < 0 else ""), f"{abs(value):f}"
    whole, _, frac = text.partition(".")
    if rng.random() < 0.5 and len(whole) > 3:
        whole = f"{int(whole):,}"
    if frac or rng.random() < 0.3:
        frac = (frac or "") + "0" * rng.randint(0, 2)
    number = whole + ("." + frac if frac else "")
    dollar = "$" if rng.random() < 0.3 else ""
    return f"{sign}{dollar}{number}" + rng.choice(["", ".", ",", " apples"])


def test_value_convention_reads_random_numbers_by_value():
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    for _ in range(500):
        value = Decimal(rng.randint(-10**7, 10**7)) / rng.choice([1, 1, 10, 100])
        truth = gsm8k.ground_truth(f"#### {value:f}")
        assert Decimal(truth) == value, (seed, value)
        spelled = _spell(value, rng)
        ex = Example("q", truth)
        assert gsm8k.reward(f"steps 3 + 4 = 7\n#### {spelled}", ex, convention="value") == 1.0, \
            (seed, spelled)
        assert gsm8k.reward(f"so it is {spelled}", ex, convention="value", method="flexible") \
            == 1.0, (seed, spelled)
        other = Example("q", str(value + 1))
        assert gsm8k.reward(f"#### {spelled}", other, convention="value") == 0.0, (seed, spelled)


@pytest.mark.parametrize("run", ["4,5", "1,2345", "12,34,567", "1000,50", "1.2.3", "1,000,00",
                                 "1,,000", "1.,5"])
def test_value_convention_refuses_runs_that_are_no_number(run):
    for text in (f"#### {run}", f"#### -{run}", f"#### ${run}."):
        assert gsm8k.extract_answer(text, "strict", "value") is None, text
        assert gsm8k.extract_answer(f"the answer: {run}", "flexible", "value") is None, text


def test_commas_and_dollars_stripped_on_both_sides():
    ex = Example("q", gsm8k.ground_truth("#### 1,234"))
    assert ex.answer == "1234"
    assert gsm8k.reward("#### 1,234", ex) == 1.0
    assert gsm8k.reward("#### $1,234", ex, convention="value") == 1.0
    assert gsm8k.reward("#### 1234", Example("q", "1,234"), convention="value") == 1.0


def test_score_options_and_bad_method():
    assert gsm8k.reward("#### 71", EX, format_score=0.3) == 0.3
    assert gsm8k.reward("#### 72", EX, score=2.0) == 2.0
    with pytest.raises(ValueError, match="unknown extraction method"):
        gsm8k.reward("#### 72", EX, method="lenient")
    with pytest.raises(ValueError, match="unknown gsm8k reward convention"):
        gsm8k.reward("#### 72", EX, convention="trl")


RECORDS = [{"question": "Tom has 3 cats and 2 dogs. How many pets?", "answer": "3 + 2 = 5\n#### 5"},
           {"question": "What is 1,000 + 200?", "answer": "#### 1,200"},
           {"question": "Bare final number?", "answer": "42"}]


def _check(examples):
    assert [e.answer for e in examples] == ["5", "1200", "42"]
    assert examples[0].prompt.startswith("Tom has 3 cats") and "####" in examples[0].prompt


def test_local_jsonl_json_parquet(tmp_path):
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    (tmp_path / "b.json").write_text(json.dumps(RECORDS))
    pq.write_table(pa.Table.from_pylist(RECORDS), tmp_path / "c.parquet")
    for name in ("a.jsonl", "b.json", "c.parquet"):
        _check(gsm8k.load("train", source=str(tmp_path / name)))


def test_local_directory_by_split(tmp_path):
    (tmp_path / "main").mkdir()
    pq.write_table(pa.Table.from_pylist(RECORDS), tmp_path / "main" / "test-00000-of-00001.parquet")
    _check(gsm8k.load("test", source=str(tmp_path)))
    with pytest.raises(ValueError, match="no file for split 'train'"):
        gsm8k.load("train", source=str(tmp_path))


def test_hf_id_goes_through_datasets_with_main_config(monkeypatch):
    calls = []

    def load_dataset(*args, split):
        calls.append((args, split))
        return RECORDS

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    _check(gsm8k.load("test", source="openai/gsm8k"))
    assert calls == [(("openai/gsm8k", "main"), "test")]


def test_bad_inputs_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        gsm8k.load("dev")
    with pytest.raises(ValueError, match="not found"):
        gsm8k.load("train", source=str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps({"question": "no answer"}) + "\n")
    with pytest.raises(ValueError, match="gsm8k record 1: missing field 'answer'"):
        gsm8k.load("train", source=str(bad))
    bad.write_text(json.dumps({"question": 7, "answer": "#### 1"}) + "\n")
    with pytest.raises(ValueError, match="record 0: field 'question' must be str"):
        gsm8k.load("train", source=str(bad))
    bad.write_text(json.dumps({"question": "q", "answer": "no final number"}) + "\n")
    with pytest.raises(ValueError, match="record 0: field 'answer' has no '#### <number>'"):
        gsm8k.load("train", source=str(bad))
    bad.write_text(json.dumps({"question": "q", "answer": "so\n#### 1,2"}) + "\n")
    with pytest.raises(ValueError, match="record 0: field 'answer' has no '#### <number>'"):
        gsm8k.load("train", source=str(bad))   # a malformed number is refused, not read as 12
    bad.write_text(json.dumps(RECORDS[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        gsm8k.load("train", source=str(bad))
    (tmp_path / "x.csv").write_text("question,answer\n")
    with pytest.raises(ValueError, match="unsupported file type"):
        gsm8k.load("train", source=str(tmp_path / "x.csv"))
