"""Load causal LMs and tokenizers by spec; build tiny random models for tests and CPU runs.

A model *spec* is one of:

- an HF hub id or a local directory (``"Qwen/Qwen3-0.6B"``, ``"/ckpt/step100"``): real weights;
- ``"tiny:<family>"`` with family ``qwen3`` | ``llama`` | ``qwen3-moe`` (and, for the model-family
  matrix, ``qwen2`` | ``qwen2-window`` | ``mistral`` | ``gemma2`` | ``gemma3`` | ``phi3`` |
  ``olmo2`` | ``gpt-oss``, with windows of ``TINY_SLIDING_WINDOW`` tokens and small soft-caps
  so that ignoring them shows): a few-layer random model whose vocabulary matches
  :func:`tiny_tokenizer` — nothing is downloaded;
- ``"random:<shape>"`` with shape ``qwen3-0.6b`` | ``qwen3-1.7b`` | ``qwen3-4b``: the real
  architecture and sizes with random weights (benchmarks; no download).

Random models are initialised from ``seed`` so two processes that build the same spec get the
same weights (trainer and sampler start in sync).
"""
from __future__ import annotations

import functools
import os

import torch

from .config.common import resolve_dtype

TINY_VOCAB = 512  # tiny_tokenizer's vocabulary (bytes + merges + specials)
TINY_WINDOW = 8192  # context of tiny models: long enough for the long-context QA sample
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]

_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16)
TINY_SLIDING_WINDOW = 8  # windows of the tiny sliding-window families: shorter than test prompts
_TINY = {
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=16),
    "qwen3-moe": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      norm_topk_prob=True),
    # the model-family matrix (tests/core/test_model_families.py): windows, soft-caps, scales
    "qwen2": dict(_SMALL, model_type="qwen2"),
    "qwen2-window": dict(_SMALL, model_type="qwen2", use_sliding_window=True,
                         sliding_window=TINY_SLIDING_WINDOW, max_window_layers=1),
    "mistral": dict(_SMALL, model_type="mistral", sliding_window=TINY_SLIDING_WINDOW),
    "gemma2": dict(_SMALL, model_type="gemma2", sliding_window=TINY_SLIDING_WINDOW,
                   query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                   final_logit_softcapping=5.0, initializer_range=0.2),  # scores reach the cap
    "gemma3": dict(_SMALL, model_type="gemma3_text", sliding_window=TINY_SLIDING_WINDOW,
                   sliding_window_pattern=2, query_pre_attn_scalar=24, final_logit_softcapping=5.0),
    "phi3": dict(_SMALL, model_type="phi3", num_key_value_heads=4,
                 sliding_window=TINY_SLIDING_WINDOW),  # as Phi-3-mini's 2047
    "olmo2": dict(_SMALL, model_type="olmo2"),
    "gpt-oss": dict(_SMALL, model_type="gpt_oss", sliding_window=TINY_SLIDING_WINDOW,
                    num_local_experts=4, num_experts_per_tok=2,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
_QWEN3 = dict(model_type="qwen3", vocab_size=151936, head_dim=128, max_position_embeddings=40960,
              rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
              bos_token_id=151643, eos_token_id=151645)
_RANDOM = {
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-1.7b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-4b": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
}


def model_config(spec: str, **overrides):
    """The ``transformers`` config for a ``tiny:`` / ``random:`` spec (or a real id/path)."""
    from transformers import AutoConfig

    kind, _, name = spec.partition(":")
    if kind == "tiny":
        if name not in _TINY:
            raise ValueError(f"unknown tiny model {name!r}; choose one of {sorted(_TINY)}")
        fields = dict(_TINY[name], vocab_size=TINY_VOCAB, max_position_embeddings=TINY_WINDOW,
                      tie_word_embeddings=False, bos_token_id=None,
                      eos_token_id=tiny_token_id("<|endoftext|>"), pad_token_id=tiny_token_id("<|pad|>"))
    elif kind == "random":
        if name not in _RANDOM:
            raise ValueError(f"unknown random model shape {name!r}; choose one of {sorted(_RANDOM)}")
        fields = dict(_RANDOM[name])
    else:
        return AutoConfig.from_pretrained(spec, **overrides)
    fields.update(overrides)
    model_type = fields.pop("model_type")
    return AutoConfig.for_model(model_type, **fields)


def is_synthetic(spec: str) -> bool:
    return spec.startswith(("tiny:", "random:"))


def load_model(spec: str, *, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
               seed: int = 0, attn_implementation: str | None = None, **config_overrides):
    """Build or load a causal LM.

    Args:
        spec: HF id, local path, ``tiny:<family>`` or ``random:<shape>`` (module docstring).
        dtype: parameter dtype. device: where the model lives. seed: init seed for random specs.
        attn_implementation: transformers' attention (None: its default — SDPA where the model
            supports it, else eager, e.g. for Gemma 2's soft-capping or gpt-oss's sinks).
    Returns:
        a ``transformers`` ``PreTrainedModel`` in eval mode.
    """
    from transformers import AutoModelForCausalLM

    torch_dtype = resolve_dtype(dtype)
    if is_synthetic(spec):
        cfg = model_config(spec, **config_overrides)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32,
                                                     attn_implementation=attn_implementation)
        # RoPE frequencies stay float32, as from_pretrained (and vLLM) keep them whatever the
        # weights' dtype: a bf16 copy rounds them, and the model's own save_pretrained export
        # then computes other log-probs than the model did
        rope = {n: b for n, b in model.named_buffers() if n.endswith("inv_freq")}
        model = model.to(device=device, dtype=torch_dtype)
        for name, buf in rope.items():
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._buffers[leaf] = buf.to(device)
        model.config.name_or_path = spec  # errors name the model as the user did
    else:
        if not os.path.isdir(spec) and "/" not in spec:
            raise ValueError(f"model {spec!r} is neither a local directory, an HF id, nor a tiny:/random: spec")
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=torch_dtype,
                                                     attn_implementation=attn_implementation,
                                                     **config_overrides).to(device)
    return model.eval()


