"""Run untrusted SQL (model output) against a SQLite file without letting it change anything.

``run_query(db_path, sql)`` returns the result rows or raises :class:`QueryError`. The layers:

1. the file is opened read-only through a URI (``file:...?mode=ro&immutable=1``): SQLite never
   writes to it, takes no locks and creates no journal/WAL/SHM files next to it;
2. ``PRAGMA query_only=ON`` and an authorizer that allows only ``SELECT``, reading columns,
   recursive CTEs and ordinary SQL functions: every write, ``CREATE``/``DROP`` (temp objects
   included), ``ATTACH``/``DETACH``, ``PRAGMA``, transactions and ``load_extension`` are denied
   when the statement is prepared, before it runs; the connection may attach no database
   (``SQLITE_LIMIT_ATTACHED=0``, which also stops ``VACUUM INTO``);
3. extension loading stays disabled; the statement must be a single ``SELECT``/``WITH``/
   ``VALUES`` statement of at most ``MAX_SQL_CHARS`` characters: after its first ``;`` (found
   by :func:`sql_lexemes`, which skips quotes and comments) only comments, whitespace and
   further ``;`` may follow, and that tail is dropped, never run; the statement itself must
   also be complete by ``sqlite3.complete_statement`` with no complete statement ending
   inside it (SQLite's own tokenizer, as a cross-check);
4. limits: a wall-clock deadline checked by a progress handler (stops runaway recursive CTEs),
   at most ``max_rows`` rows fetched, and values at most ``max_value_bytes`` long.

``parses_as_query(sql)`` tells a read statement from prose that merely starts with ``SELECT``
or ``WITH``: SQLite parses it on an empty in-memory database whose authorizer denies every
action, so nothing is ever run.
"""
from __future__ import annotations

import re
import sqlite3
import time
from pathlib import Path

_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
            getattr(sqlite3, "SQLITE_RECURSIVE", 33)}
_DENIED_FUNCTIONS = {"load_extension", "readfile", "writefile", "edit", "fts3_tokenizer"}
MAX_SQL_CHARS = 10_000
_FIRST_KEYWORD = re.compile(r"\s*(?:(?:--[^\n]*\n|/\*.*?\*/)\s*)*\(*\s*(\w+)", re.S)
# One lexeme per match, named by its kind; whitespace is SQLite's (ASCII); an unterminated quote
# or block comment runs to the end, as in SQLite; each parenthesis is a lexeme of its own.
_LEXEME = re.compile(r"""(?P<space>\s+) | (?P<comment>--[^\n]* | /\*(?:[^*]|\*(?!/))*(?:\*/|\Z))
    | (?P<quoted>'(?:[^']|'')*(?:'|\Z) | "(?:[^"]|"")*(?:"|\Z) | `(?:[^`]|``)*(?:`|\Z)
                 | \[[^\]]*(?:\]|\Z))
    | (?P<semi>;) | (?P<code>[^\s;'"`\[/()-]+ | .)""", re.S | re.X | re.A)


class QueryError(Exception):
    """The query was rejected, failed, ran too long or returned too many rows."""


def _authorize(action: int, arg1, arg2, db_name, trigger) -> int:
    if action not in _ALLOWED:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_FUNCTION and str(arg2).lower() in _DENIED_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


def connect_readonly(db_path: str | Path) -> sqlite3.Connection:
    """A read-only, query-only connection to an existing SQLite file (no authorizer yet)."""
    path = Path(db_path).resolve()
    if not path.is_file():
        raise QueryError(f"database not found: {path}")
    conn = sqlite3.connect(path.as_uri() + "?mode=ro&immutable=1", uri=True,
                           isolation_level=None)
    if hasattr(conn, "enable_load_extension"):
        conn.enable_load_extension(False)
    conn.execute("PRAGMA query_only=ON")
    return conn


def sql_lexemes(sql: str) -> list[tuple[str, str]]:
    """``sql`` split into ``(kind, text)`` pieces that join back to ``sql``; ``kind`` is
    ``"space"``, ``"comment"`` (``--`` or ``/* */``), ``"quoted"`` (a ``'string'`` or a
    ``"``/`` ` ``/``[]``-quoted identifier), ``";"`` or ``"code"`` (anything else; each
    parenthesis is a piece of its own). An unterminated quote or comment runs to the end."""
    return [(";" if m.lastgroup == "semi" else m.lastgroup, m.group())
            for m in _LEXEME.finditer(sql)]


