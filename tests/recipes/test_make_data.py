"""The bundled sample data is exactly what ``make_data`` generates, small, and right: every gold
answer is worked out again from the question text (GSM8K), the table rows in plain Python
(Txt2SQL) or the passages (long QA), never from the generator's own code."""
import re
import sqlite3
import statistics
from collections import Counter
from pathlib import Path

from polynya.recipes.tasks import gsm8k, longqa, make_data, txt2sql
from polynya.recipes.tasks.common import DATA_DIR, read_records


def _files(root: Path) -> dict[str, Path]:
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}


def _sqlite_writer_version(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[96:100], "big")   # SQLITE_VERSION_NUMBER of the writer


def _dump(path: Path) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return list(conn.iterdump())
    finally:
        conn.close()


def test_generation_is_deterministic_and_matches_the_bundled_files(tmp_path):
    written = make_data.generate(tmp_path / "a")
    make_data.generate(tmp_path / "b")
    a, b, bundled = _files(tmp_path / "a"), _files(tmp_path / "b"), _files(DATA_DIR)
    assert sorted(p.relative_to(tmp_path / "a").as_posix() for p in written) == sorted(a)
    assert sorted(a) == sorted(b) == sorted(bundled)          # no missing, no stale files
    major, minor, patch = sqlite3.sqlite_version_info
    here = major * 1_000_000 + minor * 1000 + patch
    for name in a:
        assert a[name].read_bytes() == b[name].read_bytes(), name
        if name.endswith(".sqlite") and _sqlite_writer_version(bundled[name]) != here:
            assert _dump(a[name]) == _dump(bundled[name]), name   # another SQLite wrote it
        else:
            assert a[name].read_bytes() == bundled[name].read_bytes(), name


def test_bundled_data_is_small():
    assert sum(p.stat().st_size for p in _files(DATA_DIR).values()) < 2 * 1024 * 1024


def test_cli_writes_to_out(tmp_path, capsys):
    make_data.main(["--out", str(tmp_path)])
    assert (tmp_path / "gsm8k" / "train.jsonl").is_file()
    assert "txt2sql/database/shop/shop.sqlite" in capsys.readouterr().out


# ---------------------------------------------------------------- gold answers, recomputed
_GSM8K = [
    (r"has (\d+) \w+\. \w+ buys (\d+) more and then gives (\d+) to", lambda a, b, c: a + b - c),
    (r"buys (\d+) notebooks that cost \$(\d+) each and pays with a \$(\d+) bill",
     lambda n, p, bill: bill - n * p),
    (r"receives (\d+) boxes with (\d+) \w+ in each box\. (\d+) of the", lambda b, p, k: b * p - k),
    (r"earns \$(\d+) an hour and works (\d+) hours a day for (\d+) days\. .* spends half",
     lambda r, h, d: r * h * d / 2),
    ((r"read (\d+) pages on Monday\. On Tuesday \w+ read (\d+) pages more than on Monday, and on "
      r"Wednesday twice as many"), lambda m, k: m + (m + k) + 2 * m),
    (r"shares (\d+) \w+ by giving (\d+) to each of (\d+) friends and keeping the rest",
     lambda t, e, g: t - e * g),
]


def test_gsm8k_answers_and_calculator_notes_are_right():
    for split in ("train", "test"):
        for e in gsm8k.load(split):
            q = e.meta["question"]
            found = [(m, f) for pattern, f in _GSM8K if (m := re.search(pattern, q))]
            assert len(found) == 1, q
            m, f = found[0]
            want = f(*map(int, m.groups()))
            assert want == int(want) and want >= 0, q
            assert e.answer == str(int(want)), (q, e.answer, want)
            notes = re.findall(r"<<([^=>]+)=([^>]+)>>", e.meta["solution"])
            assert notes, e.meta["solution"]
            for expr, value in notes:
                assert re.fullmatch(r"[\d+\-*/ ]+", expr)
                assert eval(expr) == float(value), (expr, value)  # digits and + - * / only


def _tables(db_path: str) -> dict[str, list[tuple]]:
    conn = sqlite3.connect(db_path)
    try:
        names = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {n: conn.execute(f'SELECT * FROM "{n}"').fetchall() for n in names}
    finally:
        conn.close()


def _only(rows: list, key) -> list:
    """The row with the largest ``key``, checked to be the only one (no tie)."""
    best = max(map(key, rows))
    top = [r for r in rows if key(r) == best]
    assert len(top) == 1, top
    return top


def _by(rows, col, value):
    [row] = [r for r in rows if r[col] == value]
    return row


