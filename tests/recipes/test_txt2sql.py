"""Txt2SQL task: loaders, execution-match reward, and the sandbox against malicious SQL."""
import hashlib
import json
import os
import shutil
import sqlite3
import time
from pathlib import Path

import pytest
from polynya.recipes.tasks import Example, make_data, sqlsafe, txt2sql
from polynya.recipes.tasks.common import DATA_DIR


@pytest.fixture
def shop(tmp_path) -> Example:
    """A bundled shop question whose database is a private copy in its own folder."""
    shutil.copytree(DATA_DIR / "txt2sql", tmp_path / "txt2sql")
    examples = txt2sql.load("train", source=str(tmp_path / "txt2sql"))
    ex = next(e for e in examples if e.meta["db_id"] == "shop")
    assert Path(ex.meta["db_path"]).is_relative_to(tmp_path)
    return ex


def _block(sql: str) -> str:
    return f"Here is the query.\n```sql\n{sql}\n```"


def _snapshot(folder: Path) -> dict:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def test_bundled_sample_and_all_gold_queries_score_full():
    train, test = txt2sql.load("train"), txt2sql.load("test")
    assert (len(train), len(test)) == (45, 15)
    assert {e.meta["db_id"] for e in train} == {"shop", "school", "library"}
    for e in train + test:
        assert "CREATE TABLE" in e.prompt and "```sql" in e.prompt
        assert e.meta["question"] in e.prompt
        assert txt2sql.reward(_block(e.answer), e) == 1.0


def test_prompt_has_schema_and_sample_rows(shop):
    assert "CREATE TABLE customers" in shop.prompt and "CREATE TABLE orders" in shop.prompt
    assert "-- first rows of customers: id | name | city | joined_year" in shop.prompt
    rows = sqlsafe.run_query(shop.meta["db_path"], "SELECT * FROM customers LIMIT 1")
    assert " | ".join(map(str, rows[0])) in shop.prompt


def test_wrong_but_valid_sql_gets_partial_credit(shop):
    assert txt2sql.reward(_block("SELECT 1 + 1"), shop) == pytest.approx(0.1)
    assert txt2sql.reward(_block("SELECT name FROM customers"), shop) == pytest.approx(0.1)
    assert txt2sql.reward(_block("SELECT nme FROM customers"), shop) == 0.0   # error
    assert txt2sql.reward(_block("SELEC name"), shop) == 0.0                   # syntax
    assert txt2sql.reward("I do not know.", shop) == 0.0
    assert txt2sql.reward(_block("SELECT 1"), shop, partial=0.0) == 0.0


def test_result_sets_compare_as_multisets_unless_gold_orders():
    db = str(DATA_DIR / "txt2sql" / "database" / "shop" / "shop.sqlite")
    unordered = Example("q", "SELECT name FROM products WHERE category = 'toys'",
                        {"db_path": db, "ordered": False})
    assert txt2sql.reward(_block(unordered.answer + " ORDER BY name DESC"), unordered) == 1.0
    assert txt2sql.reward(_block("SELECT name FROM products WHERE category = 'toys' UNION ALL "
                                 "SELECT 'kite'"), unordered) == pytest.approx(0.1)  # multiset
    ordered = Example("q", "SELECT name FROM products ORDER BY price DESC LIMIT 3",
                      {"db_path": db, "ordered": True})
    assert txt2sql.reward(_block(ordered.answer), ordered) == 1.0
    reverse = ("SELECT name FROM (SELECT name, price FROM products ORDER BY price DESC LIMIT 3) "
               "ORDER BY price ASC")
    assert txt2sql.reward(_block(reverse), ordered) == pytest.approx(0.1)
    assert txt2sql.same_result([(1.0000000001, "a")], [(1.0, "a")], ordered=True)
    assert not txt2sql.same_result([(1, "a")], [(1, "a"), (1, "a")], ordered=False)


