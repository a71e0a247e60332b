"""polynya's engines inside stock verl 0.9.1 (``pip install 'polynya[verl]'``).

Installing the extra registers, through verl's ``verl.plugins`` entry point (``plugin``):

- training engine ``deepspeed`` (``engine``, config classes in ``settings``, YAML in ``config/``):
  polynya's DeepSpeed ``TrainingEngine`` with ZoRRo Train, driven by verl's own PPO loss;
- rollout ``polynya`` (``rollout``): polynya's sampler answering verl's server calls;
- checkpoint engine ``polynya`` (``checkpoint``): bucketed weight broadcast, checksum-verified.

The swap is a few overrides of verl's ``ppo_trainer.yaml`` (``overrides.SWAP``; README,
"Adapters -> verl"); ``polynya-recipe framework=verl`` writes a whole verl run with them.

Importing this package imports nothing of verl; the submodules do.
"""


def _module_done() -> None:
    """Called at the end of each submodule that imports verl at its top: if verl's plugin loop
    ran while that module was half-imported (it was imported before verl), the plugin finishes
    its registration now. Does nothing when the plugin was not loaded (e.g. plugins off)."""
    import sys

    plugin = sys.modules.get(__name__ + ".plugin")
    if plugin is not None:
        plugin.complete_deferred()
