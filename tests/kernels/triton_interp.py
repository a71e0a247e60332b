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
