"""Long-context QA task: loaders for the bundled and public formats, boxed-answer scoring."""
import json
import random
import re
import string
import sys
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from polynya.recipes.tasks import Example, longqa

RIVER = Example("q", "the Eful River", {"answers": ["the Eful River", "Eful River"]})


def test_bundled_sample_is_long_multi_passage_and_answerable():
    train, test = longqa.load("train"), longqa.load("test")
    assert (len(train), len(test)) == (40, 10)
    for e in train + test:
        assert e.meta["num_passages"] == 20 and e.prompt.count("\nPassage ") == 19
        assert len(e.prompt) > 8000                       # ~2-3k tokens of context
        assert e.answer in e.prompt.split("\n\nQuestion:")[0]
        assert longqa.reward(f"so \\boxed{{{e.answer}}}", e) == 1.0
    assert len({e.meta["question"] for e in train + test}) == 50   # no repeats, no leakage


@pytest.mark.parametrize("completion,expected", [
    ("The river is \\boxed{the Eful River}.", 1.0),
    ("\\boxed{Eful river!}", 1.0),                 # case, punctuation
    ("\\boxed{  The   EFUL river }", 1.0),         # articles, whitespace
    ("\\boxed{\\text{Eful River}}", 1.0),
    ("\\boxed{Gorbel River} no wait \\boxed{Eful River}", 1.0),  # last box wins
    ("\\boxed{Eful River} no wait \\boxed{Gorbel River}", 0.0),
    ("\\boxed{Eful}", 0.0),
    ("the Eful River", 0.0),                       # no box
    ("\\boxed{Eful River", 0.0),                   # unclosed
])
def test_exact_match(completion, expected):
    assert longqa.reward(completion, RIVER) == expected


def test_f1_mode_and_helpers():
    assert longqa.reward("\\boxed{Eful}", RIVER, mode="f1") == pytest.approx(2 / 3)
    assert longqa.reward("\\boxed{Eful River}", RIVER, mode="f1") == 1.0
    assert longqa.reward("\\boxed{Nile}", RIVER, mode="f1") == 0.0
    assert longqa.reward("no box", RIVER, mode="f1") == 0.0
    assert longqa.extract_boxed("a \\boxed{x^{2}} b") == "x^{2}"
    assert longqa.normalize_answer("The  Eiffel-Tower, a tower!") == "eiffeltower tower"
    with pytest.raises(ValueError, match="unknown longqa reward mode"):
        longqa.reward("\\boxed{x}", RIVER, mode="rouge")


@pytest.mark.parametrize("prediction,truth,same", [
    ("Paris", "paris", True),
    ("  The   Paris\n", "Paris", True),          # article and whitespace
    ("An Apple a day", "apple day", True),       # every article, anywhere
    ("Theatre", "atre", False),                  # "the" only as a word
    ("Saint-Denis", "SaintDenis", True),         # SQuAD drops punctuation without a space
    ("1939\u20131945", "1939-1945", True),        # en dash: Unicode punctuation (not in SQuAD)
    ("\u201cOslo\u201d", "Oslo", True),            # curly quotes
    ("don\u2019t", "don't", True),
    ("Z\u00fcrich", "Zurich", False),              # letters are kept as they are
    ("1,990", "1990", True),
    ("3.5", "35", True),                         # as in SQuAD: "." is punctuation
    ("Oslo Norway", "Oslo", False),
    # review 2026-12: the same text in two Unicode forms (composed "\u00fc", or "u" + combining
    # diaeresis as in NFD sources) is the same answer; other letters stay as they are
    ("Zu\u0308rich", "Z\u00fcrich", True),
    ("Z\u00fcrich", "Zu\u0308rich", True),
    ("Zu\u0308rich", "Zurich", False),
])
def test_normalisation(prediction, truth, same):
    ex = Example("q", truth, {"answers": [truth]})
    assert longqa.reward(f"\\boxed{{{prediction}}}", ex) == float(same)
    if same:
        assert longqa.reward(f"\\boxed{{{prediction}}}", ex, mode="f1") == 1.0


