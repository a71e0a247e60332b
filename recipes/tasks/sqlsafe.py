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
4. limits: at most ``max_rows`` rows fetched, values at most ``max_value_bytes`` long, SQLite's
   memory (temporary tables included) at most ``WORKER_HEAP_BYTES`` and the worker's whole
   address space at most ``WORKER_MAX_BYTES`` (what a query cannot get fails it; the worker goes
   on), and a hard wall-clock deadline: the checked statement runs in a worker process (:mod:`.sqlworker`,
   which opens the connection of layers 1-2 and applies these limits) that is killed when it
   has not answered ``KILL_GRACE_S`` after its time limit.
   Inside, SQLite's progress handler stops most slow queries (a runaway recursive CTE) at the
   limit without a kill; the kill stops what it cannot: one opcode can run for minutes
   (``instr``, ``LIKE``, ``GLOB`` on megabyte strings).

Each thread of each process has its own worker, a plain ``python -I -S sqlworker.py``
subprocess (never a fork of this process, which may hold CUDA threads), started at its first
query (tens of milliseconds, not counted in the time limit) and again after a kill; it keeps
its connections open, so a query costs about what it did in-process.
A worker is killed and reaped when its thread ends and at interpreter exit; one whose parent
died without that ends at EOF on its stdin, or by its own alarm if a query is still running.
A forked child never uses or kills its parent's worker. :class:`RuntimeError` (not
:class:`QueryError`) means the worker itself could not start.

