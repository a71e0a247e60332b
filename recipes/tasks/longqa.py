"""Long-context multi-document QA: many passages (thousands of tokens), one short answer.

``load(split, source=None)`` accepts these record shapes (``.json``/``.jsonl``/``.parquet``
files, a directory holding ``<split>.*``, or an HF id, optionally ``"id:config"`` such as
``"hotpotqa/hotpot_qa:distractor"`` or ``"THUDM/LongBench:hotpotqa"``):

- HotpotQA / 2WikiMultihopQA: ``question``, ``answer``, ``context`` as ``[[title, [sentences]]]``
  (or HF's ``{"title": [...], "sentences": [[...]]}``);
- MuSiQue: ``question``, ``answer``, ``answer_aliases``, ``paragraphs`` of
  ``{"title", "paragraph_text"}``;
- LongBench: ``input`` (the question), ``context`` (one long string), ``answers`` (a list);
- SQuAD (HF layout): ``question``, ``context`` (one string), ``answers`` as
  ``{"text": [...], "answer_start": [...]}`` (every text accepted); SQuAD's nested JSON
  (``data`` / ``paragraphs`` / ``qas``) must be flattened to one record per question first;
- the bundled format: ``question``, ``answers``, ``passages`` of ``{"title", "text"}``.

``answers`` may also be a list of ``{"text": ...}`` objects. A string ``context`` is split into
passages at blank lines. A record marked unanswerable (SQuAD v2's ``is_impossible`` or empty
``answers``, MuSiQue-Full's ``answerable: false``) is refused with ``ValueError``: its
``answer`` is not supported by its passages, so no reward could be right.

``source=None`` is the bundled sample (``recipes/data/longqa``): generated people, towns and
companies with facts, 1- and 2-hop questions, and ~20 passages per question of which most are
distractors. The prompt lists every passage and asks for the answer in ``\\boxed{}``.

``reward(completion, example, mode="em")`` takes the last ``\\boxed{...}`` of the completion and
scores it against every accepted answer after SQuAD normalisation (lower case, no punctuation,
no articles ``a``/``an``/``the``, single spaces): exact match (1/0) or, with ``mode="f1"``, the
best token F1. Two deliberate differences from SQuAD's script: punctuation is every Unicode
punctuation character (``–``, ``“”``, ``’``, ``。``), not ASCII only, so ``1939–1945`` matches
``1939-1945`` and ``“Oslo”`` matches ``Oslo``; and text is composed to Unicode NFC first, so an
answer stored decomposed (``u`` + U+0308) matches ``ü``. In the box, text-style LaTeX macros
are unwrapped (``\\text{}``, ``\\textbf{}``, ``\\mathrm{}``, ``\\emph{}``, ...) and ``~`` is a
space. An accepted answer that normalises to nothing (``""``, ``"the"``, ``"..."``) would let
an empty box match: ``load`` drops such answers (``ValueError`` when none is left) and
``reward`` never matches them. No box or an empty box scores 0; a last box that never closed (a
truncated completion) is skipped for the last closed box before it, if any.
"""
from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter

from .common import DATA_DIR, Example, field, load_records

NAME = "longqa"
INSTRUCTION = ("Answer the question using the passages. Think step by step, then give only the "
               "final answer as \\boxed{answer}.")


def load(split: str, source: str | None = None) -> list[Example]:
    """Examples of ``split`` (module docstring for the accepted sources and shapes).

    Returns:
        ``Example(prompt, answer=<first answer>, meta={"answers": [...], "question",
        "num_passages"})``.
    """
    records = load_records(NAME, split, source, DATA_DIR / NAME)
    examples = []
    for i, record in enumerate(records):
        question, answers, passages = _normalise(record, i)
        answers = _scorable(answers, i)
        examples.append(Example(make_prompt(question, passages), answers[0],
                                {"answers": answers, "question": question,
                                 "num_passages": len(passages)}))
    return examples


