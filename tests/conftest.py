"""Shared test setup: the ``gpu`` marker skips without CUDA; DeepSpeed's C++ ops build into a
stable cache dir so CI pays for them once."""
import os

import pytest
import torch

os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/polynya/torch_extensions"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