@pytest.mark.parametrize("completion,sql", [
    ("```sql\nSELECT 1\n```\nbetter:\n```sql\nSELECT 2;\n```", "SELECT 2;"),
    ("```SQL\nSELECT 3\n```", "SELECT 3"),
    ("```sqlite\nSELECT 6\n```", "SELECT 6"),
    ("```SQLite  \nSELECT 7;\n```", "SELECT 7;"),
    ("```sqlite\nSELECT 1\n```\nor\n```sql\nSELECT 8\n```", "SELECT 8"),     # last of either tag
    ("```sql\nSELECT 9\n```\n```python\nprint(9)\n```", "SELECT 9"),       # an SQL block first
    ("```sqlalchemy\nq = 10\n```", "q = 10"),        # not an SQL tag: the any-block rule
    ("```sqlite3\nSELECT 11\n```", "SELECT 11"),
    ("```\nSELECT 4\n```", "SELECT 4"),
    ("Let me think.\n```sql\nSELECT 5 FROM t", "SELECT 5 FROM t"),    # unclosed final block
    ("The query is:\nSELECT name\nFROM t;\nDone.", "SELECT name\nFROM t"),
    ("SELECT a FROM t;\n\nWith this query we get the names.", "SELECT a FROM t"),
    ("WITH x AS (SELECT 1) SELECT * FROM x;\nSelect all rows, then filter.",
     "WITH x AS (SELECT 1) SELECT * FROM x"),
    ("Select the table first.\n\nWith it we are done.", "With it we are done."),  # none parses
    ("no sql at all", None),
])
def test_extract_sql(completion, sql):
    assert txt2sql.extract_sql(completion) == sql


ADVERSARIAL = [
    "DROP TABLE customers",
    "UPDATE customers SET city = 'Nowhere'",
    "INSERT INTO customers VALUES (999, 'Eve', 'Oslo', 2024)",
    "DELETE FROM orders",
    "REPLACE INTO products VALUES (1, 'x', 'y', 0)",
    "CREATE TABLE evil (x)",
    "CREATE TEMP TABLE evil AS SELECT 1",
    "ATTACH DATABASE '{dir}/evil.db' AS evil",
    "SELECT 1; ATTACH DATABASE '{dir}/evil.db' AS evil",
    "SELECT name FROM customers; DROP TABLE customers",
    "SELECT name FROM customers; -- done\nDROP TABLE customers",
    "SELECT name FROM customers; /* done */ DELETE FROM orders",
    "SELECT ';' ; DROP TABLE customers",
    "SELECT '--' ; DROP TABLE customers",
    "SELECT 1 /* ; */ ; DELETE FROM orders; -- */",
    "SELECT [a;b] FROM customers; DROP TABLE customers",
    "VACUUM INTO '{dir}/copy.db'",
    "PRAGMA writable_schema = ON",
    "PRAGMA journal_mode = WAL",
    "BEGIN IMMEDIATE",
    "WITH x AS (SELECT 1) INSERT INTO orders SELECT 1000, 1, 1, 1, '2024-01-01' FROM x",
    "WITH x AS (SELECT 1) UPDATE customers SET name = 'Eve'",
    "SELECT load_extension('{dir}/evil.so')",
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c",
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c",
    "SELECT zeroblob(2000000000)",
    "SELECT * FROM pragma_table_info('customers')",
    # audit 2026-12-07: writing PRAGMAs, CLI-only file functions, transactions, a runaway cross
    # join (60^5 rows: the time limit) and a wide one (216,000 rows: the row limit), memory
    "PRAGMA query_only = OFF",
    "SELECT 1; PRAGMA query_only = OFF; DELETE FROM orders",
    "SELECT writefile('{dir}/evil.txt', 'x')",
    "SELECT readfile('{dir}/shop.sqlite')",
    "DETACH DATABASE main",
    "SAVEPOINT s",
    "ANALYZE",
    "REINDEX",
    "SELECT count(*) FROM orders a, orders b, orders c, orders d, orders e",
    "SELECT a.id, b.id, c.id FROM orders a, orders b, orders c",
    ("WITH RECURSIVE c(x) AS (SELECT randomblob(1000000) UNION ALL SELECT randomblob(1000000) "
     "FROM c) SELECT count(*) FROM c"),
    "SELECT printf('%.*c', 2000000000, 'x')",
]