def _normalise(record, i: int) -> tuple[str, list[str], list[tuple[str, str]]]:
    """(question, answers, [(title, text)]) of a record in any accepted shape."""
    if isinstance(record, dict) and "input" in record and "answers" in record:  # LongBench
        question = field(NAME, record, i, "input")
        context = field(NAME, record, i, "context")
        return question, _answers(record, i, "answers"), _split_paragraphs(context)
    if isinstance(record, dict) and "question" not in record and "paragraphs" in record:
        raise ValueError(f"{NAME} record {i}: has 'paragraphs' but no 'question': SQuAD's nested "
                         "JSON (data / paragraphs / qas)? Flatten it to one record per question")
    question = field(NAME, record, i, "question")
    _refuse_unanswerable(record, i)
    if "passages" in record:
        items = field(NAME, record, i, "passages", list)
        passages = [(_item(p, i, "passages", "title"), _item(p, i, "passages", "text"))
                    for p in items]
    elif "paragraphs" in record:  # MuSiQue
        items = field(NAME, record, i, "paragraphs", list)
        passages = [(_item(p, i, "paragraphs", "title"),
                     _item(p, i, "paragraphs", "paragraph_text")) for p in items]
    elif isinstance(record.get("context"), str):  # SQuAD: one document
        passages = _split_paragraphs(record["context"])
    elif "context" in record:  # HotpotQA / 2Wiki
        passages = _hotpot_context(field(NAME, record, i, "context", (list, dict)), i)
    else:
        raise ValueError(f"{NAME} record {i}: missing field 'passages' (or 'paragraphs' / "
                         "'context')")
    if not passages:
        raise ValueError(f"{NAME} record {i}: no passages")
    if "answers" in record:
        answers = _answers(record, i, "answers")
    else:
        answers = [field(NAME, record, i, "answer")]
        aliases = record.get("answer_aliases") or []
        answers += [a for a in aliases if isinstance(a, str) and a not in answers]
    return question, answers, passages


def _split_paragraphs(context: str) -> list[tuple[str, str]]:
    return [("", p.strip()) for p in re.split(r"\n\s*\n", context) if p.strip()]


def _refuse_unanswerable(record: dict, i: int) -> None:
    """``ValueError`` for a record its dataset marks unanswerable (SQuAD v2 ``is_impossible``,
    MuSiQue-Full ``answerable: false``): its ``answer`` is not supported by its passages."""
    if record.get("is_impossible") is True or record.get("answerable") is False:
        flag = "'is_impossible': true" if record.get("is_impossible") is True \
            else "'answerable': false"
        raise ValueError(f"{NAME} record {i}: marked unanswerable ({flag}); there is no gold "
                         "answer to score: filter such records out")


def _answers(record: dict, i: int, name: str) -> list[str]:
    """Accepted answers: a string, a list of strings/numbers or of SQuAD's ``{"text": ...}``
    items, or HF SQuAD's ``{"text": [...], "answer_start": [...]}``."""
    value = field(NAME, record, i, name, (list, str, dict))
    if isinstance(value, dict):
        if not isinstance(value.get("text"), list):
            raise ValueError(f"{NAME} record {i}: field {name!r} is an object without a "
                             "'text' list")
        value = value["text"]
    if isinstance(value, str):
        value = [value]
    answers = []
    for a in value:
        if isinstance(a, dict):
            a = a.get("text")
        if isinstance(a, bool) or not isinstance(a, (str, int, float)):
            if a is None:
                continue
            raise ValueError(f"{NAME} record {i}: field {name!r}: an answer must be text (or an "
                             f"object with a 'text'), got {type(a).__name__}")
        answers.append(str(a))
    answers = list(dict.fromkeys(answers))  # SQuAD repeats an answer once per annotator
    if not answers:
        raise ValueError(f"{NAME} record {i}: field {name!r} is empty (an unanswerable question, "
                         "as in SQuAD v2, has no gold answer to score: filter such records out)")
    return answers


def _scorable(answers: list[str], i: int) -> list[str]:
    """``answers`` without those that normalise to nothing (an empty box would match them);
    ``ValueError`` naming the record when none is left."""
    kept = [a for a in answers if normalize_answer(a)]
    if not kept:
        raise ValueError(f"{NAME} record {i}: no answer has any text left after normalisation "
                         f"(lower case, no punctuation or articles): {answers!r}")
    return kept


