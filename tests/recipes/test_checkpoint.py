"""Recipe checkpoints: a manifest written last, verified before a run resumes from one."""
from __future__ import annotations

import json
import os

import pytest

from polynya.files import CheckpointError
from polynya.recipes import checkpoint


class FakeClient:
    """Writes what an engine checkpoint looks like: a binary file under the given directory."""

    def __init__(self, seed: int):
        self.payload = os.urandom(4096) + bytes([seed])

    def save(self, path: str) -> None:
        os.makedirs(path)
        with open(os.path.join(path, "weights.bin"), "wb") as f:
            f.write(self.payload)


def test_resume_only_from_verified_checkpoints(tmp_path):
    out = str(tmp_path)
    first = checkpoint.save(FakeClient(1), out, 2, {"next_step": 2}, keep=3)
    second = checkpoint.save(FakeClient(2), out, 4, {"next_step": 4}, keep=3)
    assert checkpoint.latest(out) == (second, {"next_step": 4})
    os.makedirs(checkpoint.checkpoint_dir(out, 6))  # a save killed before its manifest: ignored
    assert checkpoint.latest(out)[0] == second
    weights = os.path.join(second, "engine", "weights.bin")
    with open(weights, "r+b") as f:  # one byte flipped
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    files_before = sorted(os.listdir(second))
    with pytest.raises(CheckpointError, match="weights.bin.*corrupted"):
        checkpoint.latest(out)
    with pytest.warns(UserWarning, match="skipping checkpoint"):
        assert checkpoint.latest(out, fallback=True) == (first, {"next_step": 2})
    assert sorted(os.listdir(second)) == files_before  # nothing deleted or rewritten
    with open(os.path.join(first, checkpoint.STATE), "w") as f:  # driver state changed
        json.dump({"next_step": 99}, f)
    with pytest.warns(UserWarning, match="driver.json.*bytes"):
        assert checkpoint.latest(out, fallback=True) is None  # no good one left: start fresh
