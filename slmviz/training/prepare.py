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

from ..features.prepared_scans import CORPUS, prepare_deep_scan, prepare_sae_scans, prepare_set_scan, set_scan_dir
from ..formats.checkpoint import CheckpointError, trained_tokens
from ..loading.bundled import prepared_dir
from ..progress import Progress, ProgressLike, as_progress
from ..replacement.prepared import prepared_ready
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
# The parts of a build, weighted by what each took in the quick set's build from nothing (the chat corpus written, the
# set trained, the scans: about 3.5, 4.5 and 3.7 minutes; issue 52): shares of prepare_transcoders' one bar.
PHASE_WEIGHTS = {"corpus": 0.3, "training": 0.4, "scan": 0.3}
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


def prepare_transcoders(model: Any, kind: str = "plt", progress: ProgressLike = True, deep_scan: bool = False,
                        **overrides: Any) -> Any:
    """Write the model's own corpus when the recipe reads one (once per model), train (or resume, or load when
    finished) `model`'s prepared `kind` set into $SLMVIZ_CACHE, then prepare its feature scan and the bundled SAEs'
    (features.prepared_scans: no card waits for one); returns the set.

    `overrides`: train_transcoders arguments over the recipe (`corpus=` replaces CORPUS: a corpus name, a file or a
    list of texts); they are what makes a set for a model without a recipe (recipe()). `progress`: slmviz.progress's
    contract (True: one tqdm bar), one job whose parts are the corpus ("chat corpus"), the training ("training", its
    detail the layers' explained variance) and the scans ("scan 1/3": the set's, then each bundled SAE's). A part
    already done (a written corpus, a finished set, a scan there) takes no share of the bar, so the time left is
    measured on the work that remains. `deep_scan`: then the set's deep scan too (features.deep_scan: a million
    tokens, labels with scores), after the lock is released, as a job of its own; `start_deep_scan` runs it in the
    background instead, so that the first graph never waits for it."""
    args = recipe(model, kind, overrides)
    with build_lock(model, kind):
        ts = _prepare(model, kind, args, as_progress(progress, f"prepare {kind} ({model.name})"))
    if deep_scan:
        prepare_deep_scan(model, ts, kind, progress=progress)
    return ts


def start_deep_scan(model: Any, ts: Any, kind: str, progress: ProgressLike = None) -> threading.Thread:
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


def _shares(model: Any, kind: str, args: dict[str, Any], corpus_name: Any) -> dict[str, float]:
    """Each part's share of the bar: PHASE_WEIGHTS for the work left (none for a written corpus or a finished scan;
    the training's weight times the tokens still to train), so the bar's rate, and the time left, are the work's."""
    from ..corpora.generated import corpus_dir
    from ..corpora.named import MODEL_WRITTEN

    left = dict(PHASE_WEIGHTS)
    if corpus_name not in MODEL_WRITTEN:
        left["corpus"] = 0.0
    else:
        folder = corpus_dir(model) if corpus_name == "chat" else corpus_dir(model, corpus_name)
        if (folder / "train.jsonl").is_file() and (folder / "heldout.jsonl").is_file():
            left["corpus"] = 0.0
    out = prepared_dir(model, kind)
    if prepared_ready(model, kind):
        left["training"] = 0.0
    else:
        left["training"] *= 1 - min((trained_tokens(out) or 0) / max(args["tokens"], 1), 1.0)
    if set_scan_dir(model, kind).is_dir():
        left["scan"] *= 0.2  # the set's scan is there (read, or written again if damaged); the bundled SAEs' may not be
    total = sum(left.values()) or 1.0
    return {k: v / total for k, v in left.items()}


def _prepare(model: Any, kind: str, args: dict[str, Any], p: Progress) -> Any:
    """prepare_transcoders' work, under the model's build lock: its parts laid end to end on one bar."""
    from ..corpora.named import resolve_corpus
    from ..features.bundled import bundled_saes
    from ..features.load import load_sae

    trains = TRAINED_AS.get(kind, kind)  # the prepared name says which trainer, whoever gave the recipe
    corpus_name = args.pop("corpus", CORPUS)
    out = prepared_dir(model, kind)
    share = _shares(model, kind, args, corpus_name)
    written = p.part("chat corpus", share["corpus"])
    corpus = resolve_corpus(corpus_name, model, progress=written)
    written.finish()
    command = "slmviz prepare --transcoders " + shlex.join([kind, "--model", model.name])
    said = corpus_name if isinstance(corpus_name, str) else "custom"
    try:
        ts = train_transcoders(model, layers="all", corpus=corpus, kind=trains, out=out,
                               progress=p.part("training", share["training"]),
                               name=f"{model.name}-{kind}", metadata={"training_command": command,
                                                                     "corpus_name": said}, **args)
    except CheckpointError as e:  # a set prepared by an earlier recipe (or other overrides): say what to do here
        raise CheckpointError(f"the prepared {kind.upper()} in {out} was trained by another recipe than this "
                              f"slmviz's: {e}. It still loads (slmviz.load_transcoders({kind!r}, model=m)); to "
                              f"prepare the current recipe, delete that folder and run `{command}` again") from e
    scanned = corpus_name if isinstance(corpus_name, str) else list(corpus_name)
    saes = {name: load_sae(name, model=model) for name in bundled_saes(model)}
    passes = 1 + len(saes)  # the set's scan, then each bundled SAE's (their cards read the same text): one part each
    scans = p.part("scan", share["scan"])

    def scan_pass(i: int) -> Progress:
        return scans.part("scan", 1 / passes, index=(i, passes) if passes > 1 else None)

    first = scan_pass(1)
    prepare_set_scan(model, ts, kind, corpus=scanned, progress=first)  # a CLT's too: one unit per layer, spliced
    first.finish()
    for i, (name, sae) in enumerate(saes.items(), start=2):
        done = scan_pass(i)
        prepare_sae_scans(model, {name: sae}, corpus=scanned, progress=done)
        done.finish()
    p.finish("ready")
    return ts
