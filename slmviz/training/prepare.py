"""The full transcoder sets of the bundled models, prepared once into $SLMVIZ_CACHE by one command.

    slmviz prepare --transcoders plt [--model SmolLM2-135M-Instruct]     # or: make transcoders
    ts = slmviz.load_transcoders("plt", model=m)

A set is hundreds of MB (SmolLM2's: 30 layers x (2 x 4096 x 576 + 576²) fp32 weights), too much for the repository
or the wheel, so it is *trained* here from a fixed recipe (RECIPES), seeded, on the "mixed" corpus (the broad
corpus interleaved with the model's own chat and prose: features.generated_corpus), into
$SLMVIZ_CACHE/transcoders/{model}/{kind}/. The run checkpoints as it goes (train_transcoders), so an interrupted
`prepare` resumes where it stopped; a finished one returns at once. How long each takes on a 2-core CPU and how large
it is: docs/features.md ("Full transcoder sets").
"""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..replacement.prepared import prepared_dir

# One recipe per (model, kind). Chosen for a 2-core CPU; docs/features.md records what each costs and scores.
RECIPES: dict[tuple[str, str], dict[str, Any]] = {
    ("SmolLM2-135M-Instruct", "plt"): dict(d_sae=4096, k=64, tokens=500_000, architecture="batchtopk", skip=True,
                                           batch_tokens=512, buffer_tokens=16_384, lr=2e-3, dead_window=100_000,
                                           seed=0),
    ("gemma-3-270m", "plt"): dict(d_sae=4096, k=64, tokens=300_000, architecture="batchtopk", skip=True,
                                  batch_tokens=512, buffer_tokens=16_384, lr=2e-3, dead_window=100_000, seed=0),
    # As many parameters as the PLT recipe (512 x (30 + 465) x 576 = 146M, features.clt_train), the same corpus,
    # tokens and settings. The pre-activation loss keeps its k: without it the features per token fell from 32 to
    # ~5 (docs/cross-layer-transcoders.md); probes of 8k tokens kept 29 at 0.01 and 32 at 0.1.
    ("SmolLM2-135M-Instruct", "clt"): dict(d_sae=512, k=32, tokens=500_000, architecture="batchtopk", skip=True,
                                           batch_tokens=512, buffer_tokens=16_384, lr=2e-3, dead_window=100_000,
                                           pre_act_coefficient=0.03, seed=0),
}
CORPUS = "mixed"
# The feature scan prepared with a set (its cards' top contexts and densities): the first SCAN_DOCS documents of the
# held-out split of the set's corpus, each cut to its first SCAN_CHARS characters (the broad corpus's documents are
# whole source files), SCAN_TOP_K contexts per feature; every coder spliced at once (error terms on, so each reads
# the model's own input, as when scanned alone). What bounds it: a scan costs per token *and coder* (the features'
# histograms and top-k), ~1.5 ms per coder-token on this 2-core CPU at load average ~9 (SmolLM2, 4096 features: 6
# coders over 2,906 tokens took 31 s, one coder 8.5 s). 200 documents of 400 characters are 20,434 SmolLM2 tokens
# of the broad corpus's held-out split, so 30 coders take ~15 min at that load (estimated from the rate, not run),
# where 1,000 whole documents (~420k tokens) would take hours. At an L0 of 64 over 4,096 features, a feature still
# fires ~300 times in 20k tokens: enough for its top 10 contexts.
SCAN_DOCS, SCAN_CHARS, SCAN_TOP_K, SCAN_FOLDER = 200, 400, 10, "scan"


REQUIRED = ("d_sae", "k", "tokens")  # what a recipe must fix; the rest defaults as in train_transcoders


