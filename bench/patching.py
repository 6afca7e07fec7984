"""Patching sweeps side by side: slmviz's batched engine against one hooked forward per cell (TransformerLens's method).

Both engines run in this process on SmolLM2-135M-Instruct with the same prompts, alternating rounds, medians.
Rows:
- resid_pre sweep of a 12-token IOI pair (second name swapped, the prompts first differ at position 7): target ≥ 10×;
- the same sweep when the prompts differ at position 1 (every later cell must be computed): evidence, no target;
- every other site on the 12-token pair. One-forward-per-cell time there is measured on a sample of cells and
  scaled by the number of cells (each cell is one full forward of the same prompt, so its time does not depend on
  which cell it is); the sampled cells' values are also compared with the batched sweep's;
- the app: a layer × position sweep of a 20-token pair through gradio_client (/patch_sweep), target < 5 s;
- attribution patching: its time, and its correlation with the exact sweep per site (evidence for the README).

    .venv/bin/python bench/patching.py [--repeats 3] [--no-app]   # at most 3 rounds
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch
from common import REPO, Row, main, median, spread

sys.path.insert(0, str(REPO / "tests"))

PAIR_12 = ("When Mary and John went out, John gave a drink to", "When Mary and John went out, Mary gave a drink to")
PAIR_12_EARLY = ("When Mary and John went out, John gave a drink to",
                 "When Alice and John went out, John gave a drink to")
PAIR_20 = ("When Mary and John went to the store after a long day at school, John gave a drink to",
           "When Mary and John went to the store after a long day at school, Mary gave a drink to")
ANSWER, WRONG = " Mary", " John"
SPEEDUP_TARGET = 10.0
APP_TARGET_S = 5.0
SAMPLED_CELLS = 24
SITES = ["attn_out", "mlp_out", "z", "q", "k", "v", "pattern", "heads"]
ATTRIBUTION_SITES = ["resid_pre", "resid_mid", "attn_out", "mlp_out", "z", "q", "k", "v", "pattern", "heads"]


def sweep(model, pair, site="resid_pre", engine="batched", answer=ANSWER, wrong=WRONG, method="exact"):
    import slmviz

    return slmviz.patch(*pair, answer=answer, wrong=wrong, site=site, model=model, engine=engine, method=method)


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def side_by_side(model, pair, repeats: int, answer=ANSWER, wrong=WRONG) -> tuple[list[float], list[float], float]:
    """Alternating rounds of the full resid_pre sweep: (batched times, per-cell times, max |difference|)."""
    fast, slow, diff = [], [], 0.0
    sweep(model, pair, answer=answer, wrong=wrong)  # warm-up
    for _ in range(repeats):
        t, a = timed(lambda: sweep(model, pair, answer=answer, wrong=wrong))
        fast.append(t)
        t, b = timed(lambda: sweep(model, pair, engine="per_cell", answer=answer, wrong=wrong))
        slow.append(t)
        diff = max(diff, float((a.values - b.values).abs().max()))
    return fast, slow, diff


def per_cell_sample(model, pair, site: str, fast) -> tuple[float, float]:
    """(seconds per cell of one hooked forward each, max |difference| to the batched sweep) on sampled cells."""
    from slmviz import Variant
    from slmviz.hooks import build_context
    from slmviz.patching import SITES as ALL_SITES
    from slmviz.patching import _writer, site_hook_name

    s = ALL_SITES[site]
    clean_ids, corrupted_ids = model.encode(pair[0]), model.encode(pair[1])
    names = [site_hook_name(s, layer) for layer in range(model.cfg.n_layers)]
    clean = model.trace(clean_ids, names=names)
    cells = [tuple(c) for c in torch.stack(torch.meshgrid(*[torch.arange(n) for n in fast.values.shape],
                                                          indexing="ij"), -1).reshape(-1, fast.values.dim()).tolist()]
    picked = random.Random(0).sample(cells, min(SAMPLED_CELLS, len(cells)))
    a, w = model.tokenizer(ANSWER, add_special_tokens=False)["input_ids"][0], \
        model.tokenizer(WRONG, add_special_tokens=False)["input_ids"][0]
    times, diff = [], 0.0
    for layer, *rest in picked:
        name = site_hook_name(s, layer)
        start = time.perf_counter()
        ctx = build_context(model.hook_names, [], {name: _writer(clean[name], s.index(tuple(rest)))})
        logits = model.decoder.forward(corrupted_ids, ctx, Variant())
        value = float(logits[-1, a].double() - logits[-1, w].double())
        times.append(time.perf_counter() - start)
        diff = max(diff, abs(value - float(fast.values[(layer, *rest)])))
    return median(times), diff


def app_sweep(repeats: int) -> list[float]:
    """Seconds for /patch_sweep of the 20-token pair, through a real server (what a browser waits for)."""
    from app_helpers import app_server
    from gradio_client import Client

    times = []
    with app_server() as url:
        client = Client(url, verbose=False)
        args = (*PAIR_20, ANSWER, WRONG, "resid_pre", "denoise", "exact")
        client.predict(*args, api_name="/patch_sweep")  # warm-up (first use loads nothing new: the model is up)
        for _ in range(repeats):
            start = time.perf_counter()
            client.predict(*args, api_name="/patch_sweep")
            times.append(time.perf_counter() - start)
    return times


def run(args: argparse.Namespace) -> list[Row]:
    import slmviz
    from slmviz.attribution_patching import exact_correlation

    model = slmviz.load()
    rounds = max(1, min(args.repeats, 3))  # a one-forward-per-cell sweep takes minutes: at most 3 rounds
    rows: list[Row] = []
    n12 = model.encode(PAIR_12[0]).numel()
    assert n12 == 12 and model.encode(PAIR_20[0]).numel() == 20

    fast, slow, diff = side_by_side(model, PAIR_12, rounds)
    ratio = median(slow) / median(fast)
    rows.append(Row("patch resid_pre, 12-token IOI pair (first differs at position 7): one hooked forward per cell "
                    "÷ batched", f"{median(fast):.2f} s", f"{median(slow):.1f} s (360 forwards)", ratio,
                    f"≥ {SPEEDUP_TARGET:.0f}", ratio >= SPEEDUP_TARGET,
                    f"batched {spread(fast)}, per cell {spread(slow)}; max |Δ metric| {diff:.1e}"))
    fast, slow, diff = side_by_side(model, PAIR_12_EARLY, max(1, rounds - 1), ANSWER, " Alice")
    ratio = median(slow) / median(fast)
    rows.append(Row("patch resid_pre, 12-token pair differing at position 1 (every later cell computed): per cell ÷ "
                    "batched", f"{median(fast):.2f} s", f"{median(slow):.1f} s", ratio, "—", None,
                    f"worst case for the position shortcuts; max |Δ metric| {diff:.1e}"))

    for site in SITES:
        t_fast, fast_result = timed(lambda s=site: sweep(model, PAIR_12, s))
        per_cell_s, diff = per_cell_sample(model, PAIR_12, site, fast_result)
        cells = fast_result.values.numel()
        estimate = per_cell_s * cells
        rows.append(Row(f"patch {site}, 12-token pair ({cells} cells): per cell ÷ batched", f"{t_fast:.2f} s",
                        f"≈ {estimate:.0f} s ({SAMPLED_CELLS} sampled cells × {cells})", estimate / t_fast, "—", None,
                        f"max |Δ metric| on the sampled cells {diff:.1e}"))

    if not args.no_app:
        times = app_sweep(rounds)
        rows.append(Row("app: layer × position sweep (resid_pre) of a 20-token pair, /patch_sweep round trip",
                        f"{median(times):.2f} s", "", median(times), f"< {APP_TARGET_S:.0f} s",
                        median(times) < APP_TARGET_S, spread(times)))

    for site in ATTRIBUTION_SITES:
        t_attr, attr = timed(lambda s=site: sweep(model, PAIR_12, s, method="attribution"))
        t_exact, exact = timed(lambda s=site: sweep(model, PAIR_12, s))
        r = exact_correlation(attr, exact)
        rows.append(Row(f"attribution patching {site}, 12-token pair: Pearson r with the exact sweep",
                        f"r = {r:.2f}", "", r, "—", None, f"attribution {t_attr:.2f} s, exact batched {t_exact:.2f} s"))
    return rows


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-app", action="store_true", help="skip the app row (it starts a server)")


if __name__ == "__main__":
    main(run, __doc__, add_args)
