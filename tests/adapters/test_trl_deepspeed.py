"""The TRL adapter under DeepSpeed ZeRO-3 with 2 ranks (accelerate's DeepSpeed integration, gloo on
CPU): the sampler loads whole weights although transformers partitions every model it builds,
log-probs equal TRL's own on every micro-batch, each rank's sampler equals the gathered policy."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("trl")
pytest.importorskip("deepspeed")

from polynya.models import load_model, tiny_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_two_ranks_zero3(tmp_path):
    model_dir = tmp_path / "model"
    load_model("tiny:qwen3", seed=3).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "result"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "tests", "adapters", "trl_deepspeed_worker.py"), str(out), str(model_dir), "3"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=500, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in (0, 1):
        r = json.loads((tmp_path / f"result.rank{rank}").read_text())
        assert r["engine"] == "DeepSpeedEngine" and r["steps"] == 2
        assert len(r["diffs"]) == 2 and max(r["diffs"]) < 1e-5
        assert r["prompts_per_micro_batch"] == [1, 1]  # one whole group per rank and micro-batch
        assert r["checksum_equal"] and r["sampler_requests"] == 2
