"""A task a tiny random model can learn on CPU in ~20 GRPO steps: "write digits".

Each prompt names a target digit (``"Say the digit 7 many times: "``). The reward looks at the
first ``WINDOW`` characters of the completion and gives each character 1.0 if it is the target
digit, ``OTHER_DIGIT`` (0.25) if it is another digit, 0 otherwise; the sum is divided by
``WINDOW`` (a short completion just scores less), so rewards lie in [0, 1].

Why this is learnable from random initialisation: the tiny tokenizer (``polynya.models.
tiny_tokenizer()``, 512 ids) has ~60 tokens made of digits (``"7"``, ``" 17"``, ...), ~12% of
the vocabulary, so a random model — whose next-token distribution is close to uniform —
already writes some digits in most groups of samples. The reward is dense (per character, not
all-or-nothing), so samples of one prompt differ and GRPO's group-normalised advantages are
non-zero almost every step. The first thing to learn, "emit digit tokens", is a shift of the
output layer's bias that does not depend on the prompt, which a 2-layer model picks up in a
few optimizer steps; the target-digit bonus then rewards reading the digit from the prompt.
``tests/recipes/test_toy.py`` trains ``tiny:qwen3`` with a minimal GRPO loop and checks that the
mean reward rises.

There is no data file: ``load`` builds the prompts (train: 10 digits x 4 phrasings; test: 10
digits x 1 held-out phrasing).
"""
from __future__ import annotations

from .common import Example, check_split

NAME = "toy"
WINDOW = 16
OTHER_DIGIT = 0.25
_TRAIN_TEMPLATES = ("Say the digit {d} many times: ", "Write {d} again and again: ",
                    "Digits please, all {d}: ", "Repeat {d}: ")
_TEST_TEMPLATES = ("Keep writing the digit {d}: ",)


def load(split: str, source: str | None = None) -> list[Example]:
    """The toy prompts of ``split`` (``train`` or ``test``); ``source`` must be ``None``."""
    if source is not None:
        raise ValueError(f"{NAME}: the toy task is generated in code; source must be None, "
                         f"got {source!r}")
    check_split(NAME, split)
    templates = _TRAIN_TEMPLATES if split == "train" else _TEST_TEMPLATES
    return [Example(t.format(d=d), str(d), {"target": str(d)})
            for t in templates for d in range(10)]


def reward(completion: str, example: Example, *, window: int = WINDOW,
           other_digit: float = OTHER_DIGIT) -> float:
    """Per-character score over the first ``window`` characters, averaged over ``window``."""
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    target = example.meta.get("target", example.answer)
    head = completion[:window]
    total = sum(1.0 if ch == target else other_digit if ch.isdigit() and ch.isascii() else 0.0
                for ch in head)
    return total / window
