"""Built-in circuit tasks: prompt pairs made for the loaded tokenizer, no download.

    task = ioi_task(m, n=16)             # indirect object identification (Wang et al. 2022)
    c = slmviz.circuit(task, model=m, method="eap-ig")
    task.frame()                          # clean, corrupted, answer, wrong

- `ioi_task`: "When Mary and John went to the store, John gave a drink to" -> " Mary" (the indirect object) vs
  " John" (the subject); the corrupted prompt names a third person in the subject's second place (EAP-IG's IOI
  data), so nothing in it says which of the first two names is the answer. Only names that are one token
  (with their leading space) in this tokenizer are used, so the pairs have equal lengths.
- `induction_task`: a random token sequence followed by its first k tokens -> the token that followed them the
  first time, against the same continuation after an unrepeated random sequence (the corrupted prompt). Prompts
  are token ids: a random token string need not survive a round trip through text.
- `greater_than_task`: the greater-than task (Hanna et al. 2023) with digit-split numbers. Both bundled
  tokenizers split " 1732" into " ", "1", "7", "3", "2", so "from the year 1732 to the year 17" is followed by
  one digit, the end year's tens digit; the metric is the probability of the digits above the start's tens
  digit minus those below it (the equal digit depends on the units), and the corrupted start year ends in "01".
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

# Common first names, most of them one token with a leading space in BPE vocabularies of English text.
NAMES = ["Mary", "John", "Tom", "James", "Anna", "Paul", "David", "Sarah", "Michael", "Lisa", "Mark", "Laura",
         "Peter", "Kate", "Daniel", "Emma", "Robert", "Alice", "Steven", "Susan", "Brian", "Amy", "Kevin",
         "Linda", "Jason", "Karen", "Eric", "Rachel", "Adam", "Helen", "Scott", "Julie", "Ryan", "Jessica",
         "Andrew", "Rose", "George", "Grace", "Henry", "Jane", "Jack", "Lucy", "Sam", "Ben", "Dan", "Joe", "Max"]
IOI_TEMPLATES = [
    "When {A} and {B} went to the store, {S} gave a drink to",
    "When {A} and {B} went to the park, {S} gave a ball to",
    "Then, {A} and {B} were working at the house. {S} decided to give a book to",
    "After {A} and {B} went to the restaurant, {S} gave a ring to",
    "While {A} and {B} were walking to the office, {S} handed a letter to",
    "Friends {A} and {B} found a bone at the garden. {S} gave it to",
]
YEAR_TEMPLATES = [
    "The war lasted from the year 17{YY} to the year 17",
    "The contract lasted from the year 16{YY} to the year 16",
    "The building was used from the year 18{YY} to the year 18",
    "The king ruled from the year 15{YY} to the year 15",
]


@dataclass
class Task:
    """Prompt pairs for `slmviz.circuit` / `patch_edges`: clean and corrupted prompts (strings or token ids), the
    answer and wrong token of each pair (or `metrics`, one fn(logits [pos, vocab]) per pair)."""

    name: str
    clean: list[Any]
    corrupted: list[Any]
    answers: list[Any] | None = None
    wrongs: list[Any] | None = None
    metrics: list[Callable[[torch.Tensor], Any]] | None = None
    description: str = ""
    details: list[dict[str, Any]] = field(default_factory=list, repr=False)

    def __len__(self) -> int:
        return len(self.clean)

    def frame(self, model: Any = None) -> pd.DataFrame:
        """One row per pair: clean, corrupted, answer, wrong (token ids shown as text when `model` is given)."""
        def show(x: Any) -> Any:
            if model is not None and not isinstance(x, str) and x is not None:
                ids = [x] if isinstance(x, int) else list(x)
                return "".join(model.to_strings(ids))
            return x

        rows = []
        for i in range(len(self)):
            row = {"clean": show(self.clean[i]), "corrupted": show(self.corrupted[i])}
            if self.answers is not None:
                row["answer"], row["wrong"] = show(self.answers[i]), show(self.wrongs[i] if self.wrongs else None)
            rows.append({**row, **(self.details[i] if i < len(self.details) else {})})
        return pd.DataFrame(rows)


def _tokenizer(model: Any) -> Any:
    if model.tokenizer is None:
        raise ValueError(f"{model.name} has no tokenizer; this task writes text (use induction_task, which takes ids)")
    return model.tokenizer


def _single_ids(model: Any, texts: list[str]) -> dict[str, int]:
    """{text: id} for the texts that are exactly one token of their own (not the unknown token, not shared)."""
    tok = _tokenizer(model)
    unknown = getattr(tok, "unk_token_id", None)
    found: dict[str, int] = {}
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) == 1 and ids[0] != unknown and ids[0] not in found.values():
            found[text] = ids[0]
    return found


def one_token_names(model: Any, names: list[str] = NAMES) -> list[str]:
    """The names that are exactly one token (of their own) with a leading space in this model's tokenizer."""
    single = _single_ids(model, [" " + n for n in names])
    return [n for n in names if " " + n in single]