def _sql_oracles(t: dict) -> list[tuple[str, object]]:
    """(question pattern, fn(*groups) -> (rows, ordered)) for every bundled Txt2SQL question."""
    c, p, o = t.get("customers"), t.get("products"), t.get("orders")
    s, co, en = t.get("students"), t.get("courses"), t.get("enrollments")
    a, b, lo = t.get("authors"), t.get("books"), t.get("loans")
    one = lambda v: ([(v,)], False)
    col = lambda rows, ordered=False: ([(v,) for v in rows], ordered)
    return [
        (r"How many customers live in (\w+)\?", lambda x: one(sum(r[2] == x for r in c))),
        (r"List the names of all products in the (\w+) category\.",
         lambda x: col([r[1] for r in p if r[2] == x])),
        (r"What is the name of the most expensive product\?",
         lambda: col([r[1] for r in _only(p, lambda r: r[3])], True)),
        (r"What are the three cheapest products, from the cheapest up\?",
         lambda: col([r[1] for r in sorted(p, key=lambda r: r[3])[:3]], True)),
        (r"What is the average price of products in the (\w+) category\?",
         lambda x: one(statistics.fmean(r[3] for r in p if r[2] == x))),
        (r"How many orders has (.+) placed\?",
         lambda x: one(sum(r[1] == _by(c, 1, x)[0] for r in o))),
        (r"What total quantity of the product '(.+)' has been ordered\?",
         lambda x: one(sum(r[3] for r in o if r[2] == _by(p, 1, x)[0]))),
        (r"List the names of customers who joined in 2020 or later, in alphabetical order\.",
         lambda: col(sorted(r[1] for r in c if r[3] >= 2020), True)),
        (r"Which customers have never placed an order\? Give their names\.",
         lambda: col([r[1] for r in c if r[0] not in {x[1] for x in o}])),
        (r"How many different customers have ordered (\w+) products\?",
         lambda x: one(len({r[1] for r in o if _by(p, 0, r[2])[2] == x}))),
        (r"How much money \(price times quantity\) have customers from (\w+) spent\?",
         lambda x: one(sum(_by(p, 0, r[2])[3] * r[3] for r in o if _by(c, 0, r[1])[2] == x))),
        (r"How many products are there in each category\?",
         lambda: (list(Counter(r[2] for r in p).items()), False)),
        (r"How many orders were placed in March 2024\?",
         lambda: one(sum(r[4].startswith("2024-03-") for r in o))),
        (r"What is the largest quantity ordered in a single order\?", lambda: one(max(r[3] for r in o))),
        (r"How many students are in grade (\d+)\?", lambda x: one(sum(r[2] == int(x) for r in s))),
        (r"List the titles of the courses of the (\w+) department\.",
         lambda x: col([r[1] for r in co if r[2] == x])),
        (r"What is the average score in (.+)\?",
         lambda x: one(statistics.fmean(r[2] for r in en if r[1] == _by(co, 1, x)[0]))),
        (r"Which student got the highest score in (.+)\?",
         lambda x: col([_by(s, 0, r[0])[1] for r in _only([r for r in en if r[1] == _by(co, 1, x)[0]],
                                                          lambda r: r[2])], True)),
        (r"How many courses is (.+) enrolled in\?",
         lambda x: one(sum(r[0] == _by(s, 1, x)[0] for r in en))),
        (r"List the names of students from (\w+), sorted by name\.",
         lambda x: col(sorted(r[1] for r in s if r[3] == x), True)),
        (r"What is the total number of credits of the courses (.+) takes\?",
         lambda x: one(sum(_by(co, 0, r[1])[3] for r in en if r[0] == _by(s, 1, x)[0]))),
        (r"Which department offers the most courses\?",
         lambda: col([d for d, _ in _only(list(Counter(r[2] for r in co).items()), lambda r: r[1])],
                     True)),
        (r"How many different students scored above (\d+) in some course\?",
         lambda x: one(len({r[0] for r in en if r[2] > int(x)}))),
        (r"Which students are not enrolled in any course\?",
         lambda: col([r[1] for r in s if r[0] not in {x[0] for x in en}])),
        (r"How many students are there in each grade\?",
         lambda: (list(Counter(r[2] for r in s).items()), False)),
        (r"Which course titles have more than (\d+) students enrolled\?",
         lambda x: col([r[1] for r in co if sum(e[1] == r[0] for e in en) > int(x)])),
        (r"What is the average score of students who live in (\w+)\?",
         lambda x: one(statistics.fmean(r[2] for r in en if _by(s, 0, r[0])[3] == x))),
        (r"What is the lowest score recorded in any course\?", lambda: one(min(r[2] for r in en))),
        (r"How many courses are worth (\d+) credits\?", lambda x: one(sum(r[3] == int(x) for r in co))),
        (r"How many books by (.+) does the library have\?",
         lambda x: one(sum(r[2] == _by(a, 1, x)[0] for r in b))),
        (r"List the titles of the (\w+) books\.", lambda x: col([r[1] for r in b if r[5] == x])),
        (r"Who wrote '(.+)'\?", lambda x: col([_by(a, 0, _by(b, 1, x)[2])[1]])),
        (r"How many times has '(.+)' been borrowed\?",
         lambda x: one(sum(r[1] == _by(b, 1, x)[0] for r in lo))),
        (r"How many books has (\w+) borrowed\?", lambda x: one(sum(r[2] == x for r in lo))),
        (r"Which book has the most pages\?", lambda: col([r[1] for r in _only(b, lambda r: r[4])], True)),
        (r"What is the average number of pages of books published after (\d+)\?",
         lambda x: one(statistics.fmean(r[4] for r in b if r[3] > int(x)))),
        (r"How many books are on loan right now \(borrowed and not returned\)\?",
         lambda: one(sum(r[4] == 0 for r in lo))),
        (r"List the names of the authors from (\w+), from the oldest to the youngest\.",
         lambda x: col([r[1] for r in sorted((r for r in a if r[2] == x), key=lambda r: r[3])], True)),
        (r"Which authors have no books in the library\?",
         lambda: col([r[1] for r in a if r[0] not in {x[2] for x in b}])),
        ((r"List the titles of the books published before (\d+), oldest first \(books of the same "
          r"year in alphabetical order\)\."),
         lambda x: col([r[1] for r in sorted((r for r in b if r[3] < int(x)), key=lambda r: (r[3], r[1]))],
                       True)),
        (r"How many books are there in each genre\?",
         lambda: (list(Counter(r[5] for r in b).items()), False)),
        (r"Which member has borrowed the most books\?",
         lambda: col([m for m, _ in _only(list(Counter(r[2] for r in lo).items()), lambda r: r[1])], True)),
        (r"What is the title of the oldest book by (.+)\?",
         lambda x: col([r[1] for r in _only([r for r in b if r[2] == _by(a, 1, x)[0]], lambda r: -r[3])],
                       True)),
        (r"What is the total number of pages of all (\w+) books\?",
         lambda x: one(sum(r[4] for r in b if r[5] == x))),
    ]