@pytest.mark.parametrize("sql", ADVERSARIAL)
def test_malicious_sql_scores_zero_fast_and_changes_nothing(shop, sql):
    db = Path(shop.meta["db_path"])
    root = db.parents[2]
    before = _snapshot(root)
    start = time.monotonic()
    score = txt2sql.reward(_block(sql.format(dir=db.parent)), shop)
    elapsed = time.monotonic() - start
    assert score == 0.0
    assert elapsed < 1.5
    assert _snapshot(root) == before          # same files, byte for byte, none new
    assert sqlite3.connect(db).execute("SELECT COUNT(*) FROM customers").fetchone()[0] == 24


@pytest.mark.parametrize("sql", ["DROP TABLE customers", "ATTACH DATABASE '{dir}/evil.db' AS e",
                                 "PRAGMA writable_schema = ON", "VACUUM INTO '{dir}/copy.db'",
                                 "CREATE TEMP TABLE t (x)", "SELECT load_extension('x')"])
def test_inner_layers_hold_without_the_keyword_check(shop, sql, monkeypatch):
    """Read-only URI, query_only and the authorizer hold even without the SELECT-only check."""
    monkeypatch.setattr(sqlsafe, "single_statement", lambda s: s.strip())
    db = Path(shop.meta["db_path"])
    before = _snapshot(db.parents[2])
    with pytest.raises(sqlsafe.QueryError):
        sqlsafe.run_query(db, sql.format(dir=db.parent))
    assert _snapshot(db.parents[2]) == before


def test_row_limit_and_time_limit():
    db = DATA_DIR / "txt2sql" / "database" / "school" / "school.sqlite"
    with pytest.raises(sqlsafe.QueryError, match="more than 5 rows"):
        sqlsafe.run_query(db, "SELECT * FROM students", max_rows=5)
    assert len(sqlsafe.run_query(db, "SELECT * FROM students", max_rows=30)) == 30
    start = time.monotonic()
    with pytest.raises(sqlsafe.QueryError, match="time limit"):
        sqlsafe.run_query(db, "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
                              "SELECT max(x) FROM c", timeout_s=0.2)
    assert time.monotonic() - start < 1.0


def _mini_db(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path)
    conn.executescript("CREATE TABLE pets (name TEXT, kind TEXT, age INT);"
                       "INSERT INTO pets VALUES ('Rex', 'dog', 3), ('Tom', 'cat', 5), "
                       "('Kit', 'cat', 1);")
    conn.commit()
    conn.close()


def test_spider_and_bird_layouts(tmp_path):
    spider = tmp_path / "spider"
    _mini_db(spider / "database" / "pets" / "pets.sqlite")
    (spider / "train_spider.json").write_text(json.dumps([
        {"db_id": "pets", "question": "How many cats?",
         "query": "SELECT count(*) FROM pets WHERE kind = 'cat'", "sql": {"parsed": "ignored"}}]))
    [ex] = txt2sql.load("train", source=str(spider))
    assert ex.answer.startswith("SELECT count(*)") and "CREATE TABLE pets" in ex.prompt
    assert txt2sql.reward("```sql\nSELECT COUNT(name) FROM pets WHERE kind='cat'\n```", ex) == 1.0

    bird = tmp_path / "bird"
    _mini_db(bird / "dev_databases" / "pets" / "pets.sqlite")
    (bird / "dev.json").write_text(json.dumps([
        {"db_id": "pets", "question": "Oldest pet?", "evidence": "oldest refers to MAX(age)",
         "SQL": "SELECT name FROM pets ORDER BY age DESC LIMIT 1"}]))
    [ex] = txt2sql.load("dev", source=str(bird))
    assert "Hint: oldest refers to MAX(age)" in ex.prompt and ex.meta["ordered"]
    best = "```sql\nSELECT name FROM pets WHERE age = (SELECT MAX(age) FROM pets)\n```"
    assert txt2sql.reward(best, ex) == 1.0


