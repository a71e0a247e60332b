"""What a model's attention asks of every polynya path, read once from its HF config.

A decoder's attention is more than ``softmax(q k^T / sqrt(d)) v`` in many families: per-layer
sliding windows (Mistral, Gemma 2/3, Qwen2/3 with ``use_sliding_window``, gpt-oss's alternating
layers), soft-capped attention scores (Gemma 2), a query scale other than ``head_dim ** -0.5``
(Gemma's ``query_pre_attn_scalar``), attention sinks (gpt-oss), bidirectional layers. A path
that ignores one computes a wrong number without any error, so every polynya path asks this
module what the model needs and either honours it or refuses at load time::

    feats = attention_features(model)            # or a config
    feats.require("ZoRRo Train", name, supported=ZORRO_SUPPORTS, alternative="zorro=False")
    w = feats.window(layer_idx)                  # None, or W: a query sees its last W positions

The per-layer window comes from transformers' own ``config.layer_types`` (``"full_attention"`` /
``"sliding_attention"``, filled in by the config classes from ``use_sliding_window``,
``max_window_layers``, ``sliding_window_pattern``, ...) and ``config.sliding_window``; a config
without ``layer_types`` but with a ``sliding_window`` (Mistral, Phi-3, Qwen3-MoE) windows every
layer, as its model's mask does. ``W`` follows transformers' masks: key ``j`` is visible from
query ``i`` iff ``0 <= i - j < W`` (positions along the sequence).

The attention hooks cross-check every call (``check_call``): the window and soft-cap the model
passes to its attention interface must be the ones read here, else ``ValueError`` — a misread
config can stop a run, never bend its numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.nn import ModuleList

FULL, SLIDING = "full_attention", "sliding_attention"
WINDOWS, SOFTCAP = "sliding-window attention", "attention soft-capping"
SINKS, BIDIRECTIONAL = "attention sinks", "bidirectional attention"


@dataclass(frozen=True)
class AttentionFeatures:
    """The attention features of one model (see the module docstring).

    Attributes:
        model_type: the config's ``model_type``.
        layer_windows: per decoder layer, ``None`` (full causal) or the window ``W``.
        attn_softcap: ``c`` of ``score = c * tanh(score / c)`` on attention scores, or None.
        final_softcap: the same on the LM head's logits (``final_logit_softcapping``), or None.
        query_scale: the softmax scale when it is not ``head_dim ** -0.5`` (Gemma's
            ``query_pre_attn_scalar ** -0.5``); the model passes it to every attention call.
        sinks: per-head attention-sink logits (gpt-oss).
        bidirectional: some layers attend to later positions (``use_bidirectional_attention``).
        other_layer_types: layer types that are neither full nor sliding attention (chunked,
            linear, ...), which no polynya path implements.
        router_aux_loss: the MoE config asks for the router load-balancing loss to be added
            (``output_router_logits``) with weight ``router_aux_loss_coef``.
        tied_embeddings: the LM head shares the input embedding's weight.
        logit_scale: the factor the model's causal-LM forward applies to its LM head's logits
            (``head_scale``), or None; polynya's own head paths apply it (``head_temperature``).
    """

    model_type: str
    layer_windows: tuple[int | None, ...]
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_scale: float | None = None
    sinks: bool = False
    bidirectional: bool = False
    other_layer_types: tuple[str, ...] = ()
    router_aux_loss: bool = False
    router_aux_loss_coef: float = 0.0
    tied_embeddings: bool = False
    logit_scale: float | None = None

    def head_temperature(self, temperature: float) -> float:
        """The temperature polynya's LM head divides by so that its logits are the model's own
        (``logit_scale`` folded in: ``logits * s / T == logits / (T / s)``)."""
        if self.logit_scale is None:
            return temperature
        if self.final_softcap is not None:
            raise ValueError(f"{self.model_type} scales its logits and soft-caps them; polynya's "
                             "LM head does not know their order for this model (report it)")
        return temperature / self.logit_scale

    @property
    def windowed(self) -> bool:
        return any(w is not None for w in self.layer_windows)

    def window(self, layer_idx: int) -> int | None:
        """The window of layer ``layer_idx`` (None: full causal attention)."""
        return self.layer_windows[layer_idx]

    def needs(self) -> list[str]:
        """Names of the non-plain attention features this model has."""
        out = [WINDOWS] if self.windowed else []
        out += [SOFTCAP] if self.attn_softcap is not None else []
        out += [SINKS] if self.sinks else []
        out += [BIDIRECTIONAL] if self.bidirectional else []
        out += [f"{t!r} layers" for t in self.other_layer_types]
        return out

    def require(self, path: str, model_name: str, *, supported: frozenset[str], alternative: str) -> None:
        """``ValueError`` naming the model, the first feature ``path`` does not implement and the
        alternative; nothing when the path implements everything this model needs."""
        for feature in self.needs():
            if feature not in supported:
                raise ValueError(f"{path} does not implement {feature}, which {model_name} "
                                 f"({self.model_type}) uses; {alternative}")

    def check_call(self, layer_idx: int | None, kwargs: dict) -> int | None:
        """Cross-check one attention call against this reading; returns the layer's window.

        ``kwargs`` are what the model passed to its attention interface (``sliding_window``,
        ``softcap``, ``s_aux``). ``ValueError`` when they disagree with the config's reading.
        """
        if isinstance(layer_idx, int) and 0 <= layer_idx < len(self.layer_windows):
            window = self.layer_windows[layer_idx]
        elif not self.windowed:  # every layer is full: the layer's index does not matter
            window = None
        else:
            raise ValueError(f"attention module of {self.model_type} has no valid layer_idx "
                             f"({layer_idx!r}); polynya cannot tell which window applies")
        passed = kwargs.get("sliding_window")
        if passed != window:
            raise ValueError(f"{self.model_type} layer {layer_idx}: the model attends with "
                             f"sliding_window={passed!r} but its config reads as {window!r}; "
                             "refusing rather than guessing (report this model)")
        cap = kwargs.get("softcap")
        if cap is not None and cap != self.attn_softcap:
            raise ValueError(f"{self.model_type} layer {layer_idx}: the model passes softcap={cap!r}, "
                             f"its config reads as {self.attn_softcap!r}")
        if kwargs.get("s_aux") is not None and not self.sinks:
            raise ValueError(f"{self.model_type} layer {layer_idx}: the model passes attention sinks "
                             "its config does not announce")
        return window


def model_name(model) -> str:
    """How errors name a model: its HF id / path / polynya spec, else ``"this model"``."""
    return getattr(getattr(model, "config", model), "name_or_path", "") or "this model"


def text_config(config):
    """The decoder's config (multimodal configs nest it; plain ones are their own)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def decoder_layers(model) -> tuple[ModuleList | None, str | None]:
    """The model's decoder layers: the first ``nn.ModuleList`` of ``num_hidden_layers`` (text
    config) modules of one class whose ``i``-th holds an attention module with ``layer_idx
    == i``; ``(None, why)`` when there is none."""
    from torch.nn import ModuleList

    n = getattr(text_config(model.config), "num_hidden_layers", None)
    for module in model.modules():
        if (isinstance(module, ModuleList) and len(module) == n
                and len({type(m) for m in module}) == 1
                and all(any(getattr(sub, "layer_idx", None) == i for sub in layer.modules())
                        for i, layer in enumerate(module))):
            return module, None
    return None, (f"no decoder layers found in {type(model).__name__} (an nn.ModuleList of "
                  f"num_hidden_layers={n} modules of one class, layer i holding the attention "
                  "module with layer_idx i)")


