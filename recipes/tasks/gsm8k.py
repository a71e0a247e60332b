"""GSM8K: grade-school maths word problems with the ``#### <number>`` answer convention.

``load(split, source=None)`` reads the bundled sample (generated arithmetic word problems,
``recipes/data/gsm8k/{train,test}.jsonl``), a local ``.jsonl``/``.json``/``.parquet`` file or
directory, or an HF dataset id (``datasets.load_dataset(source, "main", split=split)``, e.g.
``"openai/gsm8k"``). Records need ``question`` and ``answer`` (the worked solution ending in
``#### N``, or just ``N``).

``reward(completion, example, convention=...)`` scores a completion in one of two explicit
conventions:

- ``"verl"`` (the default: what a verl user's GSM8K runs report) reproduces verl's
  ``verl.utils.reward_score.gsm8k.compute_score`` (verl 0.9.1): only the last 300 characters are
  searched; ``method="strict"`` takes the last ``"#### "`` + ``-?[0-9.,]+`` (one space, no ``$``),
  ``method="flexible"`` the last ``-?[0-9.,]+`` that is not ``"."`` (or, as verl's loop does, the
  first match when all are ``"."``); strict removes commas and ``$`` from its match, flexible
  keeps it as is; the result is compared *as a string* with the ground truth. So
  ``3.50``, ``072``, ``.5`` and ``72.`` are wrong for ``3.5`` / ``72`` / ``0.5`` / ``72``;
  ``####18``, ``#### $18`` and an answer followed by more than 300 characters find nothing.
- ``"value"`` (polynya's own, deliberately more lenient in format and stricter in reading
  numbers): the whole completion is searched; ``####`` with any spacing, an optional ``$``
  after the sign (``-``, ``+`` or U+2212 ``−``); numbers compared by value (``Decimal``:
  ``3.50`` = ``3.5``, ``072`` = ``72``).
  A number is a maximal run of digits, ``,`` and ``.`` (not glued to another such run): commas
  must group thousands (``1,000``, ``12,345.5``), a trailing ``.`` or ``,`` ends the sentence
  (``72.``). A run that is no number (``4,5``, ``1,2345``, ``1000,50``, ``1.2.3``) is no
  answer: it is never read as ``45`` or ``.3``. The *last* candidate decides (the last
  ``#### N`` for ``strict``, the last number for ``flexible``): a malformed last candidate gives
  no answer rather than an earlier number. Fractions (``1/2``) and words are not evaluated: a
  number glued to a fraction slash, an exponent, a power or a ``_`` group (``1/2``, ``1 / 2``,
  ``3⁄4``, ``1e3``, ``2^3``, ``10²``, ``1_000``) is no answer, neither its numerator nor its
  denominator (``72/month`` is still ``72``).

Both give ``score`` (1.0) when correct, ``format_score`` (0.0, as in verl) when an answer was
extracted but is wrong, and 0 when none was found. A truncated completion (no EOS within the
token budget) is scored the same way, as verl and TRL do by default.
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from .common import DATA_DIR, Example, field, load_records

NAME = "gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# A candidate: an optional sign (-, +, U+2212) and $, then a maximal run of digits, commas and
# periods that starts with a digit (or .digit) and is not glued to a run before it; _VALID says
# if it is a number, _GLUED_AFTER / _GLUED_BEFORE if it is part of a fraction (1/2, 3⁄4), an
# exponent (1e3), a power (2^3, 10²) or a "_"-grouped number (1_000), which is no answer.
_NUMBER = r"(?<![\d.,])[-+\u2212]?(?:\$\s*)?(?:\d|\.\d)[\d.,]*"
_STRICT = re.compile(r"####\s*(" + _NUMBER + ")")
_FLEXIBLE = re.compile("(" + _NUMBER + ")")
_VALID = re.compile(r"-?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)")
_GLUED_AFTER = re.compile(r"\s*[/\u2044]\s*[-+\u2212]?\d|[eE][-+\u2212]?\d|_\d|\s*\^"
                          r"|[\u00b2\u00b3\u00b9\u2070-\u2079]")
_GLUED_BEFORE = re.compile(r"(?:\d\s*[/\u2044]\s*|\d[eE]|\d_|\^\s*)\Z")


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
        if isinstance(solution, float) and solution.is_integer():
            solution = int(solution)  # 72.0 (a numeric column) is 72, as a completion writes it
        final = ground_truth(str(solution))
        if final is None:
            raise ValueError(f"{NAME} record {i}: field 'answer' has no '#### <number>' "
                             f"final answer: {str(solution)[-80:]!r}")
        examples.append(Example(make_prompt(question), final,
                                {"question": question, "solution": str(solution)}))
    return examples


def ground_truth(solution: str) -> str | None:
    """The final number of a reference solution (``#### N``, or a bare number)."""
    found = extract_answer(solution, "strict", "value")
    if found is None and _FLEXIBLE.fullmatch(solution.strip()):
        found = _clean(solution)
    return found


CONVENTIONS = ("verl", "value")
_VERL_CLIP_CHARS = 300
_VERL_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_VERL_FLEXIBLE = re.compile(r"(\-?[0-9\.\,]+)")


def extract_answer(text: str, method: str = "strict", convention: str = "verl") -> str | None:
    """The answer a completion gives, or ``None`` (see the module docstring for the conventions).

    ``strict``: the last ``#### number``. ``flexible``: the last number anywhere.
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"unknown extraction method {method!r}; use 'strict' or 'flexible'")
    if convention == "verl":
        text = text[-_VERL_CLIP_CHARS:]
        if method == "strict":
            found = _VERL_STRICT.findall(text)
            return found[-1].replace(",", "").replace("$", "") if found else None
        found = _VERL_FLEXIBLE.findall(text)
        valid = [m for m in found if m not in ("", ".")]
        # verl's loop leaves its first match (".") when every match is invalid: an "answer"
        # that earns format_score, kept for parity
        return valid[-1] if valid else (found[0] if found else None)
    if convention != "value":
        raise ValueError(f"unknown gsm8k reward convention {convention!r}; use one of {CONVENTIONS}")
    last = None
    for last in (_STRICT if method == "strict" else _FLEXIBLE).finditer(text):
        pass
    if last is None:
        return None
    start, end = last.span(1)
    if _GLUED_AFTER.match(text, end) or _GLUED_BEFORE.search(text[max(start - 64, 0):start]):
        return None
    return _clean(last.group(1))


def reward(completion: str, example: Example, *, convention: str = "verl", method: str = "strict",
           format_score: float = 0.0, score: float = 1.0) -> float:
    """``score`` if the extracted answer equals ``example.answer`` (as a string under ``"verl"``,
    by value under ``"value"``), ``format_score`` if an answer was extracted but differs, 0.0 if
    none was found."""
    answer = extract_answer(completion, method, convention)
    if answer is None:
        return 0.0
    same = answer == example.answer if convention == "verl" else _same_number(answer, example.answer)
    return score if same else format_score


def _clean(number: str) -> str | None:
    """``number`` without ``$``, spaces, a ``+`` sign, thousands commas and a trailing
    ``.``/``,`` (U+2212 read as ``-``); ``None`` when what is left is no number (commas that do
    not group thousands, two periods)."""
    cleaned = re.sub(r"[$\s+]", "", number).replace("\u2212", "-").rstrip(".,")
    return cleaned.replace(",", "") if _VALID.fullmatch(cleaned) else None


def _same_number(a: str, b: str) -> bool:
    a, b = a.replace(",", "").replace("$", "").strip(), b.replace(",", "").replace("$", "").strip()
    try:
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return a == b