def test_txt2sql_gold_results_equal_answers_computed_in_python():
    for split in ("train", "test"):
        for e in txt2sql.load(split):
            oracles = _sql_oracles(_tables(e.meta["db_path"]))
            found = [(m, f) for pattern, f in oracles if (m := re.fullmatch(pattern, e.meta["question"]))]
            assert len(found) == 1, e.meta["question"]
            m, f = found[0]
            try:
                rows, ordered = f(*m.groups())
            except (TypeError, ValueError, KeyError) as exc:  # a table this database lacks
                raise AssertionError(f"{e.meta['db_id']}: {e.meta['question']}: {exc}") from exc
            gold = txt2sql.gold_result(e.meta["db_path"], e.answer)
            assert rows, e.meta["question"]
            assert ordered == e.meta["ordered"], e.meta["question"]
            assert txt2sql.same_result(gold, rows, ordered), (e.meta["question"], gold, rows)


_FACTS = [
    ("person", (r"(?P<name>[A-Z]\w+ [A-Z]\w+) \(born (?P<born>\d{4})\) is an? \w+\. \w+ was born in "
                r"(?P<town>[A-Z]\w+) and works for (?P<employer>[A-Z]\w+ \w+)\. ")),
    ("town", (r"(?P<name>[A-Z]\w+) is a town on the banks of (?P<river>the [A-Z]\w+ River)\. "
              r"It was founded in \d+ ")),
    ("company", (r"(?P<name>[A-Z]\w+ \w+) is a company founded in (?P<year>\d{4}) by "
                 r"(?P<founder>[A-Z]\w+ [A-Z]\w+)\. Its head office")),
]


def _passage_facts(passages: list[dict]) -> dict[str, dict]:
    facts = {}
    for p in passages:
        kinds = [(k, m) for k, pattern in _FACTS if (m := re.match(pattern, p["text"]))]
        assert len(kinds) == 1, p["text"][:120]
        kind, m = kinds[0]
        assert m["name"] == p["title"] and m["name"] not in facts, p["title"]
        facts[m["name"]] = {"kind": kind, **m.groupdict()}
    return facts


def _longqa_oracle(question: str, facts: dict) -> str:
    rules = [
        (r"In which town was (.+) born\?", lambda x: facts[x]["town"]),
        (r"In what year was the founder of (.+) born\?", lambda x: facts[facts[x]["founder"]]["born"]),
        (r"In what year was (.+) founded\?", lambda x: facts[x]["year"]),
        (r"Which river flows through the town where (.+) was born\?",
         lambda x: facts[facts[x]["town"]]["river"]),
        (r"Who founded the company that (.+) works for\?", lambda x: facts[facts[x]["employer"]]["founder"]),
    ]
    [answer] = [f(m.group(1)) for pattern, f in rules if (m := re.fullmatch(pattern, question))]
    return answer


def test_longqa_answers_follow_from_the_passages_given():
    seen = {}
    for split in ("train", "test"):
        records = read_records(DATA_DIR / "longqa" / f"{split}.jsonl")
        for record, e in zip(records, longqa.load(split), strict=True):
            facts = _passage_facts(record["passages"])
            for name, f in facts.items():     # one world: an entity says the same everywhere
                assert seen.setdefault(name, f) == f, name
            answer = _longqa_oracle(record["question"], facts)  # KeyError: a hop is missing
            assert answer == record["answers"][0], record["question"]
            assert longqa.reward(f"\\boxed{{{answer}}}", e) == 1.0
            assert set(record["supporting"]) <= set(facts)
