"""polynya's plugin is loaded by verl's own ``verl.plugins`` entry-point loop (``import verl``),
registers its three backends, and warns loudly when it cannot (verl itself logs at DEBUG)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

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


BROKEN = "sys.modules['polynya.adapters.verl.engine'] = None"  # as after a broken install
FIRST = "import polynya.adapters.verl.engine"  # our module imports verl, whose plugin loop comes back
CASES = {"plain": ("", {}), "broken": (BROKEN, {}), "off": ("", {"VERL_USE_EXTERNAL_PLUGINS": "none"}),
         "engine_first": (FIRST, {}), "engine_first_off": (FIRST, {"VERL_USE_EXTERNAL_PLUGINS": "none"})}


@pytest.fixture(scope="module")
def probes() -> dict[str, tuple[dict, str]]:
    """Import verl in three fresh interpreters at once; per case what its registries hold, and stderr."""
    procs = {name: subprocess.Popen([sys.executable, "-W", "always", "-c", PROBE.format(prelude=prelude)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env={**os.environ, **env})
             for name, (prelude, env) in CASES.items()}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        line = next(x for x in stdout.splitlines() if x.startswith("RESULT"))
        out[name] = json.loads(line[len("RESULT"):]), stderr
    return out


@pytest.mark.parametrize("case", ["plain", "engine_first"])
def test_import_verl_registers_everything(probes, case):
    """Also when one of our modules is imported before verl (verl's plugin loop then runs while
    that module is half-imported; the registration completes when it is done)."""
    out, err = probes[case]
    assert out["plugin_loaded"]
    engine = "polynya.adapters.verl.engine.DeepSpeedLMEngine"
    assert out["engines"] == {"cuda": engine, "cpu": engine}
    assert out["replica"] and out["checkpoint"]
    assert out["classes"] == ["polynya.adapters.verl.rollout.PolynyaReplica",
                              "polynya.adapters.verl.rollout.PolynyaServerAdapter",
                              "polynya.adapters.verl.checkpoint.PolynyaCheckpointEngine"]
    assert "PolynyaPluginWarning" not in err


def test_broken_plugin_warns_loudly_and_verl_still_imports(probes):
    out, err = probes["broken"]
    assert out["plugin_loaded"] and out["engines"] == {} and not out["replica"] and not out["checkpoint"]
    assert "PolynyaPluginWarning: polynya's verl plugin failed to load (ModuleNotFoundError" in err
    assert "polynya.adapters.verl.engine" in err  # names the error ...
    assert "pip install 'polynya[verl]'" in err  # ... and the fix


@pytest.mark.parametrize("case", ["off", "engine_first_off"])
def test_verl_switch_turns_the_plugin_off(probes, case):
    out, _ = probes[case]
    assert not out["plugin_loaded"] and out["engines"] == {} and not out["replica"]