@pytest.mark.parametrize("box,expected", [
    ("\\text{Eful River}", 1.0),
    ("\\textbf{Eful River}", 1.0),
    ("\\mathrm{Eful\\ River}", 1.0),
    ("\\mathrm{Eful}~\\mathrm{River}", 1.0),      # "~" is LaTeX's unbreakable space
    ("\\text{\\emph{Eful} River}", 1.0),          # nested
    ("\\operatorname{Eful} River", 1.0),
    ("\\text{1\\,990}", None),                   # "\\," between digits groups thousands
    ("\\mathbf{Gorbel River}", 0.0),
    ("\\frac{Eful}{River}", 0.0),                 # not a text macro: left as it is
])
def test_latex_text_macros_in_the_box_are_unwrapped(box, expected):
    if expected is None:
        year = Example("q", "1990", {"answers": ["1990"]})
        assert longqa.reward(f"So \\boxed{{{box}}}.", year) == 1.0
        return
    assert longqa.reward(f"So \\boxed{{{box}}}.", RIVER) == expected


def _squad_normalize(s: str) -> str:
    """SQuAD v1.1's ``normalize_answer``, verbatim."""
    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    return white_space_fix(remove_articles(remove_punc(s.lower())))


def test_normalisation_equals_squads_on_random_ascii():
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + string.punctuation + " \t\n"
    words = ["a", "an", "the", "The", "AN", "then", "anna", "oslo"]
    for _ in range(2000):
        s = "".join(rng.choice(words) + rng.choice(" .,-") if rng.random() < 0.3
                    else rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        assert longqa.normalize_answer(s) == _squad_normalize(s), (seed, s)


@pytest.mark.parametrize("box", ["\\boxed{}", "\\boxed{The}", "\\boxed{...}", "\\boxed{ an }",
                                 "\\boxed{\u2014}"])
def test_an_empty_box_never_matches(box):
    for answers in (["Oslo"], ["", "Oslo"], ["the", "Oslo"], ["...", "Oslo"]):
        ex = Example("q", answers[0], {"answers": answers})
        assert longqa.reward(f"So {box}", ex) == 0.0, answers
        assert longqa.reward(f"So {box}", ex, mode="f1") == 0.0, answers
    assert longqa.reward("\\boxed{Oslo}", Example("q", "", {"answers": ["", "Oslo"]})) == 1.0


def test_an_example_with_no_scorable_answer_is_refused():
    with pytest.raises(ValueError, match="no accepted answer has text left"):
        longqa.reward("\\boxed{}", Example("q", "the", {"answers": ["the", ""]}))


def test_loader_drops_answers_that_normalise_to_nothing(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"question": "q", "answers": ["", "The", "Oslo"],
                                "passages": [{"title": "t", "text": "x"}]}) + "\n")
    [ex] = longqa.load("train", source=str(path))
    assert ex.answer == "Oslo" and ex.meta["answers"] == ["Oslo"]
    assert longqa.reward("\\boxed{}", ex) == 0.0
    path.write_text(json.dumps({"question": "q", "answer": "the", "answer_aliases": ["?"],
                                "paragraphs": [{"title": "t", "paragraph_text": "x"}]}) + "\n")
    with pytest.raises(ValueError, match="record 0: no answer has any text left"):
        longqa.load("train", source=str(path))


def test_truncated_box_scores_zero_and_an_earlier_closed_box_counts():
    assert longqa.reward("\\boxed{Eful River} hmm, or \\boxed{Gorbel Ri", RIVER) == 1.0
    assert longqa.reward("\\boxed{Eful Ri", RIVER) == 0.0


HOTPOT = {"_id": "h1", "question": "Where was Ann born?", "answer": "Oslo",
          "context": [["Ann", ["Ann is a pilot.", "She was born in Oslo."]],
                      ["Bob", ["Bob sings."]]]}
