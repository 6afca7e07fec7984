"""Reading a corpus: documents one at a time from a list or a file, and shards of a file for the scan engines.

A corpus is a list of strings, or a path to `.txt` (one document a line), `.jsonl` (one JSON object a
line with a `text` field) or `.parquet` (a `text` column). Files are read one line / one row group at a
time, so a scan's memory does not grow with the size of the corpus file.
"""

from __future__ import annotations

import io
import itertools
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

SUFFIXES = (".txt", ".jsonl", ".parquet")
# Lines of .txt and .jsonl corpora end at "\n" only (a trailing "\r" is stripped): the same lines that
# count_documents counts and that the shard offsets of shard_sources start at. Python's default universal
# newlines would also split at a lone "\r" and number the documents differently from both.
LINE_END = "\n"

Corpus = str | os.PathLike | Iterable[str]


class CorpusError(ValueError):
    """The corpus cannot be read: missing file, unsupported extension, no `text` field, not strings."""


def iter_documents(corpus: Corpus, limit: int | None = None) -> Iterator[str]:
    """The documents of `corpus` one at a time (at most `limit`). Empty documents are kept: the scan skips
    them, but keeps their index, so a document's number is its list index, line or row number (from 0);
    in a .jsonl a blank line is no document at all (it holds no JSON object)."""
    if isinstance(corpus, str | os.PathLike):
        docs = _iter_file(Path(corpus))
    elif isinstance(corpus, bytes | dict) or not isinstance(corpus, Iterable):
        raise CorpusError(
            f"A corpus is a list of strings or a path to {', '.join(SUFFIXES)}, not {type(corpus).__name__}"
        )
    else:
        docs = _checked_strings(corpus)
    return itertools.islice(docs, limit) if limit is not None else docs


def count_documents(corpus: Corpus, limit: int | None = None) -> int | None:
    """How many documents the corpus has, for a progress bar's total: a list's length, a parquet footer's row
    count, a text file's lines (one pass over the bytes in 1 MB chunks: cheap next to running a model on
    them; blank jsonl lines are counted too). None when unknown (an iterator)."""
    n = None
    if isinstance(corpus, list | tuple):
        n = len(corpus)
    elif isinstance(corpus, str | os.PathLike) and Path(corpus).is_file():
        path = Path(corpus)
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            n = pq.ParquetFile(path).metadata.num_rows
        elif path.suffix in (".txt", ".jsonl"):
            n = _count_lines(path)
    return n if limit is None or n is None else min(n, limit)


def shard_sources(corpus: Corpus, limit: int | None, size: int) -> list[dict]:
    """Where each shard of `size` documents comes from, small enough to send to a Ray actor that reads it
    itself (`read_shard`): a file's shards are (path, byte offset or row, count), found in one pass over the
    file's lines (a parquet file's from its footer); a list's shards carry their texts (the list is in memory
    anyway). The documents and their numbers are iter_documents'."""
    if isinstance(corpus, str | os.PathLike):
        path = Path(corpus)
        _iter_file(path)  # the same errors as a local scan: missing file, unsupported suffix
        if path.suffix != ".parquet":
            return _line_shards(path, size, limit)
        total = _parquet_file(path).metadata.num_rows
        total = total if limit is None else min(total, limit)
        return [{"path": str(path), "row": start, "count": min(size, total - start), "first_doc": start}
                for start in range(0, total, size)]
    docs = list(iter_documents(corpus, limit))
    return [{"texts": docs[start:start + size], "first_doc": start} for start in range(0, len(docs), size)]


def read_shard(source: dict) -> list[str]:
    """The documents of one shard from `shard_sources`, exactly as iter_documents reads them."""
    if "texts" in source:
        return list(source["texts"])
    path, count = Path(source["path"]), int(source["count"])
    if path.suffix == ".parquet":
        return _parquet_rows(path, int(source["row"]), count)
    with path.open("rb") as raw:
        raw.seek(int(source["offset"]))
        lines = io.TextIOWrapper(raw, encoding="utf-8", newline=LINE_END)  # exactly as iter_documents reads
        reader = _txt_documents if path.suffix == ".txt" else _jsonl_documents
        return list(itertools.islice(reader(lines, path, int(source["line"])), count))


