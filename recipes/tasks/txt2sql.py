"""Text-to-SQL: (database, question, gold SQL) examples rewarded by execution match.

``load(split, source=None)`` reads a BIRD/Spider-style directory: a JSON list of records with
``db_id``, ``question`` and the gold query (``SQL`` as in BIRD, or ``query`` as in Spider;
BIRD's ``evidence`` is added to the prompt), and SQLite files at
``<dir>/database/<db_id>/<db_id>.sqlite`` (Spider; ``test_database/`` for its test split),
``<dir>/<split>_databases/<db_id>/...`` (BIRD), ``<dir>/databases/<db_id>.sqlite`` or
``<dir>/<db_id>.sqlite``. The split file is
``<split>.json``/``.jsonl`` (``train_spider.json`` for Spider's train, ``dev.json`` for
``validation``). ``source=None`` is the bundled sample: three generated databases (shop,
school, library) with questions and gold SQL under ``recipes/data/txt2sql``.

The prompt holds the schema DDL (from ``sqlite_master``), the first rows of every table and
the question, and asks for one query in a ```` ```sql ```` block. ``reward`` runs the query that
:func:`extract_sql` finds in the completion in the sandbox of :mod:`.sqlsafe` (model SQL is
untrusted: one read-only statement, bounded in time, rows and memory) and compares its rows with
the gold query's (:func:`same_result`): 1.0 on a match, ``partial`` (0.1) when the query runs
but differs, 0.0 when there is no query or it is rejected, fails, runs past
``max(timeout_s, GOLD_TIME_FACTOR * the gold query's time)`` or returns more than
``max(max_rows, len(gold rows))`` rows. The comparison (execution match, as Spider's and BIRD's
evaluations; the differences are deliberate):

- rows as a multiset (order ignored, duplicates counted), or as a list when the gold query's
  outermost statement has ``ORDER BY`` (Spider's rule; BIRD compares sets). A gold ``ORDER BY``
  whose key ties leaves the tied rows' order to SQLite, so gold queries should order totally
  (``make_data`` checks its own);
- columns by position: the same columns in another order do not match (BIRD's rule; Spider's
  test-suite evaluation also tries column permutations);
- values: ``NULL`` matches only ``NULL``; text and blobs exactly (``'1'`` is not ``1``);
  numbers by value (``1`` = ``1.0``), a float within 1e-6 absolute or 1e-9 relative;
- an empty gold result is matched by any empty result.

A gold query that fails is a data error: ``ValueError`` naming it (the driver counts the
completion as unjudged, it never scores it).
"""
from __future__ import annotations

import functools
import math
import os
import re
import time
from collections import Counter
from pathlib import Path

from .common import DATA_DIR, Example, check_split, field, read_split
from .sqlsafe import QueryError, connect_readonly, parses_as_query, run_query, sql_lexemes

NAME = "txt2sql"
SAMPLE_ROWS = 3
GOLD_TIMEOUT_S = 30.0
GOLD_TIME_FACTOR = 3.0  # a completion's query may run this many times as long as the gold one
_SPLIT_FILES = {"train": ("train_spider.json",), "validation": ("dev.json",)}
# A ```sql / ```sqlite / ```sqlite3 fence (any case) whose tag ends there: not ```sqlalchemy.
_SQL_BLOCK = re.compile(r"```(?:sqlite3?|sql)(?![^\s`])[ \t]*\n?(.*?)(?:```|\Z)", re.S | re.I)
_ANY_BLOCK = re.compile(r"```[a-zA-Z]*[ \t]*\n(.*?)```", re.S)
_BARE = re.compile(r"^[ \t]*((?:select|with)\b.*?)(?:;|\n[ \t]*\n|\Z)", re.S | re.I | re.M)
_ORDER_BY = re.compile(r"\border\s+by\b", re.I)
ABS_TOL, REL_TOL = 1e-6, 1e-9  # float tolerance of same_result


def load(split: str, source: str | None = None) -> list[Example]:
    """Examples of ``split`` from a BIRD/Spider-style directory (module docstring).

    Returns:
        ``Example(prompt, answer=<gold SQL>, meta={"db_id", "db_path", "question", "ordered"})``.
    """
    if source is None:
        check_split(NAME, split)
        root = DATA_DIR / NAME
    else:
        root = Path(source).expanduser()
        if not root.is_dir():
            raise ValueError(f"{NAME}: source must be a BIRD/Spider-style directory, "
                             f"got {source!r}")
    records = read_split(NAME, root, split, _SPLIT_FILES.get(split, ()))
    examples = []
    for i, record in enumerate(records):
        db_id = field(NAME, record, i, "db_id")
        question = field(NAME, record, i, "question")
        gold = _gold_sql(record, i)
        db_path = find_database(root, db_id, split)
        if db_path is None:
            raise ValueError(f"{NAME} record {i}: field 'db_id': no SQLite file for {db_id!r} "
                             f"under {root}")
        evidence = "" if record.get("evidence") is None else field(NAME, record, i, "evidence")
        examples.append(Example(
            make_prompt(str(db_path), question, evidence), gold,
            {"db_id": db_id, "db_path": str(db_path), "question": question,
             "ordered": is_ordered(gold)}))
    return examples


