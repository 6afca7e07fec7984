"""The prepared transcoder sets of the bundled models, each trained once into $SLMVIZ_CACHE by one command.

    slmviz prepare --transcoders plt [--model SmolLM2-135M-Instruct]     # or: make transcoders
    ts = slmviz.load_transcoders("plt", model=m)
    slmviz prepare --transcoders plt-quick                              # a smaller set, ready in minutes

A set is hundreds of MB (SmolLM2's: 30 layers x (2 x 4096 x 576 + 576²) fp32 weights), too much for the repository
or the wheel, so it is *trained* here from a fixed recipe (RECIPES), seeded, on the "mixed" corpus (the broad
corpus interleaved with the model's own chat and prose: corpora.generated), into
$SLMVIZ_CACHE/transcoders/{model}/{kind}/. The run checkpoints as it goes (train_transcoders), so an interrupted
`prepare` resumes where it stopped; a finished one returns at once. How long each takes on a 2-core CPU and how large
it is: docs/features.md ("Full transcoder sets").
"""

from __future__ import annotations

import shlex
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from filelock import FileLock, Timeout

from ..features.prepared_scans import CORPUS, prepare_deep_scan, prepare_sae_scans, prepare_set_scan
from ..formats.checkpoint import CheckpointError
from ..loading.bundled import prepared_dir
from .train import train_transcoders

# One recipe per (model, prepared name). Chosen for a 2-core CPU; docs/features.md records what each costs and scores.
# A name that is not a trainer's kind ("plt", "clt") trains as TRAINED_AS says.
RECIPES: dict[tuple[str, str], dict[str, Any]] = {
    ("SmolLM2-135M-Instruct", "plt"): dict(d_sae=4096, k=64, tokens=500_000, architecture="batchtopk", skip=True,
                                           batch_tokens=512, buffer_tokens=16_384, lr=2e-3, dead_window=100_000,
                                           seed=0),
    ("gemma-3-270m", "plt"): dict(d_sae=4096, k=64, tokens=300_000, architecture="batchtopk", skip=True,
                                  batch_tokens=512, buffer_tokens=16_384, lr=2e-3, dead_window=100_000, seed=0),
    # The quick set: the full recipe at a quarter of the width and an eighth of the tokens, on the "quick" corpus
    # (six of the chat corpus's seeds instead of 95), so a fresh machine has a readable graph in minutes.
    # bench/studies/quick_set_curve.py holds the curve behind the choice; docs/features.md ("The quick set") its cost
    # and scores.
    ("SmolLM2-135M-Instruct", "plt-quick"): dict(corpus="quick", d_sae=1024, k=64, tokens=65_536,
                                                 architecture="batchtopk", skip=True, batch_tokens=512,
                                                 buffer_tokens=16_384, lr=2e-3, dead_window=100_000, seed=0),
    ("gemma-3-270m", "plt-quick"): dict(corpus="quick", d_sae=1024, k=64, tokens=65_536,
                                        architecture="batchtopk", skip=True, batch_tokens=512, buffer_tokens=16_384,
                                        lr=2e-3, dead_window=100_000, seed=0),
    # As many parameters as the PLT recipe (512 x (30 + 465) x 576 = 146M, training.clt_objective), the same corpus,
    # tokens and settings. The pre-activation loss keeps its k: without it the features per token fell far below it
    # (docs/cross-layer-transcoders.md has the probes that chose the coefficient).
    ("SmolLM2-135M-Instruct", "clt"): dict(d_sae=512, k=32, tokens=500_000, architecture="batchtopk", skip=True,
                                           batch_tokens=512, buffer_tokens=16_384, lr=2e-3, dead_window=100_000,
                                           pre_act_coefficient=0.03, seed=0),
}
REQUIRED = ("d_sae", "k", "tokens")  # what a recipe must fix; the rest defaults as in train_transcoders
TRAINED_AS = {"plt-quick": "plt"}  # a prepared name that is not a trainer's kind -> the kind it trains
LOCK_FILE = ".prepare.lock"  # in $SLMVIZ_CACHE/transcoders/{model}/: one build of a model's prepared sets at a time


