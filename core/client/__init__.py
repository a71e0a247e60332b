"""The polynya client: one API over in-process engines, Ray actors, or an HTTP server.

::

    import polynya
    from polynya import RolloutBatch, SamplingParams

    cfg = polynya.RLClientConfig("tiny:qwen3", dtype="float32", comm_protocol="local")
    with polynya.create_rl_client(cfg) as client:
        out = client.generate(prompts, SamplingParams(n=4, logprobs=True))
        old = client.compute_logprobs(batch)            # or model="reference"
        client.forward_backward(batch); client.step()
        client.sync_weights()                            # verified, versioned
        # every call has an ``*_async`` twin: await client.generate_async(...)

Protocols: ``local`` (``LocalClient``), ``ray`` (``RayClient``, ``polynya[ray]``), ``http``
(``HTTPClient`` against ``polynya.client.server``, ``polynya[http]``).
"""

from __future__ import annotations

from .. import config as _engine_configs  # noqa: F401  (first: it re-exports RLClientConfig)
from .api import ENGINES, EngineError, RLClient
from .config import RLClientConfig


def create_rl_client(config: RLClientConfig) -> RLClient:
    """Build the engines (or connect to them) as ``config`` says; the result is a context manager."""
    if not isinstance(config, RLClientConfig):
        raise ValueError(f"create_rl_client needs an RLClientConfig, got {type(config).__name__}")
    if config.cpu_threads is not None and config.comm_protocol != "ray":
        import torch

        torch.set_num_threads(config.cpu_threads)  # the engines run in this process
    if config.comm_protocol == "local":
        from .local import LocalClient

        return LocalClient(config)
    if config.comm_protocol == "ray":
        from .ray_client import RayClient

        return RayClient(config)
    from .http_client import HTTPClient

    return HTTPClient(config)


__all__ = ["ENGINES", "EngineError", "RLClient", "RLClientConfig", "create_rl_client"]
