"""Importing polynya (and its light subpackages) never imports a heavy optional dependency."""
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
