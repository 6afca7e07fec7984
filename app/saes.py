"""The SAEs and transcoders this server offers, per model, and their feature scans (the cards' top contexts).

Which SAEs are on offer for a model:
- the bundled ones (slmviz.bundled_saes);
- every SAE folder under $SLMVIZ_SAE_DIRS (folders separated by the OS path separator; each one an SAE folder or a
  folder of SAE folders), set by whoever starts the server, so no --allow-local-models is needed for them;
- those loaded in the Model tab: a hub id (+ subfolder), or a local folder when the app runs with
  --allow-local-models. They are shared by every session of the server (at most MAX_LOADED_SAES kept).
- those a session trained itself in the Features tab's "Train an SAE" panel (listed for that session only; at most
  MAX_TRAINED_SAES per session, kept in memory, never written anywhere another session reads);
- the coders of a loaded full transcoder set (app/transcoder_sets.py), pinned under the set's names.
A picker value is only ever looked up among these: a client cannot make the server read another path.

A feature scan is a scan of the bundled corpus with the SAE spliced in (app/scans.py), keyed by the SAE's weights.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slmviz import SAE, Scan, bundled_saes, load_sae
from slmviz.features.dashboard import acts_hook
from slmviz.features.prepared_scans import load_sae_scan
from slmviz.formats import gemma_scope
from slmviz.formats.saelens import CFG_FILENAME
from slmviz.model_api import HUB_ID_PATTERN
from slmviz.scans.scan import ScanFormatError

from .jobs import Job
from .scans import SCANS

log = logging.getLogger("slmviz.app")

SAE_DIRS_ENV = "SLMVIZ_SAE_DIRS"
MAX_LOADED_SAES = 6
MAX_TRAINED_SAES = 3  # per session: SAEs it trained, kept in memory
FEATURE_TOP_K = 10  # contexts kept per feature by a feature scan
DASHBOARD_ROWS = "+sae_rows"  # in a feature scan's cache key: slmviz.scan zeroes the rows SAE.shown_rows drops
GEMMA_SCOPE_WEIGHTS = gemma_scope.SAE_FILE  # a Gemma Scope SAE folder holds this file alone
NO_SAE = "No SAE for this model yet: load one in the Model tab (a hub id, or a folder with --allow-local-models)."


@dataclass
class Entry:
    """One SAE on offer: its picker name, the SAE (loaded for one model) and its weights' fingerprint."""

    name: str
    sae: SAE
    key: str