def single_statement(sql: str) -> str:
    """The one read statement (``SELECT``, ``WITH`` or ``VALUES``) in ``sql``, without the
    ``;``, comments and whitespace that may trail it; :class:`QueryError` for anything else
    (a second statement, a write, an unterminated quote or comment, ...)."""
    if len(sql) > MAX_SQL_CHARS:
        raise QueryError(f"query longer than {MAX_SQL_CHARS} characters")
    if "\x00" in sql:  # sqlite3.complete_statement raises ValueError on it
        raise QueryError("query contains a NUL character")
    lexemes = sql_lexemes(sql)
    end = next((i for i, (kind, _) in enumerate(lexemes) if kind == ";"), len(lexemes))
    if any(kind not in ("space", "comment", ";") for kind, _ in lexemes[end:]):
        raise QueryError("only a single SQL statement is allowed")
    body = [i for i, (kind, _) in enumerate(lexemes[:end]) if kind in ("code", "quoted")]
    if not body:
        raise QueryError("empty query")
    text = "".join(t for _, t in lexemes[: body[-1] + 1]).strip()
    if not sqlite3.complete_statement(text + "\n;") or _has_second_statement(text):
        raise QueryError("only a single SQL statement is allowed")
    first = _FIRST_KEYWORD.match(text)
    if first is None or first.group(1).lower() not in ("select", "with", "values"):
        raise QueryError("only SELECT queries are allowed")
    return text


def _has_second_statement(text: str) -> bool:
    """True when some ``;`` ends a statement before the end of ``text`` by SQLite's own
    tokenizer (``sqlite3.complete_statement``)."""
    for i, ch in enumerate(text):
        if ch == ";" and sqlite3.complete_statement(text[: i + 1]):
            return True
    return False


def parses_as_query(sql: str) -> bool:
    """True when ``sql`` passes :func:`single_statement` and SQLite's parser accepts it (names
    are not resolved: it is parsed on an empty in-memory database whose authorizer denies
    every action, which stops it before anything runs)."""
    try:
        text = single_statement(sql)
    except QueryError:
        return False
    conn = sqlite3.connect(":memory:")
    try:
        conn.set_authorizer(lambda *args: sqlite3.SQLITE_DENY)
        conn.execute(text)
    except sqlite3.Error as e:  # a parsed statement is stopped by the authorizer: SQLITE_AUTH
        return getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_AUTH
    finally:
        conn.close()
    return False  # unreachable: a SELECT is always checked against the authorizer


def run_query(db_path: str | Path, sql: str, *, timeout_s: float = 0.5, max_rows: int = 10_000,
              max_value_bytes: int = 1_000_000) -> list[tuple]:
    """Rows of one untrusted read-only query.

    Args:
        db_path: an existing SQLite file (never modified).
        sql: one SELECT/WITH/VALUES statement.
        timeout_s: wall-clock limit for preparing, running and fetching.
        max_rows: more rows than this is an error (the result would be useless as a reward).
        max_value_bytes: SQLite's string/blob length limit for this connection.
    Returns:
        the rows as tuples, in the order SQLite returned them.
    Raises:
        QueryError: rejected, failed, timed out, or too many rows.
    """
    text = single_statement(sql)
    conn = connect_readonly(db_path)
    try:
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, max_value_bytes)
        conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, MAX_SQL_CHARS + 2)
        conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        conn.set_authorizer(_authorize)
        deadline = time.monotonic() + timeout_s
        conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 1000)
        try:
            cursor = conn.execute(text)
            rows = cursor.fetchmany(max_rows + 1)
        except (sqlite3.Error, sqlite3.Warning, ValueError, OverflowError, MemoryError) as e:
            if time.monotonic() > deadline:
                raise QueryError(f"query exceeded the {timeout_s:g} s time limit") from None
            raise QueryError(f"{type(e).__name__}: {e}") from None
        if len(rows) > max_rows:
            raise QueryError(f"query returned more than {max_rows} rows")
        return [tuple(row) for row in rows]
    finally:
        conn.close()