def load_tokenizer(spec: str):
    """The tokenizer for a spec: the locally trained tiny tokenizer for ``tiny:``/``random:``."""
    if is_synthetic(spec):
        return tiny_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(spec)


def tiny_token_id(token: str) -> int:
    return SPECIAL_TOKENS.index(token)


def _corpus() -> list[str]:
    """A deterministic English/maths/SQL corpus: enough for a byte-level BPE of 512 tokens."""
    words = ("the a of to and in is it that for on with as was at by an be this are from or have "
             "had not but what all were when we there can your which their if do will each about "
             "how up out them then she many some so these would other into has more her two like "
             "him see time could no make than first been its who now people my made over did down "
             "only way find use may water long little very after words called just where most know "
             "question answer passage document apples oranges pencils books coins marbles cookies "
             "bought sold gave left total each more less how many much does did has have costs "
             "dollars minutes hours days weeks students teacher store farmer friend sister brother "
             "select from where group by order count sum avg min max join on and or not null as "
             "limit distinct having table name id age city country price quantity customers orders "
             "products employees salary department year title author born capital river mountain "
             "think step therefore boxed final").split()
    lines = []
    for i in range(400):
        w = [words[(i * 7 + j * 13) % len(words)] for j in range(12)]
        nums = f"{i} + {i * 3 % 97} = {i + i * 3 % 97}; {i * 11 % 1000} * {i % 9} = {(i * 11 % 1000) * (i % 9)}"
        lines.append(" ".join(w) + ". " + nums + " #### " + str(i * 17 % 503))
        lines.append(f"SELECT name, COUNT(*) FROM table_{i % 7} WHERE age > {i % 60} GROUP BY name;")
        lines.append(f"Question: What is {i} plus {i % 13}? Answer: \\boxed{{{i + i % 13}}}")
    return lines


@functools.lru_cache(maxsize=1)
def tiny_tokenizer():
    """A byte-level BPE tokenizer (512 ids) trained locally on a built-in corpus.

    No download; deterministic; every byte string is encodable. Specials: ``<|endoftext|>``
    (eos, id 0), ``<|pad|>`` (id 1), ``<|im_start|>``, ``<|im_end|>``; a minimal chat template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|pad|>", model_max_length=TINY_WINDOW)
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return fast
