"""Task loaders on small files in the real public layouts of each dataset (GSM8K, Spider, BIRD,
HotpotQA, SQuAD v1/v2, MuSiQue-Full), including the HF hub's sharded parquet folders: every
example comes back with the expected gold answers, and a source the loader cannot read right
is refused by name instead of giving fewer or wrong examples."""
import json
import sqlite3
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from polynya.recipes.tasks import gsm8k, longqa, txt2sql

GSM8K = [{"question": f"Natalia sold clips to {n} of her friends. How many clips?",
          "answer": f"Natalia sold {n}*2 = <<{n}*2={2 * n}>>{2 * n} clips.\n#### {2 * n:,}"}
         for n in (24, 1000, 7, 31, 5000)]


def _parquet(records: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path)


def test_gsm8k_hf_snapshot_reads_every_shard_in_order(tmp_path):
    """An HF hub snapshot ``main/train-0000k-of-0000n.parquet``: all shards, rows in order."""
    _parquet(GSM8K[:2], tmp_path / "main" / "train-00000-of-00002.parquet")
    _parquet(GSM8K[2:], tmp_path / "main" / "train-00001-of-00002.parquet")
    examples = gsm8k.load("train", source=str(tmp_path))
    assert [e.answer for e in examples] == ["48", "2000", "14", "62", "10000"]
    assert [e.meta["question"] for e in examples] == [r["question"] for r in GSM8K]
    assert gsm8k.reward("so\n#### 10000", examples[-1]) == 1.0
    # a top-level data folder (the default config's layout) too
    _parquet(GSM8K[:1], tmp_path / "flat" / "test-00000-of-00003.parquet")
    _parquet(GSM8K[1:3], tmp_path / "flat" / "test-00001-of-00003.parquet")
    _parquet(GSM8K[3:], tmp_path / "flat" / "test-00002-of-00003.parquet")
    assert len(gsm8k.load("test", source=str(tmp_path / "flat"))) == 5


def test_a_missing_shard_or_two_configs_are_refused(tmp_path):
    _parquet(GSM8K[:2], tmp_path / "main" / "train-00000-of-00002.parquet")
    with pytest.raises(ValueError, match="1 shard file.* for a split of 2.*a shard is missing"):
        gsm8k.load("train", source=str(tmp_path))
    _parquet(GSM8K[2:], tmp_path / "main" / "train-00001-of-00002.parquet")
    _parquet(GSM8K[:1], tmp_path / "socratic" / "train-00000-of-00001.parquet")
    with pytest.raises(ValueError, match=r"several folders .*\(main, socratic\)"):
        gsm8k.load("train", source=str(tmp_path))
    assert len(gsm8k.load("train", source=str(tmp_path / "main"))) == 5


@pytest.mark.parametrize("name,text", [("empty.jsonl", ""), ("blank.jsonl", "\n\n"),
                                       ("empty.json", "[]"), ("data.json", '{"data": []}')])
