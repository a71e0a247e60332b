"""The SQL sandbox's worker process: a hard wall-clock deadline whatever the SQL does, a restart
after each kill, no process left behind, and the same rows as SQLite run in-process."""
import ast
import gc
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from polynya.recipes.tasks import sqlsafe, sqlworker, txt2sql
from polynya.recipes.tasks.common import DATA_DIR

SCHOOL = DATA_DIR / "txt2sql" / "database" / "school" / "school.sqlite"
# One SQL function call is one VM opcode: SQLite's progress handler cannot stop it (audit).
INSTR = "SELECT instr(printf('%.*c', 999000, 'a'), printf('%.*c', 500000, 'a') || 'b')"
INSTR_ROWS = ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c LIMIT 3) "
              "SELECT instr(printf('%.*c', 999000 - x, 'a'), printf('%.*c', 500000, 'a') || 'b') "
              "FROM c")


def _children() -> set[int]:
    """Processes whose parent is this one (zombies included: a child never reaped)."""
    me, kids = str(os.getpid()), set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:
            kids.add(int(stat.parent.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_until(condition, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def _reference(db, sql: str) -> list[tuple]:
    """The rows SQLite gives in this process, on a plain read-only connection."""
    conn = sqlite3.connect(Path(db).resolve().as_uri() + "?mode=ro", uri=True)
    try:
        return [tuple(r) for r in conn.execute(sqlsafe.single_statement(sql)).fetchall()]
    finally:
        conn.close()


def _gold_pairs() -> list[tuple[str, str]]:
    return [(e.meta["db_path"], e.answer) for split in ("train", "test")
            for e in txt2sql.load(split)]


@pytest.mark.parametrize("sql", [INSTR, INSTR_ROWS], ids=["instr", "instr-3-rows"])
def test_one_long_opcode_is_killed_at_the_deadline_and_the_worker_restarts(sql):
    before = _children()
    sqlsafe.run_query(SCHOOL, "SELECT 1")
    old = sqlsafe._worker().proc.pid
    timeout = 0.5
    start = time.monotonic()
    with pytest.raises(sqlsafe.QueryError, match="0.5 s time limit"):
        sqlsafe.run_query(SCHOOL, sql, timeout_s=timeout)
    elapsed = time.monotonic() - start
    assert elapsed < timeout + 2.0               # in-process: 5.6 s and 18.8 s (audit)
    assert old not in _children()                # killed and reaped, not a zombie
    db, gold = _gold_pairs()[0]
    assert sqlsafe.run_query(db, gold) == _reference(db, gold)
    new = sqlsafe._worker().proc.pid
    assert new != old and _alive(new)
    assert _children() - before <= {new}


def test_progress_handler_still_stops_slow_loops_without_a_kill():
    sqlsafe.run_query(SCHOOL, "SELECT 1")
    pid = sqlsafe._worker().proc.pid
    with pytest.raises(sqlsafe.QueryError, match="time limit"):
        sqlsafe.run_query(SCHOOL, "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 "
                                  "FROM c) SELECT max(x) FROM c", timeout_s=0.2)
    assert sqlsafe._worker().proc.pid == pid


def test_bundled_gold_queries_give_the_in_process_rows():
    pairs = _gold_pairs()
    assert len(pairs) >= 20
    for db, sql in pairs + pairs:  # twice: the second time on the worker's open connections
        assert sqlsafe.run_query(db, sql, timeout_s=txt2sql.GOLD_TIMEOUT_S) == _reference(db, sql)


def test_random_values_round_trip_exactly(tmp_path):
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    db = tmp_path / "values.sqlite"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE v (i INTEGER, f REAL, t TEXT, b BLOB, n)")
    for _ in range(rng.randint(50, 300)):
        conn.execute("INSERT INTO v VALUES (?, ?, ?, ?, ?)", (
            rng.randint(-2**63, 2**63 - 1), rng.uniform(-1e300, 1e300),
            "".join(chr(rng.choice([rng.randint(32, 126), rng.randint(0xA0, 0xD7FF),
                                    rng.randint(0x10000, 0x10FFFF)]))
                    for _ in range(rng.randint(0, 40))),
            rng.randbytes(rng.randint(0, 64)), rng.choice([None, 1, 2.5, "x", b"\x00"])))
    conn.commit()
    conn.close()
    for sql in ("SELECT * FROM v", "SELECT t, count(*), sum(f) FROM v GROUP BY t ORDER BY t",
                "SELECT i % 7, avg(i), group_concat(t, '|') FROM v GROUP BY 1",
                "VALUES (NULL, -0.0, 1e308, x'00ff', 'é')"):
        assert sqlsafe.run_query(db, sql) == _reference(db, sql), f"seed {seed}: {sql}"


def test_a_replaced_database_file_is_read_again(tmp_path):
    db = tmp_path / "t.sqlite"
    for rows in ([(1,)], [(2,), (3,)]):
        new = tmp_path / "new.sqlite"
        conn = sqlite3.connect(new)
        conn.execute("CREATE TABLE t (x)")
        conn.executemany("INSERT INTO t VALUES (?)", rows)
        conn.commit()
        conn.close()
        os.replace(new, db)
        assert sqlsafe.run_query(db, "SELECT x FROM t ORDER BY x") == rows
    db.unlink()
    with pytest.raises(sqlsafe.QueryError, match="database not found"):
        sqlsafe.run_query(db, "SELECT 1")


def test_each_thread_has_a_worker_that_ends_with_the_thread():
    before = _children()
    pairs = _gold_pairs()
    pids, errors = [], []

    def work(k: int) -> None:
        try:
            if k == 0:
                with pytest.raises(sqlsafe.QueryError, match="time limit"):
                    sqlsafe.run_query(SCHOOL, INSTR, timeout_s=0.3)
            for db, sql in pairs[k::4]:
                assert sqlsafe.run_query(db, sql) == _reference(db, sql)
            pids.append(sqlsafe._worker().proc.pid)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(set(pids)) == 4
    gc.collect()
    assert _wait_until(lambda: not (_children() - before) & set(pids), 5.0)


def test_a_forked_child_starts_its_own_worker_and_leaves_the_parents_alone():
    sqlsafe.run_query(SCHOOL, "SELECT 1")
    parent_worker = sqlsafe._worker().proc.pid
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report its worker's pid, then die without any cleanup
        code = 1
        try:
            rows = sqlsafe.run_query(SCHOOL, "SELECT count(*) FROM students")
            os.write(write, f"{sqlsafe._worker().proc.pid} {rows[0][0]}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    assert os.waitpid(pid, 0)[1] == 0
    child_worker, count = map(int, os.read(read, 100).split())
    os.close(read)
    assert child_worker != parent_worker and count == len(_reference(SCHOOL,
                                                                      "SELECT * FROM students"))
    assert _wait_until(lambda: not _alive(child_worker), 5.0)  # EOF on its stdin ends it
    assert sqlsafe._worker().proc.pid == parent_worker
    assert sqlsafe.run_query(SCHOOL, "SELECT 1") == [(1,)]


def test_a_worker_nobody_kills_ends_by_its_own_alarm():
    """The backstop for a parent that died mid-query: the worker's alarm, not the parent."""
    worker = sqlsafe._Worker()
    try:
        worker.send((str(SCHOOL), INSTR_ROWS, 0.3, 10, 1_000_000))
        worker.proc.stdin.close()
        start = time.monotonic()
        assert worker.proc.wait(timeout=0.3 + sqlworker.ORPHAN_SLACK_S + 2.0) == -signal.SIGALRM
        assert time.monotonic() - start < 0.3 + sqlworker.ORPHAN_SLACK_S + 2.0
    finally:
        worker.stop()


def test_interpreter_exit_leaves_no_worker(tmp_path):
    script = ("import threading\n"
              "from polynya.recipes.tasks import sqlsafe\n"
              f"db = {str(SCHOOL)!r}\n"
              "pids = []\n"
              "def use():\n"
              "    sqlsafe.run_query(db, 'SELECT 1')\n"
              "    pids.append(sqlsafe._worker().proc.pid)\n"
              "t = threading.Thread(target=use, daemon=True)\n"
              "t.start(); t.join(); use()\n"
              "print(*pids)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    pids = [int(p) for p in out.split()]
    assert len(pids) == 2
    assert _wait_until(lambda: not any(_alive(p) for p in pids), 5.0)


def test_bad_timeouts_and_limits():
    with pytest.raises(ValueError, match="finite"):
        sqlsafe.run_query(SCHOOL, "SELECT 1", timeout_s=float("inf"))
    with pytest.raises(sqlsafe.QueryError):
        sqlsafe.run_query(SCHOOL, "SELECT 1", max_value_bytes=2**40)
    with pytest.raises(sqlsafe.QueryError, match="string or blob too big"):
        sqlsafe.run_query(SCHOOL, "SELECT zeroblob(2000)", max_value_bytes=1000)
    assert sqlsafe.run_query(SCHOOL, "SELECT length(zeroblob(2000))") == [(2000,)]


def test_worker_script_imports_only_the_standard_library():
    """It runs as ``python -I -S``: no polynya, torch or site-packages."""
    tree = ast.parse(Path(sqlworker.__file__).read_text())
    imports = {alias.name.split(".")[0] for node in ast.walk(tree)
               if isinstance(node, ast.Import) for alias in node.names}
    imports |= {node.module.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and not node.level}
    assert not any(isinstance(node, ast.ImportFrom) and node.level for node in ast.walk(tree))
    assert imports <= set(sys.stdlib_module_names) | {"__future__"}, imports


def _in_new_thread(fn):
    """``fn()`` in a thread of its own: its own worker, started with the limits set now."""
    out = []
    t = threading.Thread(target=lambda: out.append(_outcome(fn)))
    t.start()
    t.join()
    return out[0]


def _outcome(fn):
    try:
        return fn()
    except BaseException as e:  # noqa: BLE001 - returned to the test's thread
        return e


# Memory-hungry SQL that the time limit alone lets run for seconds (audit, 2026-12-07): a UNION
# recursion keeps every row in a temporary index; a sort of millions of rows; 1 MB blobs fetched
# by the thousand (SQLite holds one at a time, the fetched rows hold them all).
UNION_ROWS = ("WITH RECURSIVE c(x) AS (SELECT 1 UNION SELECT x + 1 FROM c WHERE x < 50000000) "
              "SELECT count(*) FROM c")
BIG_SORT = ("SELECT count(*) FROM (SELECT x FROM (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL "
            "SELECT x + 1 FROM c WHERE x < 3000000) SELECT x FROM c) ORDER BY random())")
BLOBS = ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 1000) "
         "SELECT zeroblob(900000) FROM c")


@pytest.mark.parametrize("sql", [UNION_ROWS, BIG_SORT], ids=["union", "sort"])
def test_sqlite_memory_is_capped_and_the_worker_goes_on(monkeypatch, sql):
    """SQLite's heap (temporary tables kept in memory, not spilled to a file) stops the query
    with a clear error; the same worker answers the next query exactly."""
    monkeypatch.setattr(sqlsafe, "WORKER_HEAP_BYTES", 16 << 20)

    def run():
        pid = sqlsafe._worker().proc.pid
        start = time.monotonic()
        with pytest.raises(sqlsafe.QueryError, match="ran out of memory"):
            sqlsafe.run_query(SCHOOL, sql, timeout_s=30)
        elapsed = time.monotonic() - start
        db, gold = _gold_pairs()[1]
        assert sqlsafe.run_query(db, gold) == _reference(db, gold)
        return elapsed, pid, sqlsafe._worker().proc.pid

    got = _in_new_thread(run)
    assert not isinstance(got, BaseException), got
    elapsed, pid, after = got
    assert pid == after and elapsed < 10  # stopped by the cap, long before the 30 s limit
    # the default cap lets an ordinary large sort through
    assert sqlsafe.run_query(SCHOOL, BIG_SORT.replace("3000000", "100000"), timeout_s=30) == [(100000,)]


def test_fetched_rows_are_capped_by_the_worker_address_space(monkeypatch):
    """~900 MB of rows that SQLite hands over one at a time: the worker's RLIMIT_AS stops them,
    the error names the limits, and the worker answers the next query."""
    monkeypatch.setattr(sqlsafe, "WORKER_MAX_BYTES", 512 << 20)

    def run():
        with pytest.raises(sqlsafe.QueryError, match="ran out of memory.*WORKER_MAX_BYTES"):
            sqlsafe.run_query(SCHOOL, BLOBS, timeout_s=30, max_rows=10_000)
        assert sqlsafe.run_query(SCHOOL, "SELECT length(zeroblob(900000))") == [(900000,)]
        limit = Path(f"/proc/{sqlsafe._worker().proc.pid}/limits").read_text()
        return next(line for line in limit.splitlines() if line.startswith("Max address space"))

    got = _in_new_thread(run)
    assert not isinstance(got, BaseException), got
    assert str(512 << 20) in got
    assert len(sqlsafe.run_query(SCHOOL, BLOBS.replace("1000", "20"), timeout_s=30)) == 20
