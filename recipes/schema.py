"""The recipe's structured config: one schema, built from the engine and client dataclasses.

``RecipeConfig`` has four sections: ``task`` (which task, its data and reward options), ``run``
(the GRPO loop), ``client`` (every field of ``polynya.RLClientConfig``, with the engine sections
``train`` / ``logprob`` / ``sampling`` typed by ``TrainConfig`` / ``LogProbConfig`` /
``SamplerConfig`` themselves) and ``framework``. Nothing is copied by hand: ``ClientSchema`` is
derived from ``RLClientConfig``'s fields, so a new client or engine field shows up in the recipes
and their YAML at once. YAML files only override defaults; ``to_client_config`` turns the
composed section back into a validated ``RLClientConfig``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from ..client.config import RLClientConfig
from ..config.logprob import LogProbConfig
from ..config.sampler import SamplerConfig
from ..config.train import TrainConfig

_ENGINE_SECTIONS = {"train": TrainConfig, "logprob": LogProbConfig, "sampling": SamplerConfig}


def _client_schema():
    fields = []
    for f in dataclasses.fields(RLClientConfig):
        if f.name in _ENGINE_SECTIONS:
            cls = _ENGINE_SECTIONS[f.name]
            fields.append((f.name, cls, field(default_factory=lambda cls=cls: OmegaConf.structured(cls))))
            continue
        typ = {"str": str, "int": int, "bool": bool, "float": float, "str | None": Optional[str]}[f.type]
        default = MISSING if f.default is dataclasses.MISSING else f.default
        fields.append((f.name, typ, field(default=default)))
    return dataclasses.make_dataclass("ClientSchema", fields)


ClientSchema = _client_schema()


@dataclass
class TaskSection:
    """name: a task of ``polynya.recipes.tasks``; source: HF id / local path (None: bundled);
    chat_template: wrap prompts in the tokenizer's chat template; reward: keyword options of
    the task's ``reward`` (e.g. ``{method: flexible}`` for gsm8k)."""

    name: str = MISSING
    source: Optional[str] = None
    train_split: str = "train"
    chat_template: bool = False
    max_prompt_tokens: int = 2048
    reward: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunSection:
    """The GRPO loop: ``prompts_per_step`` prompts x ``group_size`` samples per step.
    ``launch``: frameworks that write a run of their own (``framework=verl``) also start it."""

    steps: int = 20
    prompts_per_step: int = 8
    group_size: int = 8
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    advantage_eps: float = 1e-6
    scale_advantages: bool = True
    seed: int = 0
    out_dir: str = "runs/${task.name}"
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    resume: bool = True
    tensorboard: bool = False
    progress: bool = True
    launch: bool = False


@dataclass
class RecipeConfig:
    task: TaskSection = field(default_factory=TaskSection)
    run: RunSection = field(default_factory=RunSection)
    client: Any = field(default_factory=lambda: OmegaConf.structured(ClientSchema))
    framework: str = "builtin"


def to_client_config(client: DictConfig) -> RLClientConfig:
    """The composed ``client`` section as a validated ``RLClientConfig`` (ValueError if bad).

    The engine sections get the client's ``model_name`` (RLClientConfig writes it over them
    anyway) so that ``OmegaConf.to_object`` can build and validate each engine dataclass.
    """
    client = client.copy()
    values = {}
    for key in client:
        if key in _ENGINE_SECTIONS:
            section = client[key].copy()
            section.model = client.model_name
            values[key] = OmegaConf.to_object(section)
        else:
            values[key] = client[key]
    return RLClientConfig(**values)


def register() -> None:
    """Store the schema in Hydra's ConfigStore as ``recipe_schema``."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="recipe_schema", node=RecipeConfig)