def _gold_sql(record: dict, index: int) -> str:
    for name in ("SQL", "query", "sql"):  # Spider's "sql" is a parsed dict: skipped
        if isinstance(record.get(name), str):
            return record[name]
    raise ValueError(f"{NAME} record {index}: missing field 'SQL' (or Spider's 'query') "
                     "holding the gold query as text")


def find_database(root: Path, db_id: str, split: str) -> Path | None:
    """The SQLite file of ``db_id`` under a BIRD/Spider-style ``root``, or ``None``."""
    candidates = [root / f"{split}_database" / db_id / f"{db_id}.sqlite",  # Spider's test
                  root / "database" / db_id / f"{db_id}.sqlite",
                  root / f"{split}_databases" / db_id / f"{db_id}.sqlite",
                  root / "dev_databases" / db_id / f"{db_id}.sqlite",
                  root / "train_databases" / db_id / f"{db_id}.sqlite",
                  root / "databases" / f"{db_id}.sqlite",
                  root / db_id / f"{db_id}.sqlite",
                  root / f"{db_id}.sqlite",
                  root / f"{db_id}.db"]
    return next((p.resolve() for p in candidates if p.is_file()), None)


def file_identity(db_path: str) -> tuple[int, int, int, int]:
    """What the caches below key a database on beside its path: device, inode, size and
    modification time of the file. A database rewritten or replaced in place during a run (a
    regenerated sample, a fixed dataset copied over) is read again, never served from the old
    file's cached schema or gold rows. ``ValueError`` when the file is gone."""
    try:
        st = os.stat(db_path)
    except OSError as e:
        raise ValueError(f"{NAME}: database {db_path} cannot be read: {e}") from None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def describe_database(db_path: str, sample_rows: int = SAMPLE_ROWS) -> str:
    """Schema DDL of every table/view plus its first ``sample_rows`` rows, as SQL comments
    (cached per database file, see :func:`file_identity`)."""
    return _describe(db_path, file_identity(db_path), sample_rows)


@functools.lru_cache(maxsize=256)
def _describe(db_path: str, identity: tuple, sample_rows: int) -> str:
    conn = connect_readonly(db_path)
    try:
        objects = conn.execute(
            "SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL "
            "AND name NOT LIKE 'sqlite_%' AND type IN ('table', 'view') ORDER BY rowid").fetchall()
        parts = []
        for kind, name, ddl in objects:
            parts.append(ddl.strip() + ";")
            if kind != "table" or sample_rows <= 0:
                continue
            cursor = conn.execute(f'SELECT * FROM "{name}" LIMIT {int(sample_rows)}')
            header = " | ".join(d[0] for d in cursor.description)
            rows = [" | ".join(_show(v) for v in row) for row in cursor.fetchall()]
            parts.append("\n".join([f"-- first rows of {name}: {header}"]
                                   + [f"--   {r}" for r in rows]))
        return "\n".join(parts)
    finally:
        conn.close()


def _show(value) -> str:
    text = "NULL" if value is None else str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def make_prompt(db_path: str, question: str, evidence: str = "") -> str:
    hint = f"Hint: {evidence.strip()}\n" if evidence.strip() else ""
    return ("You are given a SQLite database with this schema:\n\n"
            f"{describe_database(db_path)}\n\n"
            f"Question: {question.strip()}\n{hint}"
            "Think briefly, then write one SQLite SELECT query that answers the question, "
            "in a ```sql code block.")


def extract_sql(completion: str) -> str | None:
    """The model's query, or ``None`` if the completion has none.

    The last non-empty ```` ```sql ````/``sqlite``/``sqlite3`` block (tag in any case; an
    unclosed final block counts), else the last fenced block of any language, else the last
    bare statement: text from a line-initial ``SELECT``/``WITH`` to ``;``, a blank line or the
    end. Of several bare candidates the last that SQLite parses as one query wins
    (:func:`.sqlsafe.parses_as_query`), so prose such as "With this query we get..." after the
    query does not replace it; if none parses, the last candidate.
    """
    for pattern in (_SQL_BLOCK, _ANY_BLOCK):
        found = [m.strip() for m in pattern.findall(completion) if m.strip()]
        if found:
            return found[-1]
    bare = [m.strip() for m in _BARE.findall(completion) if m.strip()]
    if not bare:
        return None
    return next((sql for sql in reversed(bare) if parses_as_query(sql)), bare[-1])


def is_ordered(sql: str) -> bool:
    """True when the outermost statement of ``sql`` has ``ORDER BY``: one inside a string,
    quoted name, comment or parentheses (a subquery, a CTE, ``OVER (ORDER BY ...)``) does not
    order the result."""
    depth, outer = 0, []
    for kind, text in sql_lexemes(sql):
        if kind in ("comment", "quoted", "space"):
            text = " "
        elif text == "(":
            depth, text = depth + 1, " "
        elif text == ")":
            depth, text = max(depth - 1, 0), " "
        elif depth:
            continue
        outer.append(text)
    return bool(_ORDER_BY.search("".join(outer)))