def ioi_task(model: Any, n: int = 16, seed: int = 0, templates: list[str] = IOI_TEMPLATES) -> Task:
    """n IOI pairs. Clean: "... {A} and {B} ... {B} gave ... to" (the two first names in either order), answer " A"
    (the indirect object), wrong " B" (the subject). Corrupted: the subject's second mention is a third name C."""
    names = one_token_names(model)
    if len(names) < 3:
        raise ValueError(f"IOI needs 3 names that are one token each in {model.name}'s tokenizer; found {names}")
    rng = random.Random(seed)
    clean, corrupted, answers, wrongs, details = [], [], [], [], []
    for i in range(n):
        template = templates[i % len(templates)]
        io, s, c = rng.sample(names, 3)
        first, second = (io, s) if rng.random() < 0.5 else (s, io)
        clean.append(template.format(A=first, B=second, S=s))
        corrupted.append(template.format(A=first, B=second, S=c))
        answers.append(" " + io)
        wrongs.append(" " + s)
        details.append({"template": template, "order": "ABB" if first == io else "BAB"})
    return Task("ioi", clean, corrupted, answers, wrongs, description=(
        "indirect object identification: the name that is not repeated; corrupted: the repeated name replaced"),
        details=details)


def word_tokens(model: Any, count: int, rng: random.Random) -> list[int]:
    """`count` distinct token ids that look like words (a leading space, then letters), or any ordinary ids when
    the model has no tokenizer (never its special tokens)."""
    vocab = model.cfg.vocab_size
    tok = model.tokenizer
    special = set(getattr(tok, "all_special_ids", []) or [])
    picked: list[int] = []
    tries = 0
    while len(picked) < count:
        tries += 1
        if tries > 200 * count:
            raise ValueError(f"Could not find {count} ordinary tokens in {model.name}'s vocabulary")
        i = rng.randrange(vocab)
        if i in special or i in picked:
            continue
        if tok is not None and len(tok) > 1000:  # a real vocabulary: prefer whole words, as in ordinary text
            text = tok.decode([i])
            if not (len(text) > 2 and text[0] == " " and text[1:].isalpha() and text[1:].isascii()):
                continue
        elif tok is not None and i >= len(tok):
            continue
        picked.append(i)
    return picked


def induction_task(model: Any, n: int = 16, length: int = 10, seed: int = 0) -> Task:
    """n induction pairs of token ids. Clean: [BOS] + A + A[:k] (A `length` random word tokens, k between length/2
    and length - 1), answer A[k]. Corrupted: [BOS] + B + A[:k] with B another random sequence, wrong B[k]."""
    if length < 3:
        raise ValueError(f"length must be at least 3, got {length}")
    rng = random.Random(seed)
    prefix = list(model.tokenizer("")["input_ids"]) if model.tokenizer is not None else []
    clean, corrupted, answers, wrongs = [], [], [], []
    for _ in range(n):
        ids = word_tokens(model, 2 * length, rng)
        a, b = ids[:length], ids[length:]
        k = rng.randrange(length // 2, length)
        clean.append(prefix + a + a[:k])
        corrupted.append(prefix + b + a[:k])
        answers.append(a[k])
        wrongs.append(b[k])
    return Task("induction", clean, corrupted, answers, wrongs,
                description="a repeated random token sequence (answer: the next repeated token) vs an unrepeated one")


def digit_ids(model: Any) -> list[int]:
    """The token ids of "0" ... "9", checked to be single tokens (the digit-split tokenizers' digits)."""
    ids = _single_ids(model, [str(d) for d in range(10)])
    if len(ids) != 10:
        raise ValueError(f"{model.name}'s tokenizer does not have one token per digit; greater_than_task needs it")
    return [ids[str(d)] for d in range(10)]


def greater_than_metric(digits: list[int], tens: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """fn(logits [pos, vocab]): P(next digit > tens) - P(next digit < tens) at the last position, the probabilities
    taken over the whole vocabulary (Hanna et al.'s probability difference, one digit at a time)."""

    def metric(logits: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(logits[..., -1, :].double(), dim=-1)[..., digits]  # [..., 10]
        return probs[..., tens + 1:].sum(-1) - probs[..., :tens].sum(-1)

    metric.__name__ = "P(tens digit > the start's) - P(< it)"  # one name for every pair of the task
    metric.last_only = True  # type: ignore[attr-defined]  # reads the last position only (circuits skip the rest)
    return metric


def greater_than_task(model: Any, n: int = 16, seed: int = 0, templates: list[str] = YEAR_TEMPLATES) -> Task:
    """n greater-than pairs. Clean: "... from the year 17YY to the year 17" with YY in 21..89 (the tens digit 2..8),
    metric P(digit > Y) - P(digit < Y) for the tens digit Y. Corrupted: the start year ends in 01 instead."""
    digits = digit_ids(model)
    rng = random.Random(seed)
    clean, corrupted, metrics, details = [], [], [], []
    for i in range(n):
        template = templates[i % len(templates)]
        yy = rng.randrange(21, 90)
        while yy % 10 == 0:
            yy = rng.randrange(21, 90)
        clean.append(template.format(YY=f"{yy:02d}"))
        corrupted.append(template.format(YY="01"))
        metrics.append(greater_than_metric(digits, yy // 10))
        details.append({"year": yy, "tens": yy // 10})
    return Task("greater-than", clean, corrupted, metrics=metrics, details=details, description=(
        "greater-than over digit tokens: P(tens digit > the start's) - P(below it); corrupted: the start ends in 01"))


TASKS = {"ioi": ioi_task, "induction": induction_task, "greater-than": greater_than_task}


def task(name: str, model: Any, **kwargs: Any) -> Task:
    """A built-in task by name: "ioi", "induction" or "greater-than"."""
    if name not in TASKS:
        raise ValueError(f"Unknown task {name!r}; built-in tasks are {', '.join(TASKS)}")
    return TASKS[name](model, **kwargs)
