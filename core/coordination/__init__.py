"""Coordination of the engines of one client: ``HandOver`` decides residency (who holds the
device when colocated), weight versions and sync layouts, and emits ``Action`` plans that the
local and Ray transports (and the HTTP server, through its local client) execute."""
from .handover import ENGINES, Action, HandOver, SyncPlan, check_engine

__all__ = ["ENGINES", "Action", "HandOver", "SyncPlan", "check_engine"]