def reward(completion: str, example: Example, *, partial: float = 0.1, timeout_s: float = 0.5,
           max_rows: int = 10_000) -> float:
    """1.0 if the completion's query returns the gold result set, ``partial`` if it runs but
    differs, 0.0 if there is no query or it is rejected/fails/times out (module docstring).

    ``max_rows`` bounds the rows fetched, raised to the gold result's row count when that is
    larger, and ``timeout_s`` the query's time, raised to ``GOLD_TIME_FACTOR`` times the gold
    query's own (measured when its rows were first computed in this process) when that is
    longer: a correct query is never refused for returning as many rows as the gold one, nor
    for taking about as long.
    ``ValueError`` when the gold query itself fails.
    """
    sql = extract_sql(completion)
    if sql is None:
        return 0.0
    db_path = example.meta["db_path"]
    gold, gold_s = _gold_run(db_path, file_identity(db_path), example.answer)
    try:
        predicted = run_query(db_path, sql, timeout_s=max(timeout_s, GOLD_TIME_FACTOR * gold_s),
                              max_rows=max(int(max_rows), len(gold)))
    except QueryError:
        return 0.0
    ordered = example.meta.get("ordered", is_ordered(example.answer))
    return 1.0 if same_result(predicted, gold, ordered) else partial


def gold_result(db_path: str, gold_sql: str) -> tuple[tuple, ...]:
    """Rows of the gold query, run in the same sandbox with a longer time limit; cached per
    database file (:func:`file_identity`: a file changed in place runs the query again)."""
    return _gold_run(db_path, file_identity(db_path), gold_sql)[0]


@functools.lru_cache(maxsize=4096)
def _gold_run(db_path: str, identity: tuple, gold_sql: str) -> tuple[tuple[tuple, ...], float]:
    """(rows, seconds) of the gold query's first run in this process."""
    start = time.perf_counter()
    try:
        rows = tuple(run_query(db_path, gold_sql, timeout_s=GOLD_TIMEOUT_S, max_rows=1_000_000))
    except QueryError as e:
        raise ValueError(f"{NAME}: gold query failed on {db_path}: {e}\n{gold_sql}") from None
    return rows, time.perf_counter() - start


def same_result(predicted, gold, ordered: bool) -> bool:
    """Result-set equality: as lists when ``ordered``, else as multisets (duplicates count);
    columns by position.

    Values match when equal (``None`` only ``None``; ``1`` equals ``1.0``; ``'1'`` is not
    ``1``), or, when one is a float and the other a number, within
    ``math.isclose(abs_tol=ABS_TOL, rel_tol=REL_TOL)``: 1e-6 absolute, or 1e-9 relative for
    large values (a sum near 1e12 computed in another order); integers compare exactly.
    """
    a, b = [tuple(r) for r in predicted], [tuple(r) for r in gold]
    if len(a) != len(b):
        return False
    if ordered:
        return all(_rows_close(x, y) for x, y in zip(a, b))
    if Counter(a) == Counter(b):
        return True
    groups: dict[tuple, tuple[list, list]] = {}
    for side, rows in enumerate((a, b)):
        for row in rows:
            groups.setdefault(_shape(row), ([], []))[side].append(row)
    return all(_same_multiset(x, y) for x, y in groups.values())


def _same_multiset(a: list[tuple], b: list[tuple]) -> bool:
    """Multiset match of rows with equal non-numeric values: a merge of both sorted by rounded
    floats pairs most rows; rows a rounding boundary put out of step are paired greedily."""
    if len(a) != len(b):
        return False
    a, b = sorted(a, key=_sort_key), sorted(b, key=_sort_key)
    left_a, left_b, i, j = [], [], 0, 0
    while i < len(a) and j < len(b):
        if _rows_close(a[i], b[j]):
            i, j = i + 1, j + 1
        elif _sort_key(a[i]) < _sort_key(b[j]):
            left_a.append(a[i])
            i += 1
        else:
            left_b.append(b[j])
            j += 1
    left_a += a[i:]
    left_b += b[j:]
    for row in left_a:
        k = next((k for k, other in enumerate(left_b) if _rows_close(row, other)), None)
        if k is None:
            return False
        left_b.pop(k)
    return True


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _shape(row: tuple) -> tuple:
    """``row`` with every number replaced by ``float`` (the type): rows that can match share it."""
    return tuple(float if _is_number(v) else v for v in row)


def _sort_key(row: tuple) -> tuple:
    return tuple(round(v, 6) if isinstance(v, float) else v for v in row)


def _rows_close(x: tuple, y: tuple) -> bool:
    return len(x) == len(y) and all(_values_close(u, v) for u, v in zip(x, y))


def _values_close(u, v) -> bool:
    if u == v:
        return True
    return ((isinstance(u, float) or isinstance(v, float)) and _is_number(u) and _is_number(v)
            and math.isclose(u, v, rel_tol=REL_TOL, abs_tol=ABS_TOL))
