"""The recipe's structured config: one schema, built from the engine and client dataclasses.

``RecipeConfig`` has four sections: ``task`` (which task, its data and reward options), ``run``
(the GRPO loop), ``client`` (every field of ``polynya.RLClientConfig``, with the engine sections
``train`` / ``logprob`` / ``sampling`` derived from ``TrainConfig`` / ``LogProbConfig`` /
``SamplerConfig`` minus the fields the client owns — model, dtype, device, ``zorro``, ``fca``,
``backend``, the non-trainer ``seed`` — which exist once, as ``client.<key>``: an override such
as ``client.train.dtype=...`` is rejected by Hydra as an unknown key) and ``framework``. Nothing
is copied by hand: the schema is derived from the dataclasses, so a new client or engine field
shows up in the recipes and their YAML at once. YAML files only override defaults;
``to_client_config`` turns the composed section back into a validated ``RLClientConfig``.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from ..client.config import SECTIONS, RLClientConfig, owned_fields


def _copy_field(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return field(default_factory=f.default_factory)
    return field(default=f.default)


def _section_schema(name: str, cls) -> type:
    """``cls`` without the client-owned fields: the recipe's ``client.<name>`` section."""
    hints = typing.get_type_hints(cls)
    fields = [(f.name, hints[f.name], _copy_field(f)) for f in dataclasses.fields(cls)
              if f.name not in owned_fields(name)]
    return dataclasses.make_dataclass(f"{cls.__name__}Section", fields)


SECTION_SCHEMAS = {name: _section_schema(name, cls) for name, cls in SECTIONS.items()}


def _client_schema():
    fields = []
    for f in dataclasses.fields(RLClientConfig):
        if f.name in SECTION_SCHEMAS:
            cls = SECTION_SCHEMAS[f.name]
            fields.append((f.name, cls, field(default_factory=lambda cls=cls: OmegaConf.structured(cls))))
            continue
        typ = {"str": str, "int": int, "bool": bool, "float": float, "str | None": Optional[str],
               "int | None": Optional[int], "bool | str": Any}[f.type]
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
    """The GRPO loop: ``prompts_per_step`` prompts x ``group_size`` samples per step. Rollouts
    are sampled at ``client.train.temperature`` (the temperature the log-probs are taken at).
    ``launch``: frameworks that write a run of their own (``framework=verl``) also start it.

    ``checkpoint_every`` (0: only the last step is checkpointed), ``keep_checkpoints``;
    ``resume``: continue from ``out_dir``'s latest checkpoint; ``overwrite``: delete a previous
    run in ``out_dir`` first (without it, a run in the way is an error, never overwritten);
    ``eval_every``: every N steps and after the last, mean reward and pass@1 of one completion
    per prompt on ``eval_split`` (first ``eval_examples`` prompts, 0 = all; greedy unless
    ``eval_greedy=false``), logged as ``eval_*`` in the step's metrics."""

    steps: int = 20
    prompts_per_step: int = 8
    group_size: int = 8
    max_new_tokens: int = 32
    top_p: float = 1.0
    top_k: int = -1
    advantage_eps: float = 1e-6
    scale_advantages: bool = True
    seed: int = 0
    out_dir: str = "runs/${task.name}"
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    resume: bool = True
    overwrite: bool = False
    eval_every: int = 0
    eval_split: str = "test"
    eval_examples: int = 64
    eval_greedy: bool = True
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
    """The composed ``client`` section as a validated ``RLClientConfig`` (ValueError if bad):
    the engine sections are plain dicts of engine settings; the client fills in the rest."""
    values = {}
    for key in client:
        if key in SECTION_SCHEMAS:
            section = OmegaConf.to_object(client[key])
            values[key] = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}
        else:
            values[key] = client[key]
    return RLClientConfig(**values)


def check_overrides(args: list[str]) -> None:
    """``ValueError`` for a command-line override of an engine field the client owns (Hydra
    would only say it cannot override the key): name the key to use instead."""
    for arg in args:
        key = arg.lstrip("+~").split("=", 1)[0]
        parts = key.split(".")
        if len(parts) == 3 and parts[0] == "client" and parts[1] in SECTIONS:
            owner = owned_fields(parts[1]).get(parts[2])
            if owner is not None:
                raise ValueError(f"{key} is not a recipe setting: it is set once for every engine, "
                                 f"as client.{owner}")


def register() -> None:
    """Store the schema in Hydra's ConfigStore as ``recipe_schema``."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="recipe_schema", node=RecipeConfig)
