"""The inside of :mod:`.sqlsafe`'s sandbox: runs untrusted read-only SQL, one query at a time.

:mod:`.sqlsafe` runs this file as a script in a worker process (``python -I -S sqlworker.py``)
and kills the process when a query outlives its deadline: SQLite's progress handler cannot stop
one long opcode (``instr``, ``LIKE``, ``GLOB``, ``replace`` on long strings), a kill can. So
this module imports the standard library only, never a package-relative module (the worker
starts in tens of milliseconds without polynya, torch or CUDA), and :mod:`.sqlsafe` imports
from it what both processes share: :class:`QueryError`, :func:`connect_readonly` and
:func:`execute` (the read-only connection, authorizer and limits). The worker keeps its last
``KEEP_CONNECTIONS`` connections open while their files are unchanged: the read-only,
query-only, authorizer-guarded connection keeps nothing of one query for the next but its page
cache, and reusing it makes a query cheaper than opening the file each time was in-process.

Protocol, over the worker's stdin/stdout: each message is an 8-byte big-endian length and a
:mod:`marshal` payload. The worker first sends ``READY``; then it answers each request
``(db_path, sql, timeout_s, max_rows, max_value_bytes)`` with ``("ok", rows)`` or
``("error", message)``. EOF on stdin ends it. As a backstop for a parent that died without
killing it, the worker arms ``SIGALRM`` (default action: terminate) for each query at its time
limit plus ``ORPHAN_SLACK_S``.

Memory, capped when the worker starts (``sqlworker.py <address_bytes> <heap_bytes>``, from
:mod:`.sqlsafe`'s ``WORKER_MAX_BYTES`` / ``WORKER_HEAP_BYTES``): SQLite's heap, page caches and
temporary tables included (``temp_store=MEMORY``: a sort or ``UNION`` never spills to a file), by
``sqlite3_hard_heap_limit64`` (past it a query fails with SQLite's out-of-memory error and the
worker goes on); the worker's whole address space by ``RLIMIT_AS``, which stops what SQLite's
heap does not count: the rows fetched into Python (up to ``max_rows`` values of
``max_value_bytes`` each). SQLite lets a
process lower its hard heap limit, never raise it, so the limits are the worker's, not a query's.
"""
from __future__ import annotations

import marshal
import os
import resource
import signal
import sqlite3
import struct
import sys
import time
from pathlib import Path

READY = "sqlworker ready"
ORPHAN_SLACK_S = 1.0  # more than sqlsafe.KILL_GRACE_S: the parent kills first
HEADER = struct.Struct(">Q")
_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
            getattr(sqlite3, "SQLITE_RECURSIVE", 33)}
_DENIED_FUNCTIONS = {"load_extension", "readfile", "writefile", "edit", "fts3_tokenizer"}
MAX_SQL_CHARS = 10_000
PROGRESS_OPCODES = 1000  # progress handler period (SQLite VM instructions)
KEEP_CONNECTIONS = 8
_open: dict[str, tuple[tuple, sqlite3.Connection]] = {}  # db path -> (file identity, connection)


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


def execute(db_path: str, sql: str, timeout_s: float, max_rows: int,
            max_value_bytes: int) -> list[tuple]:
    """Rows of ``sql`` (already checked to be one read statement) under the sandbox's
    connection, authorizer and limits, in this process; :class:`QueryError` on any failure but
    ``MemoryError`` (a memory cap: the worker's loop answers it). The deadline is only SQLite's
    progress handler: one long opcode overruns it."""
    conn = _connection(db_path)
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, max_value_bytes)
    deadline = time.monotonic() + timeout_s
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), PROGRESS_OPCODES)
    cursor = conn.cursor()
    try:
        cursor.execute(sql)
        rows = cursor.fetchmany(max_rows + 1)
    except (sqlite3.Error, sqlite3.Warning, ValueError, OverflowError) as e:
        if time.monotonic() > deadline:
            raise QueryError(f"query exceeded the {timeout_s:g} s time limit") from None
        raise QueryError(f"{type(e).__name__}: {e}") from None
    finally:
        cursor.close()  # ends the statement: nothing of this query outlives it
        conn.set_progress_handler(None, 0)
    if len(rows) > max_rows:
        raise QueryError(f"query returned more than {max_rows} rows")
    return [tuple(row) for row in rows]


