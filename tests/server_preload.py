"""Imported once by the test servers' forkserver (tests/app_helpers.py): the default model, loaded before the servers
fork, so that each SmolLM2 server shares its weights with the forkserver (copy-on-write) instead of loading them.

A load copies the model's weights into memory of the server's own, and on the virtual machines the suite runs on,
memory that no process has touched lately costs the kernel more than the copy itself (the host has taken it back), so
each server start paid for the same weights again (bench/perf/fresh_memory.py; bench/results/notes.md, "make test's
CPU").
A forked server finds the model where `slmviz.load()` keeps bundled models (`model_api._BUNDLED_LOADED`); a server
whose $SLMVIZ_CACHE differs from the one read here forgets it first (forget_if_another_cache).

Only when the model is already prepared: the forkserver must never spend a minute preparing one. Loaded on one
thread, so that no OpenMP thread pool exists in the process that forks.
"""

from __future__ import annotations

import os

CACHE = os.environ.get("SLMVIZ_CACHE")
LOADED = False

try:
    import torch

    import slmviz
    from slmviz.loading.bundled import DEFAULT_MODEL_NAME, is_prepared, model_dir

    if is_prepared(model_dir(DEFAULT_MODEL_NAME)):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            slmviz.load()
            LOADED = True
            # what app/fast_mode.py asks when a server builds its Patch tab: timed GEMMs, measured once here
            # instead of in every server
            from slmviz.model.params import bf16_bulk_speedup

            bf16_bulk_speedup()
        finally:
            torch.set_num_threads(threads)
    # Everything alive now lives as long as each server: out of the garbage collector's reach, a forked server's
    # collections neither walk it nor write to its pages (which would copy them, page by page, into the server).
    import gc

    gc.collect()
    gc.freeze()
except Exception as e:  # a forkserver whose preload raises would fail every server: they load their own instead
    print(f"server_preload: the default model was not preloaded ({e!r})", flush=True)


def forget_if_another_cache() -> None:
    """In a forked server whose environment is set: a preloaded model is kept only for the cache it came from."""
    if LOADED and os.environ.get("SLMVIZ_CACHE") != CACHE:
        from slmviz import model_api

        model_api._BUNDLED_LOADED.clear()
