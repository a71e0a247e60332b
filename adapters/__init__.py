"""Thin adapters for RL frameworks (verl, SkyRL, TRL): translation only, imported lazily."""