MUSIQUE = {"id": "m1", "question": "Where was Ann born?", "answer": "Oslo",
           "answer_aliases": ["Christiania"],
           "paragraphs": [{"idx": 0, "title": "Ann", "paragraph_text": "Ann was born in Oslo.",
                           "is_supporting": True},
                          {"idx": 1, "title": "Bob", "paragraph_text": "Bob sings.",
                           "is_supporting": False}]}
LONGBENCH = {"_id": "l1", "input": "Where was Ann born?", "answers": ["Oslo"],
             "context": "Passage 1:\nAnn was born in Oslo.\n\nPassage 2:\nBob sings.", "length": 12}


def test_hotpot_musique_longbench_shapes(tmp_path):
    (tmp_path / "hotpot.json").write_text(json.dumps([HOTPOT]))
    (tmp_path / "musique.jsonl").write_text(json.dumps(MUSIQUE) + "\n")
    (tmp_path / "longbench.jsonl").write_text(json.dumps(LONGBENCH) + "\n")
    for name in ("hotpot.json", "musique.jsonl", "longbench.jsonl"):
        [ex] = longqa.load("validation", source=str(tmp_path / name))
        assert ex.answer == "Oslo" and "born in Oslo" in ex.prompt and "Bob sings" in ex.prompt
        assert ex.meta["num_passages"] == 2 and "\\boxed" in ex.prompt
        assert longqa.reward("\\boxed{oslo}", ex) == 1.0
    [ex] = longqa.load("validation", source=str(tmp_path / "musique.jsonl"))
    assert longqa.reward("\\boxed{Christiania}", ex) == 1.0
    assert "Passage 1 (Ann): Ann is a pilot. She was born in Oslo." in \
        longqa.load("x", source=str(tmp_path / "hotpot.json"))[0].prompt


def test_hf_dict_context_from_parquet_directory(tmp_path):
    record = dict(HOTPOT, context={"title": ["Ann", "Bob"],
                                   "sentences": [["Ann was born in Oslo."], ["Bob sings."]]})
    pq.write_table(pa.Table.from_pylist([record]), tmp_path / "validation.parquet")
    [ex] = longqa.load("validation", source=str(tmp_path))
    assert "Passage 1 (Ann): Ann was born in Oslo." in ex.prompt


def test_hf_id_with_config(monkeypatch):
    calls = []

    def load_dataset(*args, split):
        calls.append((args, split))
        return [HOTPOT]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    [ex] = longqa.load("validation", source="hotpotqa/hotpot_qa:distractor")
    assert ex.answer == "Oslo" and calls == [(("hotpotqa/hotpot_qa", "distractor"), "validation")]
    longqa.load("test", source="THUDM/LongBench")
    assert calls[-1] == (("THUDM/LongBench",), "test")


PASSAGES = [{"title": "t", "text": "x"}]


@pytest.mark.parametrize("record,message", [
    ({"answer": "x", "passages": PASSAGES}, "record 0: missing field 'question'"),
    ({"question": "q", "answer": "x"}, "record 0: missing field 'passages'"),
    ({"question": "q", "answer": "x", "passages": [{"title": "t"}]},
     "field 'passages': every item needs a text 'text'"),
    ({"question": "q", "passages": PASSAGES}, "record 0: missing field 'answer'"),
    ({"question": "q", "answers": [], "passages": PASSAGES}, "field 'answers' is empty"),
    ({"question": "q", "answer": "x", "context": [["t"]]}, "field 'context': items must be"),
    ({"question": "q", "answer": "x", "passages": []}, "record 0: no passages"),
    (["not", "a", "dict"], "record 0: expected an object"),
])
def test_malformed_records(tmp_path, record, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=message):
        longqa.load("train", source=str(path))


def test_bad_split_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="unknown split 'validation'"):
        longqa.load("validation")
    with pytest.raises(ValueError, match="not found"):
        longqa.load("train", source=str(tmp_path / "gone.json"))
