"""Shared pieces of the task modules: the ``Example`` record and the record loaders.

Every task turns its source (bundled sample, local file or directory, or a Hugging Face
dataset id) into a list of plain dict records with :func:`load_records`, validates the fields
it needs with :func:`field`, and builds :class:`Example` objects from them. Mistakes in the
input (unknown split, missing file, malformed record, a source with no records) raise
``ValueError`` naming the file, the record index and the field. :func:`judge` scores a
completion without ever raising; :func:`describe` names an example in messages.
"""
from __future__ import annotations

import json
import math
import re
import textwrap
from dataclasses import dataclass
from dataclasses import field as dc_field
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
BUNDLED_SPLITS = ("train", "test")
_EXTS = (".jsonl", ".json", ".parquet")


@dataclass
class Example:
    """One task instance: the prompt text, the reference answer, task-specific extras.

    ``meta`` holds what a reward needs besides the answer (``db_path`` for SQL, answer aliases
    for QA, the full reference solution for GSM8K).
    """

    prompt: str
    answer: str
    meta: dict = dc_field(default_factory=dict)


def check_split(task: str, split: str, allowed: tuple[str, ...] = BUNDLED_SPLITS) -> None:
    if split not in allowed:
        raise ValueError(f"{task}: unknown split {split!r}; choose one of {list(allowed)}")


def field(task: str, record: Any, index: int, name: str, kind: type | tuple = str) -> Any:
    """``record[name]``, checked to exist and to be of ``kind`` (error names index and field)."""
    if not isinstance(record, dict):
        raise ValueError(f"{task} record {index}: expected an object, got {type(record).__name__}")
    if name not in record or record[name] is None:
        raise ValueError(f"{task} record {index}: missing field {name!r}")
    value = record[name]
    if not isinstance(value, kind):
        want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ValueError(f"{task} record {index}: field {name!r} must be {want}, "
                         f"got {type(value).__name__}")
    return value


def read_records(path: str | Path) -> list[dict]:
    """Records of a ``.jsonl``, ``.json`` (a list, or ``{"data": [...]}``) or ``.parquet`` file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        records = []
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
        return records
    if suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of records")
        return data
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise ValueError(f"{path}: unsupported file type {suffix!r}; use one of {list(_EXTS)}")


def split_files(directory: Path, split: str, names: tuple[str, ...] = ()) -> list[Path]:
    """The file(s) holding ``split`` inside ``directory``: ``<split>.jsonl|json|parquet``, one
    of ``names`` (dataset-specific file names), or every shard of HF-style
    ``[<config>/]<split>-*.parquet`` (``ValueError`` when shards of several configs match, or
    when a ``-NNNNN-of-MMMMM`` shard is missing: either would silently drop or mix rows)."""
    candidates = [directory / f"{split}{ext}" for ext in _EXTS] + [directory / n for n in names]
    for path in candidates:
        if path.is_file():
            return [path]
    for pattern in (f"{split}-*.parquet", f"*/{split}-*.parquet"):
        found = sorted(directory.glob(pattern))
        if found:
            return _one_shard_set(directory, split, found)
    raise ValueError(f"no file for split {split!r} in {directory} "
                     f"(looked for {split}.jsonl/.json/.parquet, {split}-*.parquet"
                     + (f", {', '.join(names)}" if names else "") + ")")


def _one_shard_set(directory: Path, split: str, shards: list[Path]) -> list[Path]:
    folders = sorted({p.parent.name for p in shards})
    if len(folders) > 1:
        raise ValueError(f"split {split!r} has files in several folders of {directory} "
                         f"({', '.join(folders)}): pass the folder of the one you want as source")
    counts = {m.group(1) for p in shards if (m := re.search(r"-of-(\d+)\.parquet$", p.name))}
    for total in counts:
        if len(counts) > 1 or len(shards) != int(total):
            raise ValueError(f"split {split!r} in {shards[0].parent}: {len(shards)} shard file(s) "
                             f"for a split of {int(total)} ({', '.join(p.name for p in shards)}); "
                             "a shard is missing")
    return shards


def read_split(task: str, directory: Path, split: str, names: tuple[str, ...] = ()) -> list[dict]:
    """All records of ``split`` in ``directory`` (:func:`split_files`; every shard, in order);
    ``ValueError`` when there are none."""
    paths = split_files(directory, split, names)
    records = [r for path in paths for r in read_records(path)]
    return _nonempty(task, records, ", ".join(str(p) for p in paths))


def _nonempty(task: str, records: list, where: str) -> list:
    if not records:
        raise ValueError(f"{task}: no records in {where}")
    return records


def looks_like_path(source: str) -> bool:
    return (source.startswith((".", "/", "~")) or source.lower().endswith(_EXTS)
            or Path(source).exists())


def load_hf(source: str, split: str, config: str | None = None) -> list[dict]:
    """Records of an HF dataset: ``datasets.load_dataset(source, config, split=split)``."""
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("loading a Hugging Face dataset needs "
                          "`pip install polynya[recipes]`") from e
    args = (source,) if config is None else (source, config)
    return [dict(r) for r in datasets.load_dataset(*args, split=split)]


def load_records(task: str, split: str, source: str | None, bundled: Path,
                 hf_config: str | None = None, names: tuple[str, ...] = ()) -> list[dict]:
    """Records for ``split`` from the bundled sample, a local file/directory, or an HF id.

    Args:
        source: ``None`` (bundled sample under ``bundled``), a file (used for any split), a
            directory (:func:`split_files`), or an HF dataset id, optionally ``"id:config"``.
        hf_config: the HF config used when ``source`` names none.
    """
    if not isinstance(split, str) or not split:
        raise ValueError(f"{task}: split must be a non-empty string, got {split!r}")
    if source is None:
        check_split(task, split)
        return read_split(task, bundled, split)
    source = str(source)
    if looks_like_path(source):
        path = Path(source).expanduser()
        if path.is_dir():
            return read_split(task, path, split, names)
        return _nonempty(task, read_records(path), str(path))
    name, _, config = source.partition(":")
    return _nonempty(task, load_hf(name, split, config or hf_config),
                     f"split {split!r} of {source!r}")


def describe(example: Example, width: int = 100) -> str:
    """A short quoted excerpt naming ``example`` in messages: its question (``meta["question"]``)
    when it has one, else its prompt."""
    text = example.meta.get("question") if isinstance(example.meta.get("question"), str) else None
    return repr(textwrap.shorten(text or example.prompt, width, placeholder=" ..."))


def judge(task, text: str, example: Example, reward_kwargs: dict) -> tuple[float, str | None]:
    """``(reward, None)``, or ``(0.0, why)`` when the task's reward raised or was not finite:
    one completion that cannot be judged must never end a run (callers count the failures)."""
    try:
        r = float(task.reward(text, example, **reward_kwargs))
    except Exception as exc:  # noqa: BLE001 - any failure to judge scores 0
        return 0.0, f"{type(exc).__name__}: {exc}"
    return (r, None) if math.isfinite(r) else (0.0, f"reward {r} is not finite")
