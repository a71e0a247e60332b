"""polynya's plugin is loaded by verl's own ``verl.plugins`` entry-point loop (``import verl``),
registers its three backends, and warns loudly when it cannot (verl itself logs at DEBUG)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = r"""
import json, sys
{prelude}
import verl
from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.workers.engine import EngineRegistry
from verl.workers.rollout.base import get_rollout_class
from verl.workers.rollout.replica import RolloutReplicaRegistry
engines = EngineRegistry._engines.get("language_model", {{}}).get("deepspeed", {{}})
out = {{
    "plugin_loaded": "polynya.adapters.verl.plugin" in sys.modules,
    "engines": {{d: f"{{c.__module__}}.{{c.__name__}}" for d, c in engines.items()}},
    "replica": "polynya" in RolloutReplicaRegistry._registry,
    "checkpoint": "polynya" in CheckpointEngineRegistry._registry,
}}
if out["replica"]:
    r = RolloutReplicaRegistry.get("polynya")
    a = get_rollout_class("polynya", "async")
    c = CheckpointEngineRegistry.get("polynya")
    out["classes"] = [f"{{k.__module__}}.{{k.__name__}}" for k in (r, a, c)]
print("RESULT" + json.dumps(out))
"""


def probe(prelude: str = "", **env) -> tuple[dict, str]:
    """Import verl in a fresh interpreter; return what its registries hold and stderr."""
    proc = subprocess.run([sys.executable, "-W", "always", "-c", PROBE.format(prelude=prelude)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT"):]), proc.stderr


def test_import_verl_registers_everything():
    out, err = probe()
    assert out["plugin_loaded"]
    engine = "polynya.adapters.verl.engine.DeepSpeedLMEngine"
    assert out["engines"] == {"cuda": engine, "cpu": engine}
    assert out["replica"] and out["checkpoint"]
    assert out["classes"] == ["polynya.adapters.verl.rollout.PolynyaReplica",
                              "polynya.adapters.verl.rollout.PolynyaServerAdapter",
                              "polynya.adapters.verl.checkpoint.PolynyaCheckpointEngine"]
    assert "PolynyaPluginWarning" not in err


def test_broken_plugin_warns_loudly_and_verl_still_imports():
    # a dependency of the registration that cannot be imported (as after a broken install)
    prelude = "sys.modules['polynya.adapters.verl.engine'] = None"
    out, err = probe(prelude)
    assert out["plugin_loaded"] and out["engines"] == {} and not out["replica"] and not out["checkpoint"]
    assert "PolynyaPluginWarning: polynya's verl plugin failed to load (ModuleNotFoundError" in err
    assert "polynya.adapters.verl.engine" in err  # names the error ...
    assert "pip install 'polynya[verl]'" in err  # ... and the fix


def test_verl_switch_turns_the_plugin_off():
    out, _ = probe(VERL_USE_EXTERNAL_PLUGINS="none")
    assert not out["plugin_loaded"] and out["engines"] == {} and not out["replica"]