def test_bad_inputs_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        txt2sql.load("dev")
    with pytest.raises(ValueError, match="must be a BIRD/Spider-style directory"):
        txt2sql.load("train", source=str(tmp_path / "nowhere"))
    _mini_db(tmp_path / "database" / "pets" / "pets.sqlite")
    (tmp_path / "train.json").write_text(
        json.dumps([{"db_id": "cars", "question": "q", "SQL": "SELECT 1"}]))
    with pytest.raises(ValueError, match="record 0: field 'db_id': no SQLite file for 'cars'"):
        txt2sql.load("train", source=str(tmp_path))
    (tmp_path / "train.json").write_text(json.dumps([
        {"db_id": "pets", "question": "q", "SQL": "SELECT 1"}, {"db_id": "pets", "question": "q"}]))
    with pytest.raises(ValueError, match="record 1: missing field 'SQL'"):
        txt2sql.load("train", source=str(tmp_path))
    (tmp_path / "train.json").write_text(json.dumps([{"db_id": "pets", "SQL": "SELECT 1"}]))
    with pytest.raises(ValueError, match="record 0: missing field 'question'"):
        txt2sql.load("train", source=str(tmp_path))
    with pytest.raises(ValueError, match="no file for split 'test'"):
        txt2sql.load("test", source=str(tmp_path))


def _rows_db(path: Path, n: int) -> str:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t (x INTEGER)")
    conn.executemany("INSERT INTO t VALUES (?)", [(i,) for i in range(n)])
    conn.commit()
    conn.close()
    return str(path)


def test_a_gold_result_larger_than_max_rows_can_still_be_matched(tmp_path):
    """Audit 2026-12-07: a gold query returning more than ``max_rows`` (10,000) rows made every
    correct completion score 0 (the prediction was refused for its row count)."""
    db = _rows_db(tmp_path / "big.sqlite", 12_000)
    ex = Example("q", "SELECT x FROM t", {"db_path": db, "ordered": False})
    assert txt2sql.reward(_block("SELECT x FROM t ORDER BY x DESC"), ex) == 1.0
    assert txt2sql.reward(_block("SELECT x FROM t WHERE x > 0"), ex) == pytest.approx(0.1)
    assert txt2sql.reward(_block("SELECT x FROM t UNION ALL SELECT 1"), ex) == 0.0  # > both
    small = Example("q", "SELECT x FROM t WHERE x < 5", {"db_path": db, "ordered": False})
    assert txt2sql.reward(_block("SELECT x FROM t"), small) == 0.0               # > max_rows
    assert txt2sql.reward(_block("SELECT x FROM t"), small, max_rows=20_000) == pytest.approx(0.1)


def _count_to(n: int) -> str:
    return (f"WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < {n}) "
            "SELECT count(*) FROM c")