def test_an_empty_file_is_refused_not_zero_examples(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    for task in (gsm8k, longqa):
        with pytest.raises(ValueError, match=f"{task.NAME}: no records in .*{name}"):
            task.load("train", source=str(tmp_path / name))


def test_an_empty_split_file_parquet_or_hf_split_is_refused(tmp_path, monkeypatch):
    _parquet(GSM8K, tmp_path / "train.parquet")
    pq.write_table(pq.read_table(tmp_path / "train.parquet").slice(0, 0),
                   tmp_path / "test.parquet")
    with pytest.raises(ValueError, match="gsm8k: no records in .*test.parquet"):
        gsm8k.load("test", source=str(tmp_path))
    import sys
    import types
    monkeypatch.setitem(sys.modules, "datasets",
                        types.SimpleNamespace(load_dataset=lambda *a, split: []))
    with pytest.raises(ValueError, match="no records in split 'test' of 'openai/gsm8k'"):
        gsm8k.load("test", source="openai/gsm8k")


def test_an_empty_txt2sql_split_file_is_refused(tmp_path):
    (tmp_path / "dev.json").write_text("[]")
    with pytest.raises(ValueError, match="txt2sql: no records in .*dev.json"):
        txt2sql.load("validation", source=str(tmp_path))


def test_gsm8k_numeric_answer_column_is_the_integer_a_completion_writes(tmp_path):
    _parquet([{"question": "q", "answer": 72.0}, {"question": "r", "answer": 3.5},
              {"question": "s", "answer": 1000.0}], tmp_path / "nums.parquet")
    examples = gsm8k.load("train", source=str(tmp_path / "nums.parquet"))
    assert [e.answer for e in examples] == ["72", "3.5", "1000"]
    assert gsm8k.reward("#### 72", examples[0]) == 1.0   # verl's string comparison


def _db(path: Path, ddl: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path)
    conn.executescript(ddl)
    conn.commit()
    conn.close()


def test_spider_release_layout_train_dev_and_test(tmp_path):
    """spider_data/: train_spider.json, dev.json, test.json, database/, test_database/."""
    _db(tmp_path / "database" / "pets" / "pets.sqlite",
        "CREATE TABLE pets (name TEXT, age INT); INSERT INTO pets VALUES ('Rex', 3), ('Kit', 1);")
    _db(tmp_path / "test_database" / "cars" / "cars.sqlite",
        "CREATE TABLE cars (make TEXT); INSERT INTO cars VALUES ('Saab');")
    rec = {"db_id": "pets", "query": "SELECT count(*) FROM pets", "question": "How many pets?",
           "query_toks": ["SELECT"], "question_toks": ["How"], "sql": {"select": [False, []]}}
    (tmp_path / "train_spider.json").write_text(json.dumps([rec, dict(rec, question="Count?")]))
    (tmp_path / "dev.json").write_text(json.dumps([dict(rec, query="SELECT name FROM pets "
                                                        "ORDER BY age")]))
    (tmp_path / "test.json").write_text(json.dumps([dict(rec, db_id="cars",
                                                         query="SELECT make FROM cars")]))
    train = txt2sql.load("train", source=str(tmp_path))
    assert [e.meta["question"] for e in train] == ["How many pets?", "Count?"]
    assert {e.answer for e in train} == {"SELECT count(*) FROM pets"}
    assert train[0].meta["db_path"] == str((tmp_path / "database/pets/pets.sqlite").resolve())
    [dev] = txt2sql.load("validation", source=str(tmp_path))
    assert dev.meta["ordered"] and dev.meta["db_id"] == "pets"
    [test] = txt2sql.load("test", source=str(tmp_path))
    assert test.meta["db_path"] == str((tmp_path / "test_database/cars/cars.sqlite").resolve())
    assert txt2sql.reward("```sql\nSELECT make FROM cars\n```", test) == 1.0


def test_bird_train_layout_and_evidence(tmp_path):
    _db(tmp_path / "train_databases" / "movie" / "movie.sqlite",
        "CREATE TABLE movie (title TEXT, year INT); INSERT INTO movie VALUES ('A', 1999);")
    rows = [{"db_id": "movie", "question": "Title of the 1999 film?",
             "evidence": "film refers to movie", "SQL": "SELECT title FROM movie WHERE year = 1999"},
            {"db_id": "movie", "question": "How many?", "evidence": "",
             "SQL": "SELECT COUNT(*) FROM movie"}]
    (tmp_path / "train.json").write_text(json.dumps(rows))
    a, b = txt2sql.load("train", source=str(tmp_path))
    assert (a.answer, b.answer) == (rows[0]["SQL"], rows[1]["SQL"])
    assert "Hint: film refers to movie" in a.prompt and "Hint:" not in b.prompt
    (tmp_path / "train.json").write_text(json.dumps([dict(rows[0], evidence=["a list"])]))
    with pytest.raises(ValueError, match="record 0: field 'evidence' must be str"):
        txt2sql.load("train", source=str(tmp_path))


HOTPOT_HF = {"id": "5a8b", "question": "Where was Ann born?", "answer": "Oslo", "type": "bridge",
             "level": "easy", "supporting_facts": {"title": ["Ann"], "sent_id": [0]},
             "context": {"title": ["Ann", "Bob"],
                         "sentences": [["Ann was born in Oslo.", " She flies."], ["Bob sings."]]}}


def test_hotpot_hf_distractor_shards(tmp_path):
    second = dict(HOTPOT_HF, id="5a8c", question="Who sings?", answer="Bob")
    _parquet([HOTPOT_HF], tmp_path / "distractor" / "validation-00000-of-00002.parquet")
    _parquet([second], tmp_path / "distractor" / "validation-00001-of-00002.parquet")
    a, b = longqa.load("validation", source=str(tmp_path))
    assert (a.answer, b.answer) == ("Oslo", "Bob") and a.meta["num_passages"] == 2
    assert "Passage 1 (Ann): Ann was born in Oslo. She flies." in a.prompt


def test_hotpot_hf_context_whose_titles_and_sentences_disagree_is_refused(tmp_path):
    bad = dict(HOTPOT_HF, context={"title": ["Ann", "Bob"], "sentences": [["Ann was born."]]})
    (tmp_path / "h.jsonl").write_text(json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match="'context': needs 'title' and 'sentences' lists of the "
                                         "same length"):
        longqa.load("validation", source=str(tmp_path / "h.jsonl"))


SQUAD = {"id": "56be", "title": "Super_Bowl_50", "question": "Which team won Super Bowl 50?",
         "context": "Super Bowl 50 was an American football game. The Denver Broncos won.",
         "answers": {"text": ["Denver Broncos", "Denver Broncos", "Broncos"],
                     "answer_start": [49, 49, 56]}}


def test_squad_hf_layout_keeps_every_gold_answer(tmp_path):
    _parquet([SQUAD], tmp_path / "plain_text" / "validation-00000-of-00001.parquet")
    [ex] = longqa.load("validation", source=str(tmp_path))
    assert ex.answer == "Denver Broncos" and ex.meta["answers"] == ["Denver Broncos", "Broncos"]
    assert "The Denver Broncos won." in ex.prompt and ex.meta["num_passages"] == 1
    assert longqa.reward("\\boxed{the Broncos}", ex) == 1.0


def test_answers_as_squad_style_objects_are_their_text(tmp_path):
    """SQuAD's own ``answers: [{"text", "answer_start"}]`` items: the text, never the dict."""
    rec = {"question": "Who won?", "passages": [{"title": "SB", "text": "The Broncos won."}],
           "answers": [{"text": "Denver Broncos", "answer_start": 0}, {"text": "Broncos"}]}
    (tmp_path / "a.jsonl").write_text(json.dumps(rec) + "\n")
    [ex] = longqa.load("train", source=str(tmp_path / "a.jsonl"))
    assert ex.meta["answers"] == ["Denver Broncos", "Broncos"]
    assert longqa.reward("\\boxed{Broncos}", ex) == 1.0
    (tmp_path / "a.jsonl").write_text(json.dumps(dict(rec, answers=[["Broncos"]])) + "\n")
    with pytest.raises(ValueError, match="'answers': an answer must be text"):
        longqa.load("train", source=str(tmp_path / "a.jsonl"))
    (tmp_path / "a.jsonl").write_text(json.dumps(dict(rec, answers={"value": "x"})) + "\n")
    with pytest.raises(ValueError, match="'answers' is an object without a 'text' list"):
        longqa.load("train", source=str(tmp_path / "a.jsonl"))


@pytest.mark.parametrize("record,message", [
    (dict(SQUAD, answers={"text": [], "answer_start": []}), "'answers' is empty .*unanswerable"),
    ({"question": "Who?", "is_impossible": True, "answers": [], "plausible_answers":
      [{"text": "Broncos"}], "passages": [{"title": "t", "text": "x"}]},
     r"marked unanswerable \('is_impossible': true\)"),
    ({"id": "2hop", "question": "Where?", "answer": "Oslo", "answer_aliases": [],
      "answerable": False, "paragraphs": [{"idx": 0, "title": "A", "paragraph_text": "x",
                                           "is_supporting": False}]},
     r"marked unanswerable \('answerable': false\)"),
    ({"title": "Super_Bowl_50", "paragraphs": [{"context": "x", "qas": [
        {"id": "1", "question": "Who?", "answers": [{"text": "x", "answer_start": 0}]}]}]},
     "SQuAD's nested JSON"),
])
def test_unanswerable_and_nested_squad_records_are_refused(tmp_path, record, message):
    (tmp_path / "u.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=f"longqa record 0: .*{message}"):
        longqa.load("validation", source=str(tmp_path / "u.jsonl"))


def test_squad_v2_json_file_is_refused_by_name(tmp_path):
    raw = {"version": "v2.0", "data": [{"title": "T", "paragraphs": [{"context": "x", "qas": []}]}]}
    (tmp_path / "dev-v2.0.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="SQuAD's nested JSON"):
        longqa.load("validation", source=str(tmp_path / "dev-v2.0.json"))
