"""Module paths from before the package had folders (slmviz 0.1), kept importable for one release.

`from slmviz.scan_batches import plan_batches` still works and warns with a DeprecationWarning naming the
new path. Each old path is a lazy stand-in module in sys.modules: nothing is imported until an attribute
is read, and the real module is never replaced, so `slmviz.scan` and `slmviz.compare` stay the functions.
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings

MOVED = {
    "slmviz.weights": "slmviz.loading.weights",
    "slmviz.bundled": "slmviz.loading.bundled",
    "slmviz.default_model": "slmviz.loading.default_model",
    "slmviz.reference": "slmviz.loading.reference",
    "slmviz.lens": "slmviz.analysis.lens",
    "slmviz.logit_attribution": "slmviz.analysis.logit_attribution",
    "slmviz.compare": "slmviz.interventions.compare",
    "slmviz.patching": "slmviz.interventions.patching",
    "slmviz.attribution_patching": "slmviz.interventions.attribution",
    "slmviz.ablation": "slmviz.interventions.ablation",
    "slmviz.scan": "slmviz.scans.scan",
    "slmviz.corpus": "slmviz.scans.corpus",
    "slmviz.scan_batches": "slmviz.scans.batches",
    "slmviz.scan_reduce": "slmviz.scans.reduce",
    "slmviz.scan_shards": "slmviz.scans.shards",
    "slmviz.scan_ray": "slmviz.scans.ray_engine",
    "slmviz.scan_cli": "slmviz.scans.cli",
    "slmviz.patch_plots": "slmviz.plots.patch",
    "slmviz.scan_plots": "slmviz.plots.scan",
}
# Names an old module had that now live in a sibling of its new home (the two modules that were split).
SPLIT = {
    "slmviz.compare": {"trace_diff": "slmviz.analysis.diff", "kl_per_position": "slmviz.analysis.diff",
                       "relative_difference": "slmviz.analysis.diff", "first_divergent_layer": "slmviz.analysis.diff",
                       "first_divergent_hook": "slmviz.analysis.diff", "DIVERGENCE_THRESHOLD": "slmviz.analysis.diff",
                       "RESIDUAL_HOOKS": "slmviz.analysis.diff"},
    "slmviz.patching": {**dict.fromkeys(("Site", "SITES", "site_of", "axis_sizes", "site_hook_name"),
                                        "slmviz.interventions.sites"),
                        **dict.fromkeys(("PatchResult", "patched_trace", "_writer"), "slmviz.interventions.result")},
}


class MovedModule(types.ModuleType):
    """Stands in for an old module path: reading an attribute warns once and reads it from the new module."""

    def __init__(self, old: str, new: str) -> None:
        super().__init__(old, f"Moved to {new}; this path works until slmviz 0.3.")
        self._new = new
        self._warned = False

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        new = SPLIT.get(self.__name__, {}).get(attr, self._new)
        if not self._warned:
            self._warned = True
            warnings.warn(f"{self.__name__} moved to {new} in slmviz 0.2; the old path goes in 0.3",
                          DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(new), attr)


def install() -> None:
    """Put a stand-in for every old path into sys.modules (called once by slmviz/__init__)."""
    for old, new in MOVED.items():
        sys.modules.setdefault(old, MovedModule(old, new))
