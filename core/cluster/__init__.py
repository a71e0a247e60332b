"""Placement of engines on devices: Ray placement groups and actors, prompt routing.

- ``routing``: ``ReplicaRouter`` / ``merge_routed`` — prompt groups to sampler replicas,
  against the calls in flight.
- ``placement``: placement groups for colocated (fractional, one bundle per GPU) and split
  layouts (imports Ray lazily).
- ``workers``: the Ray actor classes (trainer rank, sampler replica, log-prob rank).
"""

from .routing import ReplicaRouter, merge_routed

__all__ = ["ReplicaRouter", "merge_routed"]