def test_a_query_as_slow_as_the_gold_one_is_not_timed_out(tmp_path):
    """Review 2026-12: the completion's time limit was ``timeout_s`` (0.5 s) whatever the gold
    query's own time (30 s allowed), so on a database where the gold query takes longer (a large
    BIRD table) the gold query itself, as the completion, scored 0. The limit is now at least
    ``GOLD_TIME_FACTOR`` times the gold query's measured time."""
    db = _script_db(tmp_path / "slow.sqlite", "CREATE TABLE t (x);")
    gold = _count_to(1_000_000)                      # ~0.45 s on the 2-core CPU machine
    ex = Example("q", gold, {"db_path": db, "ordered": False})
    start = time.monotonic()
    txt2sql.gold_result(db, gold)
    gold_s = time.monotonic() - start
    timeout_s = gold_s / 5                           # the gold query outlasts it on any machine
    assert txt2sql.reward(_block(gold), ex, timeout_s=timeout_s) == 1.0
    assert txt2sql.reward(_block(_count_to(999_999)), ex, timeout_s=timeout_s) == pytest.approx(0.1)
    start = time.monotonic()                         # far slower than the gold: still stopped
    assert txt2sql.reward(_block(_count_to(10**9)), ex, timeout_s=timeout_s) == 0.0
    assert time.monotonic() - start < txt2sql.GOLD_TIME_FACTOR * gold_s + 2.0
    quick = Example("q", "SELECT count(*) FROM t", {"db_path": db, "ordered": False})
    start = time.monotonic()                         # a fast gold query keeps timeout_s
    assert txt2sql.reward(_block(_count_to(10**9)), quick, timeout_s=0.1) == 0.0
    assert time.monotonic() - start < 1.0


def _script_db(path: Path, script: str) -> str:
    conn = sqlite3.connect(path)
    conn.executescript(script)
    conn.commit()
    conn.close()
    return str(path)


def _values_db(path: Path) -> str:
    return _script_db(path, "CREATE TABLE v (k INTEGER, a, b); INSERT INTO v VALUES "
                            "(1, NULL, 'x'), (2, 1, 'y'), (3, 1.5, NULL), (4, '1', 'z'), (5, 1, 'y');")


@pytest.mark.parametrize("gold,pred,score", [
    ("SELECT a FROM v WHERE k < 3", "SELECT a FROM v WHERE k IN (2, 1)", 1.0),
    ("SELECT a FROM v WHERE k = 1", "SELECT '' FROM v WHERE k = 1", 0.1),     # NULL is not ''
    ("SELECT a FROM v WHERE k = 1", "SELECT 0 FROM v WHERE k = 1", 0.1),      # nor 0
    ("SELECT a FROM v WHERE k = 1", "SELECT NULL", 1.0),
    ("SELECT a FROM v WHERE k = 2", "SELECT 1.0", 1.0),                       # 1 = 1.0
    ("SELECT a FROM v WHERE k = 2", "SELECT '1'", 0.1),                       # '1' is text
    ("SELECT a FROM v WHERE k = 4", "SELECT 1", 0.1),
    ("SELECT k, b FROM v WHERE k < 3", "SELECT k, b FROM v WHERE k < 3 ORDER BY k DESC", 1.0),
    ("SELECT k, b FROM v WHERE k < 3", "SELECT b, k FROM v WHERE k < 3", 0.1),  # columns by position
    ("SELECT b FROM v WHERE k IN (2, 5)", "SELECT DISTINCT b FROM v WHERE k IN (2, 5)", 0.1),
    ("SELECT b FROM v WHERE k IN (2, 5) ORDER BY b", "SELECT 'y' UNION ALL SELECT 'y'", 1.0),
    ("SELECT b FROM v WHERE k IN (2, 5) ORDER BY b", "SELECT 'y'", 0.1),      # duplicates count
    ("SELECT a FROM v WHERE k > 9", "SELECT b, k FROM v WHERE 0", 1.0),       # empty = empty
    ("SELECT a FROM v WHERE k = 3", "SELECT 1.5000001", 1.0),                 # float tolerance
    ("SELECT a FROM v WHERE k = 3", "SELECT 1.50001", 0.1),
])
def test_comparison_rules(tmp_path, gold, pred, score):
    db = _values_db(tmp_path / "v.sqlite")
    ex = Example("q", gold, {"db_path": db, "ordered": txt2sql.is_ordered(gold)})
    assert txt2sql.reward(_block(pred), ex) == pytest.approx(score)