def fingerprint(sae: SAE) -> str:
    """sha1 of the SAE's configuration and tensors: two SAEs with the same name never share a cached scan."""
    h = hashlib.sha1(repr(sae).encode())
    for name, tensor in sorted(sae.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def provide_prepared_scan(model: Any, entry: Entry) -> Entry:
    """A bundled SAE's feature scan prepared with the model's full set (features.prepared_scans.prepare_sae_scans: the
    set's corpus, modern prose and chat rather than King James verses), served as its card's scan: no visitor waits.
    Without one (or for other weights), the card scans the bundled verses on first use, as before."""
    if finished_feature_scan(model, entry) is None:
        try:
            found = load_sae_scan(model, entry.name, entry.sae)
        except ScanFormatError as e:  # damaged: the card says so and scans the verses; prepare writes it again
            unreadable_scan(entry, str(e))
            return entry
        if found is not None:
            provide_feature_scan(model, entry, found)
    return entry


def sae_dirs() -> list[Path]:
    """The SAE folders under $SLMVIZ_SAE_DIRS (an SAE folder, or a folder of them), sorted by name."""
    found = []
    for root in filter(None, os.environ.get(SAE_DIRS_ENV, "").split(os.pathsep)):
        root = Path(root).expanduser()
        if _is_sae_folder(root):
            found.append(root)
        elif root.is_dir():
            found += sorted(p for p in root.iterdir() if _is_sae_folder(p))
    return found


def _is_sae_folder(path: Path) -> bool:
    return (path / CFG_FILENAME).is_file() or (path / GEMMA_SCOPE_WEIGHTS).is_file()


class SAEStore:
    """The SAEs this server offers, per model (module docstring), loaded on first use and shared by sessions."""

    def __init__(self, allow_local: bool = False):
        self.allow_local = allow_local
        self._loaded: OrderedDict[tuple[str, str], Entry] = OrderedDict()  # (model, name) -> Entry, LRU
        self._extra: dict[str, list[str]] = {}  # model -> names loaded in the Model tab, in order
        self._sources: dict[tuple[str, str], Any] = {}  # (model, name) -> what load_sae reads for it
        self._misfits: set[tuple[str, str]] = set()  # (model, folder) of $SLMVIZ_SAE_DIRS folders that do not fit
        self._trained: dict[tuple[str, str], OrderedDict[str, Entry]] = {}  # (model, session) -> its own SAEs
        self._trained_ids = itertools.count(1)
        self._pinned: dict[tuple[str, str], Entry] = {}  # (model, name) -> a full set's coder (app/transcoder_sets)
        self._lock = threading.Lock()

    @staticmethod
    def model_key(model: Any) -> str:
        return f"{model.name}|{model.path}"

    def names(self, model: Any, who: str | None = None) -> list[str]:
        """Bundled SAEs, then $SLMVIZ_SAE_DIRS folders that fit this model, then those loaded in the Model tab,
        then those session `who` trained."""
        m = self.model_key(model)
        names = list(bundled_saes(model))
        for folder in sae_dirs():
            name = folder.name
            if (m, str(folder)) in self._misfits:
                continue
            if (m, name) not in self._sources:
                try:  # listed only where it fits: hooks and widths checked against the model
                    self._keep(model, name, load_sae(folder, model=model), folder)
                except Exception as e:  # noqa: BLE001 - a bad folder is logged once and left out, never fatal
                    log.warning("SAE folder %s does not fit %s: %s", folder, model.name, e)
                    self._misfits.add((m, str(folder)))
                    continue
            names.append(name)
        with self._lock:
            names += [n for n in self._extra.get(m, []) if (m, n) in self._loaded]
            if who is not None:
                names += list(self._trained.get((m, who), {}))
        return list(dict.fromkeys(names))

    def add_trained(self, model: Any, who: str, sae: SAE) -> Entry:
        """An SAE session `who` trained: offered to that session only (names(model, who)), the oldest dropped
        beyond MAX_TRAINED_SAES."""
        arrow = f" -> {sae.hook_name_out}" if sae.is_transcoder else ""
        name = f"trained #{next(self._trained_ids)}: {sae.hook_name}{arrow}, {sae.d_sae} features, k {sae.k}"
        entry = Entry(name, sae, fingerprint(sae))
        with self._lock:
            mine = self._trained.setdefault((self.model_key(model), who), OrderedDict())
            mine[name] = entry
            while len(mine) > MAX_TRAINED_SAES:
                mine.popitem(last=False)
        return entry

    def pin(self, model: Any, name: str, sae: SAE) -> Entry:
        """A coder of a loaded transcoder set: found by `get` (its feature card, its scan) and never evicted, since
        its set stays loaded; not listed by `names` (the set is one choice of the Circuits tab)."""
        entry = Entry(name, sae, fingerprint(sae))
        with self._lock:
            self._pinned[(self.model_key(model), name)] = entry
        return entry

    def _trained_entry(self, m: str, name: str) -> Entry | None:
        with self._lock:
            for (model_key, _), mine in self._trained.items():
                if model_key == m and name in mine:
                    return mine[name]
        return None

    def get(self, model: Any, name: str | None) -> Entry:
        m = self.model_key(model)
        if not name:
            raise ValueError(NO_SAE if not self.names(model) else "Pick an SAE first")
        with self._lock:
            if (m, name) in self._loaded:
                self._loaded.move_to_end((m, name))
                return self._loaded[(m, name)]
            if (m, name) in self._pinned:
                return self._pinned[(m, name)]
        trained = self._trained_entry(m, name)
        if trained is not None:
            return trained
        if name in bundled_saes(model):
            return provide_prepared_scan(model, self._keep(model, name, load_sae(name, model=model)))
        source = self._sources.get((m, name))
        if source is None or name not in self.names(model):
            raise ValueError(f"{name!r} is not an SAE for {model.name}; pick one of: "
                             f"{', '.join(self.names(model)) or NO_SAE}")
        return self._keep(model, name, load_sae(source, model=model), source)

    def load(self, model: Any, source: str, subfolder: str | None = None) -> Entry:
        """An SAE from a hub id (+ subfolder), or a local folder when allow_local; its name is the source."""
        text = (source or "").strip()
        sub = (subfolder or "").strip() or None
        if not text:
            raise ValueError("Type a hub id (owner/name, with its subfolder) or, with --allow-local-models, a folder")
        path = Path(text).expanduser()
        if path.exists() or text.startswith((".", "/", "~")):
            if not self.allow_local:
                raise ValueError("Local SAE folders are disabled; start the app with --allow-local-models to load "
                                 f"one (or list it in ${SAE_DIRS_ENV} when starting the server)")
            where = path / sub if sub else path
            sae = load_sae(where.resolve() if where.exists() else where, model=model)
            name = str(where.resolve())
        elif HUB_ID_PATTERN.match(text) and ".." not in text:
            sae = load_sae(text, subfolder=sub, model=model)  # bounded time: $SLMVIZ_HUB_TIMEOUT
            name = f"{text}/{sub}" if sub else text
        else:
            raise ValueError(f"{text[:100]!r} is neither a hub id of the form owner/name nor a folder")
        entry = self._keep(model, name, sae, None)
        with self._lock:
            extra = self._extra.setdefault(self.model_key(model), [])
            if name not in extra:
                extra.append(name)
        return entry

    def _keep(self, model: Any, name: str, sae: SAE, source: Any = None) -> Entry:
        m = self.model_key(model)
        entry = Entry(name, sae, fingerprint(sae))
        with self._lock:
            if source is not None:
                self._sources[(m, name)] = source
            self._loaded[(m, name)] = entry
            self._loaded.move_to_end((m, name))
            while len(self._loaded) > MAX_LOADED_SAES:
                self._loaded.popitem(last=False)  # a bundled or $SLMVIZ_SAE_DIRS SAE is loaded again on demand
        return entry


# --- feature scans -------------------------------------------------------------------------------
def join_feature_scan(model: Any, entry: Entry, who: str) -> Job:
    """The SAE's feature scan: joined (or started) as a shared long job, keyed by the SAE's weights."""
    return SCANS.join(model, [acts_hook(entry.sae)], who, top_k=FEATURE_TOP_K, saes=(entry.sae,),
                      saes_key=entry.key + DASHBOARD_ROWS)


def finished_feature_scan(model: Any, entry: Entry) -> tuple[Scan, list[str]] | None:
    """The SAE's feature scan once it is done (or provided), else None: never starts one."""
    return SCANS.finished(model, [acts_hook(entry.sae)], FEATURE_TOP_K, entry.key + DASHBOARD_ROWS)


# What a card says of where its top contexts come from: the SAEs and coders whose feature scan was prepared with
# them (over their own corpus), those whose prepared scan the Graph tab rebuilt (app/tabs/graph_scan.py), and
# those whose prepared scan could not be read (why, and how to write it again).
_PREPARED: set[str] = set()
_REBUILT: set[str] = set()
_UNREADABLE: dict[str, tuple[str, str]] = {}  # key -> (why, how to write it again)
PREPARE_AGAIN = "`slmviz prepare --transcoders` writes it again"


def provide_feature_scan(model: Any, entry: Entry, found: tuple[Scan, list[str]], rebuilt: bool = False) -> None:
    """A feature scan prepared elsewhere (with a full transcoder set) served as the SAE's own: nothing computed.
    `rebuilt`: it replaces one that was missing or could not be read (its card says so)."""
    SCANS.provide(model, [acts_hook(entry.sae)], found, FEATURE_TOP_K, entry.key + DASHBOARD_ROWS)
    _PREPARED.add(entry.key)
    if rebuilt:
        _REBUILT.add(entry.key)
    _UNREADABLE.pop(entry.key, None)


def unreadable_scan(entry: Entry, why: str, fix: str = PREPARE_AGAIN) -> None:
    """The prepared scan of `entry` is there but cannot be read (`why`): its card says so, and `fix` (how to
    write it again)."""
    _UNREADABLE[entry.key] = (why, fix)


def scan_source(entry: Entry | None, docs: list[str] | None) -> str:
    """Which text a card's top contexts come from, in words: the scan prepared with the coder (its own corpus:
    modern prose, code and the model's chat; said to be rebuilt when the Graph tab rebuilt it), or the bundled
    King James verses, and why."""
    if entry is not None and entry.key in _PREPARED:
        again = ", rebuilt since the server started" if entry.key in _REBUILT else ""
        return (f"from the scan prepared with it{again}: {len(docs or [])} documents of its own corpus (modern prose, "
                "code and the model's chat)")
    unreadable = _UNREADABLE.get(entry.key) if entry is not None else None
    why = (f"its prepared scan could not be read ({unreadable[0]}); {unreadable[1]}" if unreadable else
           "it has no prepared scan")
    return f"from {len(docs or [])} verses of the bundled King James Bible: {why}"
