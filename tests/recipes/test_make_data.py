"""The bundled sample data is exactly what ``make_data`` generates, and small."""
import sqlite3
from pathlib import Path

from polynya.recipes.tasks import make_data
from polynya.recipes.tasks.common import DATA_DIR


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