MEMORY_ERROR = ("query ran out of memory (the query worker caps SQLite's heap and its own address "
                "space: sqlsafe.WORKER_HEAP_BYTES / WORKER_MAX_BYTES)")


def cap_memory(address_bytes: int, heap_bytes: int) -> None:
    """Cap this process: its address space (``RLIMIT_AS``, never above the hard limit it already
    has) and SQLite's heap (``PRAGMA hard_heap_limit``, process-wide, through a throwaway
    in-memory connection: the sandbox connections' authorizer denies every PRAGMA)."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (address_bytes if hard == resource.RLIM_INFINITY
                                            else min(address_bytes, hard), hard))
    conn = sqlite3.connect(":memory:")
    try:
        got = conn.execute(f"PRAGMA hard_heap_limit={int(heap_bytes)}").fetchone()[0]
    finally:
        conn.close()
    if got != heap_bytes:
        raise RuntimeError(f"SQLite kept a hard heap limit of {got} bytes, not {heap_bytes}")


def _connection(db_path: str) -> sqlite3.Connection:
    """A sandbox connection (read-only, authorizer, no attach) to ``db_path``, reused while the
    file is the same (device, inode, size and mtime): SQLite's ``immutable=1`` assumes it is.
    The ``KEEP_CONNECTIONS`` most recently used stay open."""
    try:
        st = os.stat(db_path)
    except OSError:
        raise QueryError(f"database not found: {Path(db_path).resolve()}") from None
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    cached = _open.pop(db_path, None)
    if cached is not None and cached[0] == key:
        conn = cached[1]
    else:
        if cached is not None:
            cached[1].close()
        conn = connect_readonly(db_path)
        conn.execute("PRAGMA temp_store=MEMORY")  # temporary tables count against the heap limit
        conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, MAX_SQL_CHARS + 2)
        conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        conn.set_authorizer(_authorize)
    _open[db_path] = (key, conn)
    while len(_open) > KEEP_CONNECTIONS:
        _open.pop(next(iter(_open)))[1].close()
    return conn


def write_message(fd: int, obj) -> None:
    """Send ``obj`` (marshal-able) as one message on ``fd``."""
    data = marshal.dumps(obj)
    view = memoryview(HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int) -> bytes | None:
    parts, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _answer(request) -> tuple:
    db_path, sql, timeout_s, max_rows, max_value_bytes = request
    signal.setitimer(signal.ITIMER_REAL, max(timeout_s, 0.0) + ORPHAN_SLACK_S)
    try:
        return ("ok", execute(db_path, sql, timeout_s, max_rows, max_value_bytes))
    except QueryError as e:
        return ("error", str(e))
    except MemoryError:  # SQLite's heap cap, or the fetched rows past the address-space cap
        return ("error", MEMORY_ERROR)
    except Exception as e:  # noqa: BLE001 - e.g. a limit out of range: no request ends the worker
        return ("error", f"{type(e).__name__}: {e}")


def serve(fd_in: int = 0, fd_out: int = 1) -> None:
    """The worker's loop: answer requests from ``fd_in`` on ``fd_out`` until EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the orphan backstop terminates
    write_message(fd_out, READY)
    while True:
        header = _read_exact(fd_in, HEADER.size)
        if header is None:
            return
        payload = _read_exact(fd_in, HEADER.unpack(header)[0])
        if payload is None:
            return
        reply = _answer(marshal.loads(payload))
        try:
            write_message(fd_out, reply)
        except MemoryError:  # the rows fit, their message did not
            write_message(fd_out, ("error", MEMORY_ERROR))
        signal.setitimer(signal.ITIMER_REAL, 0)


if __name__ == "__main__":
    # Protocol on a private copy of stdout; anything else printed goes to stderr.
    out = os.dup(1)
    os.dup2(2, 1)
    cap_memory(int(sys.argv[1]), int(sys.argv[2]))
    serve(0, out)
    sys.exit(0)