def test_ordered_bundled_gold_queries_order_totally():
    """Audit 2026-12-07: "books before 1970, oldest first" ordered by year alone, which ties
    (1957, 1963), so a correct query breaking ties otherwise scored 0.1. Every ordered gold
    query's rows must be the only order its question allows."""
    for e in txt2sql.load("train") + txt2sql.load("test"):
        if not e.meta["ordered"]:
            continue
        conn = sqlite3.connect(e.meta["db_path"])
        try:
            make_data._check_gold(conn, e.meta["db_id"], e.answer)  # raises on a tie
        finally:
            conn.close()
    [ex] = [e for e in txt2sql.load("test") if "before 1970" in e.meta["question"]]
    for pred in ("SELECT title FROM books WHERE year < 1970 ORDER BY year ASC, title ASC",
                 ("SELECT title FROM (SELECT * FROM books ORDER BY id DESC) WHERE year < 1970 "
                  "ORDER BY year, title COLLATE BINARY")):
        assert txt2sql.reward(_block(pred), ex) == 1.0
    assert txt2sql.reward(_block("SELECT title FROM books WHERE year < 1970 ORDER BY year, "
                                 "id DESC"), ex) == pytest.approx(0.1)


def test_broken_gold_query_is_reported_not_scored():
    db = str(DATA_DIR / "txt2sql" / "database" / "shop" / "shop.sqlite")
    ex = Example("q", "SELECT no_such_column FROM customers", {"db_path": db})
    with pytest.raises(ValueError, match="gold query failed"):
        txt2sql.reward(_block("SELECT 1"), ex)
    with pytest.raises(ValueError, match="gold query failed"):      # rejected or not
        txt2sql.reward(_block("DROP TABLE customers"), ex)


@pytest.mark.parametrize("fence", ["sqlite", "SQLite", "sql", "SQL"])
def test_sql_and_sqlite_fences_score(shop, fence):
    completion = f"Done.\n```{fence}\n{shop.answer}\n```"
    assert txt2sql.extract_sql(completion) == shop.answer
    assert txt2sql.reward(completion, shop) == 1.0


@pytest.mark.parametrize("tail", ["; -- done", " -- done", ";\n-- checked\n", "; /* a; b */",
                                  " /* done */ ;;", "; -- x\n/* y */ ;"])
def test_trailing_comments_after_the_query_are_accepted(shop, tail):
    assert sqlsafe.single_statement(shop.answer + tail) == shop.answer
    assert txt2sql.reward(_block(shop.answer + tail), shop) == 1.0


@pytest.mark.parametrize("sql,statement", [
    ("SELECT 'a;b' ; -- c", "SELECT 'a;b'"),
    ("SELECT 'it''s;' FROM t /* x; y */", "SELECT 'it''s;' FROM t"),
    ('SELECT "a;--" FROM [b;/*] -- ; \n;', 'SELECT "a;--" FROM [b;/*]'),
    ("SELECT 1 -- a\n FROM t;\n", "SELECT 1 -- a\n FROM t"),
    ("SELECT 1 /* never closed ; DROP TABLE t", "SELECT 1"),   # SQLite: a comment to the end
    ("SELECT ';' ; DROP TABLE t", None),
    ("SELECT '--' ; DROP TABLE t", None),
    ("SELECT 1 /* ; */ ; SELECT 2", None),
    ("SELECT 1 -- ;\n; SELECT 2", None),
    ("SELECT 'never closed ; SELECT 2", None),
    ("SELECT $a(';') ; DROP TABLE t", None),
    ("; -- nothing", None),
])
def test_single_statement_splits_outside_quotes_and_comments(sql, statement):
    assert "".join(text for _, text in sqlsafe.sql_lexemes(sql)) == sql
    if statement is None:
        with pytest.raises(sqlsafe.QueryError):
            sqlsafe.single_statement(sql)
    else:
        assert sqlsafe.single_statement(sql) == statement