# model types whose causal-LM forward scales the LM head's logits (transformers 5.x modeling
# code): the config attribute and whether the forward divides by it or multiplies
_HEAD_SCALES = {
    **dict.fromkeys(("granite", "granitemoe", "granitemoeshared", "granitemoehybrid",
                     "granite_swa", "granitemoe_swa", "minicpm3"), ("logits_scaling", "divide")),
    "hyperclovax": ("logits_scaling", "multiply"),
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe", "cohere_compass"),
                    ("logit_scale", "multiply")),
    "falcon_h1": ("lm_head_multiplier", "multiply"),
}
_SCALE_ATTRS = ("logits_scaling", "logit_scale", "lm_head_multiplier", "output_multiplier")


def head_scale(cfg) -> float | None:
    """The factor ``cfg``'s model applies to its LM head's logits, or None (none or 1). A model
    type outside ``_HEAD_SCALES`` whose config sets one of ``_SCALE_ATTRS`` to something else
    than 1 is refused: polynya cannot tell whether or how its forward applies it, and a head
    that drops it computes every log-prob at the wrong temperature without an error."""
    rule = _HEAD_SCALES.get(cfg.model_type)
    if rule is None:
        for attr in _SCALE_ATTRS:
            value = getattr(cfg, attr, None)
            if value not in (None, 1, 1.0):
                raise ValueError(f"{cfg.model_type} sets {attr}={value!r}, which polynya's LM head "
                                 "does not know how to apply to this model type (its log-probs "
                                 "would be at the wrong temperature); not supported (report it)")
        return None
    attr, how = rule
    value = getattr(cfg, attr, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{cfg.model_type}: {attr} must be a positive finite number, got {value!r}")
    scale = 1.0 / float(value) if how == "divide" else float(value)
    return None if scale == 1.0 else scale


def attention_features(model_or_config) -> AttentionFeatures:
    """Read the attention features of an HF model or config (see the module docstring)."""
    cfg = text_config(getattr(model_or_config, "config", model_or_config))
    params = getattr(model_or_config, "named_parameters", None)
    if callable(params):  # a model: its parameters say whether there are sink logits
        sinks = any(name.rsplit(".", 1)[-1] == "sinks" for name, _ in params())
    else:
        sinks = cfg.model_type == "gpt_oss"
    n = int(cfg.num_hidden_layers)
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", True) is False:
        window = None
    types = list(getattr(cfg, "layer_types", None) or [])
    if types and len(types) != n:
        raise ValueError(f"{cfg.model_type}: config.layer_types has {len(types)} entries for "
                         f"{n} layers")
    if not types:
        types = [SLIDING if window is not None else FULL] * n
    if SLIDING in types and window is None:
        raise ValueError(f"{cfg.model_type}: layer_types has sliding layers but sliding_window is "
                         "not set")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{cfg.model_type}: sliding_window must be a positive int, got {window!r}")
    windows = tuple(window if t == SLIDING else None for t in types)
    scalar = getattr(cfg, "query_pre_attn_scalar", None)
    return AttentionFeatures(
        model_type=cfg.model_type,
        layer_windows=windows,
        attn_softcap=getattr(cfg, "attn_logit_softcapping", None),
        final_softcap=getattr(cfg, "final_logit_softcapping", None),
        query_scale=float(scalar) ** -0.5 if scalar else None,
        sinks=sinks,
        bidirectional=bool(getattr(cfg, "use_bidirectional_attention", False) or
                           getattr(cfg, "is_causal", True) is False),
        other_layer_types=tuple(sorted({t for t in types if t not in (FULL, SLIDING)})),
        router_aux_loss=bool(getattr(cfg, "output_router_logits", False)),
        router_aux_loss_coef=float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0),
        tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        logit_scale=head_scale(cfg),
    )