def recipe(model: Any, kind: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fixed recipe of (model, kind) updated by `overrides`; for a model without one, `overrides` alone when it
    names every REQUIRED argument (a tiny model's set in the app's tests, or a set of a model loaded from a folder)."""
    name = model if isinstance(model, str) else str(getattr(model, "name", ""))
    overrides = dict(overrides or {})
    if (name, kind) in RECIPES:
        return {**RECIPES[(name, kind)], **overrides}
    if all(key in overrides for key in REQUIRED):
        return overrides
    known = ", ".join(f"{m} {k}" for m, k in RECIPES)
    missing = ", ".join(key for key in REQUIRED if key not in overrides)
    raise ValueError(f"no prepared {kind!r} recipe for {name!r} (recipes: {known}); pass {missing} to "
                     "prepare_transcoders, or train one yourself with slmviz.train_transcoders(model, layers='all', "
                     "..., out=folder)")


def prepare_transcoders(model: Any, kind: str = "plt", progress: Any = True, scan_progress: Any = None,
                        **overrides: Any) -> Any:
    """Train (or resume, or load when finished) `model`'s prepared `kind` set into $SLMVIZ_CACHE, then its feature
    scan (prepare_set_scan: no card waits for one); returns the set.

    `overrides`: train_transcoders arguments over the recipe (`corpus=` replaces CORPUS: a corpus name, a file or a
    list of texts); they are what makes a set for a model without a recipe (recipe()). `scan_progress`: the scan's
    fn(docs done, total) (default: a bar when `progress` is True, else none)."""
    from ..corpora.named import resolve_corpus
    from .train_sae import CheckpointError
    from .train_set import train_transcoders

    args = recipe(model, kind, overrides)
    corpus_name = args.pop("corpus", CORPUS)
    out = prepared_dir(model, kind)
    corpus = resolve_corpus(corpus_name, model)
    command = "slmviz prepare --transcoders " + shlex.join([kind, "--model", model.name])
    said = corpus_name if isinstance(corpus_name, str) else "custom"
    try:
        ts = train_transcoders(model, layers="all", corpus=corpus, kind=kind, out=out, progress=progress,
                               name=f"{model.name}-{kind}", metadata={"training_command": command,
                                                                     "corpus_name": said}, **args)
    except CheckpointError as e:  # a set prepared by an earlier recipe (or other overrides): say what to do here
        raise CheckpointError(f"the prepared {kind.upper()} in {out} was trained by another recipe than this "
                              f"slmviz's: {e}. It still loads (slmviz.load_transcoders({kind!r}, model=m)); to "
                              f"prepare the current recipe, delete that folder and run `{command}` again") from e
    scanned = corpus_name if isinstance(corpus_name, str) else list(corpus_name)
    shown = scan_progress if scan_progress is not None else progress is True
    prepare_set_scan(model, ts, kind, corpus=scanned, progress=shown)  # a CLT's too: one unit per layer, spliced
    prepare_sae_scans(model, corpus=scanned, progress=shown)  # the bundled SAEs' cards read the same text
    return ts


def scan_docs(model: Any, corpus: Any = CORPUS, n: int = SCAN_DOCS, chars: int = SCAN_CHARS) -> list[str]:
    """The documents a set's feature scan reads: the first `n` of the corpus's held-out split (a corpus name), or of
    the file or list given, each cut to its first `chars` characters."""
    from ..corpora.named import resolve_corpus
    from ..corpora.reading import iter_documents

    return [doc[:chars] for doc in iter_documents(resolve_corpus(corpus, model, split="heldout"), limit=n)]


def prepare_set_scan(model: Any, ts: Any, kind: str = "plt", corpus: Any = CORPUS, n_docs: int = SCAN_DOCS,
                     progress: Any = True) -> tuple[Any, list[str]]:
    """The feature scan of every coder of the prepared set `ts` (slmviz.scan, the set spliced), kept beside it in
    $SLMVIZ_CACHE/transcoders/{model}/{kind}/scan with the documents it read; computed once, then read.
    Returns (Scan, docs): what a feature card takes (features.dashboard.feature_card(scan=, docs=))."""
    from ..features.dashboard import acts_hook
    from ..scans.scan import scan

    found = load_set_scan(model, kind)
    if found is not None:
        return found
    docs = scan_docs(model, corpus, n_docs)
    s = scan(docs, hooks=[acts_hook(c) for c in ts], saes=list(ts), model=model, top_k=SCAN_TOP_K,
             progress=progress)
    _save_scan(s, docs, prepared_dir(model, kind) / SCAN_FOLDER)
    return s, docs


def load_set_scan(model: Any, kind: str = "plt") -> tuple[Any, list[str]] | None:
    """(Scan, docs) prepared with the model's `kind` set, or None when there is none yet."""
    return _load_scan(prepared_dir(model, kind) / SCAN_FOLDER)


def sae_scan_dir(model: Any, name: str) -> Path:
    """Where a bundled SAE's prepared feature scan is kept: $SLMVIZ_CACHE/feature_scans/{model}/{name}."""
    from ..loading.bundled import cache_dir

    model_name = model if isinstance(model, str) else str(getattr(model, "name", ""))
    return cache_dir() / "feature_scans" / model_name / name


def weights_digest(sae: Any) -> str:
    """sha1 of an SAE's tensors: a prepared scan is read only for the weights it was made with."""
    h = hashlib.sha1()
    for name, tensor in sorted(sae.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def prepare_sae_scans(model: Any, saes: dict[str, Any] | None = None, corpus: Any = CORPUS, n_docs: int = SCAN_DOCS,
                      progress: Any = True) -> dict[str, Path]:
    """The feature scan of each SAE in `saes` ({name: SAE}; default: the model's bundled ones) over the same
    documents as a set's scan (scan_docs), kept in sae_scan_dir with its weights' digest; computed once per
    weights. Returns {name: folder}."""
    from ..features.bundled import bundled_saes
    from ..features.dashboard import acts_hook
    from ..features.load import load_sae
    from ..scans.scan import scan

    if saes is None:
        saes = {name: load_sae(name, model=model) for name in bundled_saes(model)}
    docs = None
    for name, sae in saes.items():
        if load_sae_scan(model, name, sae) is None:
            docs = docs if docs is not None else scan_docs(model, corpus, n_docs)
            s = scan(docs, hooks=[acts_hook(sae)], saes=[sae], model=model, top_k=SCAN_TOP_K, progress=progress)
            _save_scan(s, docs, sae_scan_dir(model, name), weights=weights_digest(sae))
    return {name: sae_scan_dir(model, name) for name in saes}


def load_sae_scan(model: Any, name: str, sae: Any) -> tuple[Any, list[str]] | None:
    """(Scan, docs) prepared for the SAE `name` with these weights, or None (none yet, or other weights)."""
    folder = sae_scan_dir(model, name)
    try:
        made_for = json.loads((folder / "weights.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return _load_scan(folder) if made_for == weights_digest(sae) else None


def _save_scan(s: Any, docs: list[str], folder: Path, weights: str | None = None) -> None:
    """The scan, its documents (and the weights it was made with) written aside, then renamed into `folder`: a
    half-written scan is never read. An older one there (other weights) is replaced."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    s.save(tmp)
    (tmp / "docs.json").write_text(json.dumps(docs), encoding="utf-8")
    if weights is not None:
        (tmp / "weights.json").write_text(json.dumps(weights), encoding="utf-8")
    if folder.exists():
        shutil.rmtree(folder, ignore_errors=True)
    try:
        tmp.rename(folder)
    except OSError:  # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)


def _load_scan(folder: Path) -> tuple[Any, list[str]] | None:
    from ..scans.scan import Scan

    if not (folder / "scan.safetensors").is_file() or not (folder / "docs.json").is_file():
        return None
    return Scan.load(folder), json.loads((folder / "docs.json").read_text(encoding="utf-8"))
