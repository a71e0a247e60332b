"""GSM8K: grade-school maths word problems with the ``#### <number>`` answer convention.

``load(split, source=None)`` reads the bundled sample (generated arithmetic word problems,
``recipes/data/gsm8k/{train,test}.jsonl``), a local ``.jsonl``/``.json``/``.parquet`` file or
directory, or an HF dataset id (``datasets.load_dataset(source, "main", split=split)``, e.g.
``"openai/gsm8k"``). Records need ``question`` and ``answer`` (the worked solution ending in
``#### N``, or just ``N``).

``reward(completion, example)`` follows verl's GSM8K scorer: the answer is the last
``#### number`` in the completion (``method="strict"``) or the last number anywhere
(``method="flexible"``); commas and ``$`` are stripped on both sides and numbers compared by
value. 1.0 when correct, ``format_score`` when an answer was extracted but is wrong, else 0.
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from .common import DATA_DIR, Example, field, load_records

NAME = "gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_NUMBER = r"-?(?:\$\s*)?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
_STRICT = re.compile(r"####\s*(" + _NUMBER + ")")
_FLEXIBLE = re.compile(_NUMBER)


def make_prompt(question: str) -> str:
    return f"{question.strip()} {INSTRUCTION}"


def load(split: str, source: str | None = None) -> list[Example]:
    """Examples of ``split`` (``train``/``test`` for the bundled sample and for ``openai/gsm8k``).

    Returns:
        ``Example(prompt, answer=<final number as text>, meta={"question", "solution"})``.
    """
    records = load_records(NAME, split, source, DATA_DIR / NAME, hf_config="main")
    examples = []
    for i, record in enumerate(records):
        question = field(NAME, record, i, "question")
        solution = field(NAME, record, i, "answer", (str, int, float))
        final = ground_truth(str(solution))
        if final is None:
            raise ValueError(f"{NAME} record {i}: field 'answer' has no '#### <number>' "
                             f"final answer: {str(solution)[-80:]!r}")
        examples.append(Example(make_prompt(question), final,
                                {"question": question, "solution": str(solution)}))
    return examples


def ground_truth(solution: str) -> str | None:
    """The final number of a reference solution (``#### N``, or a bare number)."""
    found = extract_answer(solution, "strict")
    if found is None and _FLEXIBLE.fullmatch(solution.strip()):
        found = _clean(solution)
    return found


def extract_answer(text: str, method: str = "strict") -> str | None:
    """The answer a completion gives, as a cleaned number string, or ``None``.

    ``strict``: the last ``#### number``. ``flexible``: the last number anywhere.
    """
    if method == "strict":
        matches = _STRICT.findall(text)
    elif method == "flexible":
        matches = _FLEXIBLE.findall(text)
    else:
        raise ValueError(f"unknown extraction method {method!r}; use 'strict' or 'flexible'")
    for match in reversed(matches):
        cleaned = _clean(match)
        if cleaned is not None:
            return cleaned
    return None


def reward(completion: str, example: Example, *, method: str = "strict",
           format_score: float = 0.1, score: float = 1.0) -> float:
    """``score`` if the extracted answer equals ``example.answer``, ``format_score`` if an answer
    was extracted but differs, 0.0 if none was found."""
    answer = extract_answer(completion, method)
    if answer is None:
        return 0.0
    return score if _same_number(answer, example.answer) else format_score


def _clean(number: str) -> str | None:
    cleaned = number.replace(",", "").replace("$", "").replace(" ", "").strip()
    cleaned = cleaned.rstrip(".")
    return cleaned if re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)", cleaned) else None


def _same_number(a: str, b: str) -> bool:
    a, b = a.replace(",", "").replace("$", "").strip(), b.replace(",", "").replace("$", "").strip()
    try:
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return a == b