def _line_shards(path: Path, size: int, limit: int | None) -> list[dict]:
    """The shards of a .txt or .jsonl file: byte offset and line number (from 1) of each shard's first document
    and how many it has. In a .jsonl a blank line is no document: it never starts a shard and is not counted."""
    jsonl = path.suffix == ".jsonl"
    shards: list[dict] = []
    docs = offset = 0
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if docs == limit:
                break
            if not (jsonl and not line.decode("utf-8").strip()):  # str.strip, as _jsonl_documents decides
                if docs % size == 0:
                    shards.append({"path": str(path), "offset": offset, "line": number, "count": 0,
                                   "first_doc": docs})
                shards[-1]["count"] += 1
                docs += 1
            offset += len(line)
    return shards


def _parquet_rows(path: Path, row: int, count: int) -> list[str]:
    """Rows row..row+count-1 of the text column, reading only the row groups that hold them."""
    f = _parquet_file(path)
    groups, first, at = [], None, 0
    for g in range(f.num_row_groups):
        n = f.metadata.row_group(g).num_rows
        if at < row + count and at + n > row:
            groups.append(g)
            first = at if first is None else first
        at += n
    if not groups:
        return []
    table = f.read_row_groups(groups, columns=["text"]).slice(row - first, count)
    return [text or "" for text in table.column(0).to_pylist()]


def _count_lines(path: Path) -> int:
    lines, last = 0, b"\n"
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    return lines + (last != b"\n")  # a last line without its newline


def _iter_file(path: Path) -> Iterator[str]:
    if path.suffix not in SUFFIXES:
        raise CorpusError(f"Unsupported corpus file {str(path)!r}: expected one of {', '.join(SUFFIXES)}")
    if not path.is_file():
        raise CorpusError(f"No corpus file at {str(path)!r}")
    reader = {".txt": _iter_txt, ".jsonl": _iter_jsonl, ".parquet": _iter_parquet}[path.suffix]
    return reader(path)


def _iter_txt(path: Path) -> Iterator[str]:
    with path.open(encoding="utf-8", newline=LINE_END) as f:
        yield from _txt_documents(f, path, 1)


def _txt_documents(lines: Iterable[str], path: Path, first_line: int) -> Iterator[str]:
    for line in lines:
        yield line.rstrip("\n").rstrip("\r")


def _iter_jsonl(path: Path) -> Iterator[str]:
    with path.open(encoding="utf-8", newline=LINE_END) as f:
        yield from _jsonl_documents(f, path, 1)


def _jsonl_documents(lines: Iterable[str], path: Path, first_line: int) -> Iterator[str]:
    for number, line in enumerate(lines, first_line):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise CorpusError(f"{path}:{number} is not valid JSON: {e}") from e
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise CorpusError(f"{path}:{number} has no string field 'text' (each line must be {{\"text\": ...}})")
        yield row["text"]


def _parquet_file(path: Path):
    """The opened parquet file, with a clear error if it has no `text` column."""
    import pyarrow.parquet as pq

    f = pq.ParquetFile(path)
    if "text" not in f.schema_arrow.names:
        raise CorpusError(f"{path} has no 'text' column (columns: {f.schema_arrow.names})")
    return f


def _iter_parquet(path: Path) -> Iterator[str]:
    f = _parquet_file(path)
    for batch in f.iter_batches(columns=["text"], batch_size=1024):
        for text in batch.column(0).to_pylist():
            yield text or ""


def _checked_strings(docs: Iterable[str]) -> Iterator[str]:
    for i, doc in enumerate(docs):
        if not isinstance(doc, str):
            raise CorpusError(f"Document {i} is {type(doc).__name__}, not str (a corpus is a list of strings)")
        yield doc
