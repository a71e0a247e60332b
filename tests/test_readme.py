"""The README's Python snippets (Quickstart, Engines) run exactly as written, and do what the
README says they do."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def snippet(section: str) -> str:
    """The first ```python block under the ``## <section>`` heading."""
    text = README.read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    found = re.search(r"```python\n(.*?)```", text[start:end if end > 0 else None], re.S)
    assert found, f"README section {section!r} has no python snippet"
    return found.group(1)


def test_quickstart_runs_as_written():
    ns: dict = {}
    exec(compile(snippet("Quickstart"), "README:Quickstart", "exec"), ns)
    stats, model, batch = ns["stats"], ns["model"], ns["batch"]
    assert stats.logprobs.shape == (4, 3) and stats.mask.sum() == 8
    naive = ns["polynya"].compute_logprobs(model, batch, zorro=False)
    torch.testing.assert_close(stats.logprobs.detach(), naive.logprobs.detach(), rtol=1e-5, atol=1e-5)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_engines_snippet_runs_as_written():
    ns: dict = {}
    exec(compile(snippet("Engines"), "README:Engines", "exec"), ns)
    assert len(ns["responses"]) == 8 and all(len(r) >= 1 for r in ns["responses"])
    assert math.isfinite(ns["metrics"]["loss"]) and ns["info"]["step"] == 1
    assert ns["sampler"].weight_checksum() == ns["trainer"].weight_checksum()  # the sync landed


@pytest.mark.parametrize("section", ["Quickstart", "Engines"])
def test_snippets_exist(section):
    assert "import" in snippet(section)
