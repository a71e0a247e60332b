"""The one test command: the whole CPU suite, adapters included.

    .venv/bin/python tests/run.py            # what README and .ci/run call
    .venv/bin/python tests/run.py -k zorro   # extra arguments go to every pytest run

1. The main suite runs in the interpreter that runs this script (the project's ``.venv``).
2. Each framework whose pins clash with polynya's (or with another framework's) has a folder
   ``tests/envs/<name>/`` with an idempotent ``setup.sh`` that creates ``.venvs/<name>`` from the
   project's own files, and a ``paths`` file listing the test paths to run there. Its tests then
   run in that environment. The set-ups (mostly downloads) run one after another in the
   background while the main suite runs; their output is printed after it. ``setup.sh`` exits
   0 when the environment is ready, 3 (after printing why) when this machine cannot host it
   (counted as skipped, the reason shown); anything else is a failure.

Each run writes JUnit XML; the last line adds them up as ``total: N passed, N failed, N skipped``.
Exit status is non-zero when any run failed or errored or a set-up failed.
"""
import concurrent.futures
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENVS = ROOT / "tests" / "envs"
REPORTS = ROOT / ".pytest_reports"
SKIP_ENV = 3


def _pytest(python: str, name: str, paths: list[str], extra: list[str]) -> dict:
    report = REPORTS / f"{name}.xml"
    report.unlink(missing_ok=True)
    cmd = [python, "-m", "pytest", "-q", f"--junitxml={report}", *paths, *extra]
    print(f"\n=== {name}: {' '.join(cmd)}", flush=True)
    rc = subprocess.call(cmd, cwd=ROOT)
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    if report.exists():
        for suite in ET.parse(report).getroot().iter("testsuite"):
            tests, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
            bad = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            counts["passed"] += tests - skipped - bad
            counts["failed"] += bad
            counts["skipped"] += skipped
    if rc not in (0, 5) and counts["failed"] == 0:
        counts["failed"] += 1  # pytest itself failed (collection error, crash): never silent
        print(f"=== {name}: pytest exited {rc}", flush=True)
    return counts


def _framework_envs() -> list[Path]:
    return sorted(p for p in ENVS.iterdir() if (p / "setup.sh").exists()) if ENVS.exists() else []


def _setups_in_background(envs: list[Path]) -> dict[Path, concurrent.futures.Future]:
    """Run the environments' ``setup.sh`` one after another (each installs polynya from this
    tree: two at once would race on its build files) on a background thread, each one's
    output to a log file; returns each one's future exit status."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="env-setup")

    def setup(env: Path) -> int:
        with open(REPORTS / f"setup-{env.name}.log", "wb") as out:
            return subprocess.call(["bash", str(env / "setup.sh")], cwd=ROOT, stdout=out,
                                   stderr=subprocess.STDOUT)

    futures = {env: pool.submit(setup, env) for env in envs}
    pool.shutdown(wait=False)
    return futures


def _setup_status(env: Path, future: concurrent.futures.Future) -> int:
    """Wait for ``env``'s background set-up; print its output; return its exit status."""
    rc = future.result()
    print(f"\n=== {env.name} set-up (ran during the main suite), exit {rc}:", flush=True)
    sys.stdout.write((REPORTS / f"setup-{env.name}.log").read_text(errors="replace"))
    sys.stdout.flush()
    return rc


def main(extra: list[str]) -> int:
    REPORTS.mkdir(exist_ok=True)
    envs = _framework_envs()
    env_paths = [line for e in envs for line in (e / "paths").read_text().split()]
    ignore = [f"--ignore={p}" for p in env_paths]
    setups = _setups_in_background(envs)  # their downloads overlap the main suite
    totals = _pytest(sys.executable, "main", ["tests", *ignore], extra)
    notes = []
    for env in envs:
        rc = _setup_status(env, setups[env])
        if rc == SKIP_ENV:
            notes.append(f"{env.name}: environment not available here (see set-up output)")
            totals["skipped"] += 1
            continue
        if rc != 0:
            notes.append(f"{env.name}: set-up failed with exit {rc}")
            totals["failed"] += 1
            continue
        python = str(ROOT / ".venvs" / env.name / "bin" / "python")
        counts = _pytest(python, env.name, (env / "paths").read_text().split(), extra)
        for k in totals:
            totals[k] += counts[k]
    for note in notes:
        print(f"=== {note}")
    print(f"total: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped")
    return 1 if totals["failed"] else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