class PrepareBusyError(RuntimeError):
    """Another process (or job) is preparing one of this model's sets right now."""


def recipe(model: Any, kind: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fixed recipe of (model, kind) updated by `overrides`; for a model without one, `overrides` alone when it
    names every REQUIRED argument (a tiny model's set in the app's tests, or a set of a model loaded from a folder)."""
    name = model if isinstance(model, str) else str(getattr(model, "name", ""))
    overrides = dict(overrides or {})
    if "kind" in overrides:
        raise ValueError(f"a recipe does not choose the trainer: the prepared name does ({kind!r} trains as "
                         f"{TRAINED_AS.get(kind, kind)!r}); drop kind={overrides['kind']!r}")
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
                        deep_scan: bool = False, **overrides: Any) -> Any:
    """Train (or resume, or load when finished) `model`'s prepared `kind` set into $SLMVIZ_CACHE, then prepare its
    feature scan and the bundled SAEs' (features.prepared_scans: no card waits for one); returns the set.

    `overrides`: train_transcoders arguments over the recipe (`corpus=` replaces CORPUS: a corpus name, a file or a
    list of texts); they are what makes a set for a model without a recipe (recipe()). `scan_progress`: the scan's
    fn(docs done, total) (default: a bar when `progress` is True, else none). `deep_scan`: then the set's deep scan
    too (features.deep_scan: a million tokens, labels with scores), after the lock is released; `start_deep_scan`
    runs it in the background instead, so that the first graph never waits for it."""
    args = recipe(model, kind, overrides)
    with build_lock(model, kind):
        ts = _prepare(model, kind, args, progress, scan_progress)
    if deep_scan:
        prepare_deep_scan(model, ts, kind, progress=progress)
    return ts


def start_deep_scan(model: Any, ts: Any, kind: str, progress: Any = None) -> threading.Thread:
    """The set's deep scan (prepare_deep_scan: resumable, read once made) in a daemon thread, started now; returns
    the thread. A second start while one runs for the same set is refused by its work folder's lock (DeepScanBusy
    as the thread's error, nothing lost)."""
    thread = threading.Thread(target=prepare_deep_scan, args=(model, ts, kind), kwargs={"progress": progress},
                              name=f"deep scan {kind}", daemon=True)
    thread.start()
    return thread


@contextmanager
def build_lock(model: Any, kind: str) -> Iterator[None]:
    """Hold the model's build lock for the block: taken at once, or refused with PrepareBusyError.

    Why one lock for all of a model's sets, not one per set: the quick and the full set share the chat corpus's part
    files and the bundled SAEs' scans, which two builds at once would write together; and on a 2-core machine the
    second build would only halve the first's speed. The lock is an OS file lock (released when its process dies, so
    a killed build never leaves it held); each set's checkpoint stays its own, so a refused build loses nothing."""
    path = prepared_dir(model, kind).parent / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path, blocking=False)
    try:
        lock.acquire()
    except Timeout:
        name = model if isinstance(model, str) else getattr(model, "name", "this model")
        raise PrepareBusyError(f"another build of {name}'s prepared transcoders is running (it holds {path}); wait "
                               f"for it to finish, then prepare {kind!r} again: it resumes from its checkpoint, "
                               "nothing is lost") from None
    try:
        yield
    finally:
        lock.release()


def _prepare(model: Any, kind: str, args: dict[str, Any], progress: Any, scan_progress: Any) -> Any:
    """prepare_transcoders' work, under the model's build lock."""
    from ..corpora.named import resolve_corpus

    trains = TRAINED_AS.get(kind, kind)  # the prepared name says which trainer, whoever gave the recipe
    corpus_name = args.pop("corpus", CORPUS)
    out = prepared_dir(model, kind)
    corpus = resolve_corpus(corpus_name, model)
    command = "slmviz prepare --transcoders " + shlex.join([kind, "--model", model.name])
    said = corpus_name if isinstance(corpus_name, str) else "custom"
    try:
        ts = train_transcoders(model, layers="all", corpus=corpus, kind=trains, out=out, progress=progress,
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
