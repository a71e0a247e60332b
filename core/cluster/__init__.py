"""Placement of engines on devices: Ray placement groups and actors, prompt routing.

- ``routing``: ``route_prompts`` / ``merge_routed`` — prompt groups to sampler replicas.
- ``placement``: placement groups for colocated (fractional, one bundle per GPU) and split
  layouts (imports Ray lazily).
- ``workers``: the Ray actor classes (trainer rank, sampler replica, log-prob rank).
"""

from .routing import merge_routed, route_prompts

__all__ = ["merge_routed", "route_prompts"]