``parses_as_query(sql)`` tells a read statement from prose that merely starts with ``SELECT``
or ``WITH``: SQLite parses it on an empty in-memory database whose authorizer denies every
action, so nothing is ever run.
"""
from __future__ import annotations

import marshal
import math
import os
import re
import select
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

from .sqlworker import HEADER, MAX_SQL_CHARS, READY, QueryError, connect_readonly, write_message

__all__ = ["MAX_SQL_CHARS", "QueryError", "connect_readonly", "parses_as_query", "run_query",
           "single_statement", "sql_lexemes"]
KILL_GRACE_S = 0.25   # a worker silent this long past its query's time limit is killed
START_TIMEOUT_S = 30.0
WORKER_MAX_BYTES = 2 << 30  # address space (RLIMIT_AS) of each worker started from now on; ~30 MB its own
WORKER_HEAP_BYTES = 512 << 20  # SQLite's heap (all its connections) in each worker started from now on
_WORKER_SCRIPT = str(Path(__file__).with_name("sqlworker.py"))
_FIRST_KEYWORD = re.compile(r"\s*(?:(?:--[^\n]*\n|/\*.*?\*/)\s*)*\(*\s*(\w+)", re.S)
# One lexeme per match, named by its kind; whitespace is SQLite's (ASCII); an unterminated quote
# or block comment runs to the end, as in SQLite; each parenthesis is a lexeme of its own.
_LEXEME = re.compile(r"""(?P<space>\s+) | (?P<comment>--[^\n]* | /\*(?:[^*]|\*(?!/))*(?:\*/|\Z))
    | (?P<quoted>'(?:[^']|'')*(?:'|\Z) | "(?:[^"]|"")*(?:"|\Z) | `(?:[^`]|``)*(?:`|\Z)
                 | \[[^\]]*(?:\]|\Z))
    | (?P<semi>;) | (?P<code>[^\s;'"`\[/()-]+ | .)""", re.S | re.X | re.A)


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
        timeout_s: wall-clock limit for preparing, running and fetching; the worker is
            killed if it has not answered ``KILL_GRACE_S`` later.
        max_rows: more rows than this is an error (the result would be useless as a reward).
        max_value_bytes: SQLite's string/blob length limit for this connection.
    Returns:
        the rows as tuples, in the order SQLite returned them.
    Raises:
        QueryError: rejected, failed, timed out, or too many rows.
        RuntimeError: the worker process could not be started.
        ValueError: ``timeout_s`` is not finite.
    """
    if not math.isfinite(timeout_s):
        raise ValueError(f"timeout_s must be finite, got {timeout_s}")
    text = single_statement(sql)
    path = str(Path(db_path).resolve())  # the worker's working directory may differ
    kind, result = _ask((path, text, float(timeout_s), int(max_rows), int(max_value_bytes)),
                        timeout_s)
    if kind != "ok":
        raise QueryError(result)
    return result


_local = threading.local()


class _Worker:
    """One ``sqlworker.py`` process, used by the thread of the process that started it."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        try:
            self.proc = subprocess.Popen([sys.executable, "-I", "-S", _WORKER_SCRIPT, str(int(WORKER_MAX_BYTES)),
                                          str(int(WORKER_HEAP_BYTES))],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        except OSError as e:
            raise RuntimeError(f"sqlsafe: cannot start the query worker: {e}") from e
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.owner)
        try:
            ready = self.receive(time.monotonic() + START_TIMEOUT_S)
        except (EOFError, ValueError):
            ready = None
        if ready != READY:
            self.stop()
            raise RuntimeError(f"sqlsafe: the query worker ({_WORKER_SCRIPT}) did not start")

    def usable(self) -> bool:
        return self.owner == os.getpid() and self.proc.poll() is None

    def stop(self) -> None:
        """Kill and reap the process (only close the pipes in a forked child); idempotent."""
        self._finalizer()

    def send(self, request: tuple) -> None:
        write_message(self.proc.stdin.fileno(), request)

    def receive(self, deadline: float):
        """The next message, ``None`` if it is not complete by ``deadline`` (``monotonic``);
        :class:`EOFError` if the process closed its end first."""
        data = _read_message(self.proc.stdout.fileno(), deadline)
        return None if data is None else marshal.loads(data)


def _stop(proc: subprocess.Popen, owner: int) -> None:
    if os.getpid() == owner:
        proc.kill()
        proc.wait()
    proc.stdin.close()
    proc.stdout.close()


def _read_message(fd: int, deadline: float) -> bytes | None:
    """One message's payload from ``fd``. One request is in flight at a time, so every byte
    that arrives belongs to this message: read whatever is there, usually all in one go."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    data, size = bytearray(), None
    while size is None or len(data) < size:
        wait = deadline - time.monotonic()
        if wait <= 0:
            return None
        if not poller.poll(min(wait, 3600.0) * 1000):
            continue
        chunk = os.read(fd, 1 << 20 if size is None else min(size - len(data), 1 << 24))
        if not chunk:
            raise EOFError
        data += chunk
        if size is None and len(data) >= HEADER.size:
            size = HEADER.size + HEADER.unpack_from(data)[0]
    return bytes(memoryview(data)[HEADER.size:])


def _worker(restart: bool = False) -> _Worker:
    """This thread's worker, started if it has none, or if it died, was killed or belongs to
    the process this one was forked from."""
    worker = getattr(_local, "worker", None)
    if worker is not None and (restart or not worker.usable()):
        worker.stop()
        worker = None
    if worker is None:
        worker = _local.worker = _Worker()
    return worker


def _ask(request: tuple, timeout_s: float) -> tuple:
    """The worker's reply to ``request``; the worker is killed (and restarted by the next
    query) when it has not answered ``KILL_GRACE_S`` after ``timeout_s``."""
    worker = _worker()
    try:
        worker.send(request)
    except OSError:  # it died while idle: the query never reached it
        worker = _worker(restart=True)
        worker.send(request)
    deadline = time.monotonic() + timeout_s + KILL_GRACE_S
    try:
        reply = worker.receive(deadline)
    except EOFError:  # it crashed, or its own alarm (the orphan backstop) ended it
        if worker.proc.wait() == -signal.SIGALRM:
            raise QueryError(f"query exceeded the {timeout_s:g} s time limit") from None
        raise QueryError(f"the query process died (exit status {worker.proc.returncode})") from None
    except BaseException:  # e.g. KeyboardInterrupt: its late answer must not reach the next query
        worker.stop()
        raise
    if reply is None:
        worker.stop()
        raise QueryError(f"query exceeded the {timeout_s:g} s time limit")
    return reply
