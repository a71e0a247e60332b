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
