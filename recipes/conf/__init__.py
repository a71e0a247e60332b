"""Hydra config tree of the recipes (config.yaml + groups task/ model/ framework/ placement/)."""