@pytest.mark.parametrize("tail", ["; SELECT 1", "; -- done\nSELECT 1", " /* ; */ ; SELECT 1",
                                  " -- ;\n; SELECT 1"])
def test_a_second_statement_after_the_query_scores_zero(shop, tail):
    assert txt2sql.reward(_block(shop.answer + tail), shop) == 0.0


def test_prose_after_a_bare_query_does_not_replace_it(shop):
    for prose in ["With this query we get the answer.", "Select statements like this one count."]:
        completion = f"The query is:\n{shop.answer};\n\n{prose}"
        assert txt2sql.extract_sql(completion) == shop.answer
        assert txt2sql.reward(completion, shop) == 1.0


@pytest.mark.parametrize("gold,pred,ordered", [
    ("SELECT name FROM pets ORDER BY age", "SELECT name FROM pets ORDER BY name DESC", True),
    ("select name from pets order\nby age desc", "SELECT name FROM pets ORDER BY name", True),
    ("SELECT name FROM pets UNION SELECT kind FROM pets ORDER/* c */BY 1",
     "SELECT kind FROM pets UNION SELECT name FROM pets ORDER BY 1 DESC", True),
    ("SELECT name FROM (SELECT name, age FROM pets ORDER BY age DESC LIMIT 2)",
     "SELECT name FROM pets WHERE age > 2 ORDER BY name", False),
    ("WITH o AS (SELECT name FROM pets ORDER BY age DESC LIMIT 2) SELECT name FROM o",
     "SELECT name FROM pets WHERE age > 2 ORDER BY name", False),
    ("SELECT name FROM pets WHERE kind <> 'order by'", "SELECT name FROM pets ORDER BY name", False),
    ('SELECT name AS "order by" FROM pets -- order by age',
     "SELECT name FROM pets ORDER BY name", False),
    ("SELECT name, rank() OVER (ORDER BY age) FROM pets",
     "SELECT name, rank() OVER (ORDER BY age) FROM pets ORDER BY name DESC", False),
])
def test_only_an_outermost_order_by_orders_the_result(tmp_path, gold, pred, ordered):
    _mini_db(tmp_path / "database" / "pets" / "pets.sqlite")
    (tmp_path / "train.json").write_text(json.dumps([{"db_id": "pets", "question": "q",
                                                      "SQL": gold}]))
    [ex] = txt2sql.load("train", source=str(tmp_path))
    assert txt2sql.is_ordered(gold) == ex.meta["ordered"] == ordered
    rows, gold_rows = (sqlsafe.run_query(ex.meta["db_path"], q) for q in (pred, gold))
    assert rows != gold_rows and sorted(rows) == sorted(gold_rows)  # same rows, another order
    assert txt2sql.reward(_block(pred), ex) == (pytest.approx(0.1) if ordered else 1.0)
    del ex.meta["ordered"]                                             # decided from the gold SQL
    assert txt2sql.reward(_block(pred), ex) == (pytest.approx(0.1) if ordered else 1.0)


def _floats_db(path: Path) -> str:
    """v * 3 / 10 and v * 0.3 differ by an ulp across a 6th-decimal rounding boundary in rows
    n=1 and n=3 (2.0000235 vs 2.0000234999999997); row n=2 (2.00002299) rounds to 2.000023 both
    ways, so sorting by rounded values puts row n=1 on different sides of it in the two sets."""
    return _script_db(path, "CREATE TABLE m (n INT, v REAL); INSERT INTO m VALUES "
                            "(1, 6.666745), (3, 6.666765), (2, 6.6667433), (4, 1.5);")


