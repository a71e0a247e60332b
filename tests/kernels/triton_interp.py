"""Run a kernel test module's ``interp`` cases in a child process under ``TRITON_INTERPRET=1``
(the interpreter must be chosen before Triton kernels are defined, so never in-process)."""
import os
import subprocess
import sys


def run_under_interpreter(test_file: str, timeout: int = 240) -> None:
    """``python <test_file> interp`` must exit 0 and print ``INTERP OK``."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, test_file, "interp"], env=env, capture_output=True,
                         check=False, text=True, timeout=timeout)
    assert res.returncode == 0 and "INTERP OK" in res.stdout, res.stdout + res.stderr[-4000:]


def check_under_interpreter(test_file: str) -> None:
    """The body of a module's ``test_kernel_under_interpreter``: skipped without Triton and on
    a GPU (the compiled kernels are checked by the module's ``gpu`` test there)."""
    import pytest
    import torch

    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("on a GPU the compiled kernels are checked by the gpu-marked test")
    run_under_interpreter(test_file)


def digest_kernels_on_cpu(block: int = 64, rblock: int = 4) -> None:
    """In the interpreter child: the digest kernels for CPU tensors too, with ``block`` 64-bit
    words per program (many blocks per tensor at interpreter sizes) and ``rblock`` partials per
    iteration of the per-tensor sum (several iterations)."""
    from polynya.kernels.digest import op

    op.KERNEL_ON_CPU = True
    op.BLOCK = block
    op.RBLOCK = rblock
