"""Importing polynya (and its light subpackages) never imports a heavy optional dependency, and
sets torch's cuDNN plan-reuse switch unless the user set it."""
import os
import subprocess
import sys

HEAVY = ("deepspeed", "vllm", "ray", "verl", "trl", "skyrl_train", "fastapi", "uvicorn", "hydra")


def test_import_polynya_stays_light():
    code = ("import sys, polynya, polynya.engines, polynya.config, polynya.models, polynya.kernels, "
            "polynya.zorro, polynya.client, polynya.recipes; "
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_missing_extra_names_the_pip_extra(monkeypatch):
    import polynya.engines.sample as sample
    from polynya.config import SamplerConfig

    monkeypatch.setattr(sample.importlib.util, "find_spec", lambda name: None)
    try:
        sample.SamplingEngine(SamplerConfig("tiny:qwen3", dtype="float32", backend="vllm"))
    except ImportError as exc:
        assert "polynya[vllm]" in str(exc)
    else:
        raise AssertionError("vllm backend without vllm must raise ImportError")


def test_import_sets_cudnn_plan_reuse_unless_the_user_chose():
    code = ("import os, polynya; print(os.environ.get('TORCH_CUDNN_SDPA_AVOID_RECOMPILE'))")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CUDNN_SDPA_AVOID_RECOMPILE"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, TORCH_CUDNN_SDPA_AVOID_RECOMPILE="0"),
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"
