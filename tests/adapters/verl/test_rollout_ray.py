"""The Ray side of the ``polynya`` rollout on CPU: ``PolynyaReplica.init_hybrid`` starts the
server actor next to its worker, the worker-side ``PolynyaServerAdapter`` pushes new weights
into it and puts it to sleep / wakes it, and the server then answers with the new model."""
from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest
import ray
from polynya.adapters.verl.rollout import PolynyaReplica, PolynyaServerAdapter
from polynya.models import load_model

from .test_rollout import MAX_NEW, MODEL, PROMPTS, SEED, greedy, rollout_config


@ray.remote(num_cpus=0)
class Worker:  # stands in for verl's hybrid ActorRolloutRefWorker: only its placement is read
    def ping(self) -> bool:
        return True


@pytest.fixture(scope="module")
def ray_local():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", include_dashboard=False, num_cpus=2, log_to_driver=False)
    yield
    ray.shutdown()


def test_replica_launch_adapter_weight_push_sleep_wake(ray_local):
    config = rollout_config()
    replica = PolynyaReplica(replica_rank=0, config=config, model_config=SimpleNamespace(local_path=MODEL),
                             gpus_per_node=1)
    worker = Worker.remote()

    async def scenario():
        await replica.init_hybrid(SimpleNamespace(workers=[worker]))
        server = replica.server_handle
        first = await server.generate.remote(prompt_ids=PROMPTS[0], sampling_params={"temperature": 0.0},
                                             request_id="x0")
        adapter = PolynyaServerAdapter(config, SimpleNamespace(local_path=MODEL), None, replica_rank=0)
        new = load_model(MODEL, dtype="float32", device="cpu", seed=SEED + 1)
        await adapter.release()
        try:
            await server.generate.remote(prompt_ids=PROMPTS[0], sampling_params={}, request_id="x1")
            asleep = None
        except ray.exceptions.RayTaskError as exc:
            asleep = str(exc)
        await adapter.update_weights(((n, p.detach()) for n, p in new.named_parameters()), global_steps=4)
        await adapter.resume(tags=["weights", "kv_cache"])
        after = await server.generate.remote(prompt_ids=PROMPTS[0], sampling_params={"temperature": 0.0},
                                             request_id="x2")
        return first, after, new, asleep

    first, after, new, asleep = asyncio.run(scenario())
    assert asleep is not None and "asleep" in asleep
    model = load_model(MODEL, dtype="float32", device="cpu", seed=SEED)
    assert first.token_ids == greedy(model, PROMPTS[0], MAX_NEW)
    assert after.token_ids == greedy(new, PROMPTS[0], MAX_NEW) and after.extra_fields["global_steps"] == 4
    assert replica.server_address == "polynya_rollout_server_0"
