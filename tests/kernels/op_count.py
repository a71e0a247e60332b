"""``OpCount``: a ``TorchDispatchMode`` counting the aten ops run inside it (what a host-bound
path costs: each op is a Python -> C++ -> kernel dispatch)."""
from torch.utils._python_dispatch import TorchDispatchMode


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))