def _item(p, i: int, container: str, key: str) -> str:
    if not isinstance(p, dict) or not isinstance(p.get(key), str):
        raise ValueError(f"{NAME} record {i}: field {container!r}: every item needs a text "
                         f"{key!r}")
    return p[key]


def _hotpot_context(context, i: int) -> list[tuple[str, str]]:
    if isinstance(context, dict):  # the HF datasets layout
        titles, sentences = context.get("title"), context.get("sentences")
        if not (isinstance(titles, list) and isinstance(sentences, list)
                and len(titles) == len(sentences)):
            raise ValueError(f"{NAME} record {i}: field 'context': needs 'title' and 'sentences' "
                             "lists of the same length")
        context = list(zip(titles, sentences, strict=True))
    out = []
    for item in context:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError(f"{NAME} record {i}: field 'context': items must be [title, "
                             "sentences]")
        sentences = item[1]
        text = sentences if isinstance(sentences, str) else " ".join(s.strip() for s in sentences)
        out.append((item[0], text))
    return out


def make_prompt(question: str, passages: list[tuple[str, str]]) -> str:
    blocks = [f"Passage {k} ({title}): {text.strip()}" if title else f"Passage {k}: {text.strip()}"
              for k, (title, text) in enumerate(passages, 1)]
    return "\n\n".join(blocks) + f"\n\nQuestion: {question.strip()}\n{INSTRUCTION}"


def extract_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` (nested braces allowed), or ``None``."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, k = 0, start + len("\\boxed")
        for j in range(k, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[k + 1:j]
        start = text.rfind("\\boxed{", 0, start)  # unclosed: try an earlier one
    return None


# \text{...} and the other LaTeX macros that only set text in a style; "~" is an unbreakable space
_TEXT_MACRO = re.compile(r"\\(?:text(?:bf|it|rm|sf|tt|normal|up)?|math(?:rm|bf|it|sf|tt)"
                         r"|emph|mbox|operatorname)\{([^{}]*)\}")


def unwrap_latex(box: str) -> str:
    """``box`` with every text-style macro replaced by its argument, innermost first
    (``\\text{\\emph{Eful} River}`` -> ``Eful River``), and ``~`` by a space; other LaTeX
    (``\\frac{a}{b}``) is left as it is."""
    while True:
        unwrapped = _TEXT_MACRO.sub(r"\1", box)
        if unwrapped == box:
            return box.replace("~", " ")
        box = unwrapped


_ASCII_PUNCT = frozenset(string.punctuation)


def _is_punct(ch: str) -> bool:
    return ch in _ASCII_PUNCT or unicodedata.category(ch).startswith("P")


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lower case, drop punctuation (ASCII and every Unicode ``P*``
    character; SQuAD drops ASCII only) and articles, collapse whitespace; the text is composed
    to Unicode NFC first (SQuAD does not), so a decomposed ``u`` + U+0308 equals ``ü``."""
    s = unicodedata.normalize("NFC", s.lower())
    s = "".join(ch for ch in s if not _is_punct(ch))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1_score(prediction: str, truth: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def reward(completion: str, example: Example, *, mode: str = "em") -> float:
    """Exact match (``mode="em"``) or best token F1 (``mode="f1"``) of the last ``\\boxed{}``
    answer against ``example.meta["answers"]`` (or ``example.answer``), both normalised by
    :func:`normalize_answer`; 0.0 without a box. Answers that normalise to nothing are ignored
    (``ValueError`` when no other is left: the example cannot be scored)."""
    if mode not in ("em", "f1"):
        raise ValueError(f"unknown longqa reward mode {mode!r}; use 'em' or 'f1'")
    predicted = extract_boxed(completion)
    if predicted is None:
        return 0.0
    predicted = unwrap_latex(predicted)
    answers = [a for a in example.meta.get("answers") or [example.answer] if normalize_answer(a)]
    if not answers:
        raise ValueError(f"{NAME}: no accepted answer has text left after normalisation: "
                         f"{example.meta.get('answers') or [example.answer]!r}")
    if mode == "em":
        return float(any(normalize_answer(predicted) == normalize_answer(a) for a in answers))
    return max(f1_score(predicted, a) for a in answers)