@pytest.mark.parametrize("gold_order", ["", " ORDER BY n"])
def test_floats_match_within_tolerance_across_rounding_boundaries(tmp_path, gold_order):
    db = _floats_db(tmp_path / "m.sqlite")
    gold = f"SELECT v * 3 / 10, n FROM m{gold_order}"
    ex = Example("q", gold, {"db_path": db, "ordered": txt2sql.is_ordered(gold)})
    pred = f"SELECT v * 0.3, n FROM m{gold_order}"
    a, b = sqlsafe.run_query(db, pred)[0][0], txt2sql.gold_result(db, gold)[0][0]
    assert a != b and round(a, 6) != round(b, 6) and abs(a - b) < 1e-12
    assert txt2sql.reward(_block(pred), ex) == 1.0
    assert txt2sql.reward(_block(f"SELECT v * 0.3 + 2e-6, n FROM m{gold_order}"), ex) \
        == pytest.approx(0.1)


def test_same_result_tolerance_and_multiset_matching():
    same = txt2sql.same_result
    assert same([(2.0000005,)], [(2.0000004999999,)], ordered=False)
    assert same([(2.0000005,)], [(2.0000004999999,)], ordered=True)
    assert same([(1e12 + 1e-3,)], [(1e12,)], ordered=True)        # relative 1e-15
    assert not same([(1.0,)], [(1.00001,)], ordered=False)
    assert same([(3,)], [(3.0000000001,)], ordered=False)         # int against float
    assert not same([(10**12,)], [(10**12 + 1,)], ordered=False)  # ints exactly
    assert not same([("1",)], [(1,)], ordered=False)
    # sorted by rounded floats, (2.0000235-ulp, 1) sorts before (2.000023, 2) in one set and
    # (2.0000235, 1) after it in the other: matched all the same
    pred = [(2.0000234999999997, 1), (2.000023, 2), (5.0, 3)]
    gold = [(5.0, 3), (2.000023, 2), (2.0000235, 1)]
    assert same(pred, gold, ordered=False)
    assert not same(pred, gold[:2] + [(2.0000235, 4)], ordered=False)
    assert not same(pred, gold, ordered=True)
    assert same([(1.0, "a"), (1.0, "a"), (2.0, "b")], [(2.0, "b"), (1.0000001, "a"), (1.0, "a")],
                ordered=False)
    assert not same([(1.0, "a"), (1.0, "a")], [(1.0, "a"), (1.0, "b")], ordered=False)


def test_a_database_changed_during_a_run_is_read_again(tmp_path):
    """The gold rows and the prompt's schema were cached by path: a database rewritten or
    replaced during a run kept being judged against the old file's gold rows (a correct
    query scored 0.1, silently). They are now cached per file (device, inode, size, mtime)."""
    db = _rows_db(tmp_path / "t.sqlite", 3)
    ex = Example("q", "SELECT max(x) FROM t", {"db_path": db, "ordered": False})
    assert txt2sql.reward(_block("SELECT 2"), ex) == 1.0
    assert "first rows of t: x" in txt2sql.describe_database(db)

    fresh = _rows_db(tmp_path / "new.sqlite", 5)            # replaced: another inode
    os.replace(fresh, db)
    assert txt2sql.gold_result(db, ex.answer) == ((4,),)
    assert txt2sql.reward(_block("SELECT 4"), ex) == 1.0
    assert txt2sql.reward(_block("SELECT 2"), ex) == pytest.approx(0.1)

    conn = sqlite3.connect(db)                              # changed in place
    conn.execute("ALTER TABLE t RENAME COLUMN x TO y")
    conn.execute("UPDATE t SET y = y + 10")
    conn.commit()
    conn.close()
    st = os.stat(db)  # a coarse-clock file system could keep the mtime: move it on by 1 s
    os.utime(db, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    gold = Example("q", "SELECT max(y) FROM t", {"db_path": db, "ordered": False})
    assert txt2sql.reward(_block("SELECT 14"), gold) == 1.0
    assert "first rows of t: y" in txt2sql.describe_database(db)

    os.remove(db)
    with pytest.raises(ValueError, match="cannot be read"):
        txt2sql.gold_result(db, gold.answer)
