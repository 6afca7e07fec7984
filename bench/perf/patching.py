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

    .venv/bin/python bench/perf/patching.py [--repeats 3] [--groups resid,sites,app,attribution]   # at most 3 rounds
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
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
    from slmviz.interventions.result import _writer
    from slmviz.interventions.sites import SITES as ALL_SITES
    from slmviz.interventions.sites import site_hook_name

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


def resid_rows(model, rounds: int) -> list[Row]:
    """The full one-forward-per-cell resid_pre sweeps (the issue's ≥ 10× target) on both 12-token pairs."""
    fast, slow, diff = side_by_side(model, PAIR_12, rounds)
    ratio = median(slow) / median(fast)
    rows = [Row("patch resid_pre, 12-token IOI pair (first differs at position 7): one hooked forward per cell "
                "÷ batched", f"{median(fast):.2f} s", f"{median(slow):.1f} s (360 forwards)", ratio,
                f"≥ {SPEEDUP_TARGET:.0f}", ratio >= SPEEDUP_TARGET,
                f"batched {spread(fast)}, per cell {spread(slow)}; {_per_round(fast, slow)}; "
                f"max |Δ metric| {diff:.1e}")]
    fast, slow, diff = side_by_side(model, PAIR_12_EARLY, rounds, ANSWER, " Alice")
    rows.append(Row("patch resid_pre, 12-token pair differing at position 1 (every later cell computed): per cell "
                    "÷ batched", f"{median(fast):.2f} s", f"{median(slow):.1f} s", median(slow) / median(fast), "—",
                    None, f"worst case for the position shortcuts; {_per_round(fast, slow)}; max |Δ metric| "
                    f"{diff:.1e}"))
    return rows


def _per_round(fast: list[float], slow: list[float]) -> str:
    """Each round's ratio, and the most pessimistic pairing (slowest batched against fastest per-cell)."""
    rounds = ", ".join(f"{s / f:.0f}" for f, s in zip(fast, slow, strict=True))
    return f"ratio per round {rounds}, worst pairing {min(slow) / max(fast):.0f}"


def site_rows(model, rounds: int) -> list[Row]:
    """Every other site: the batched sweep and sampled per-cell forwards alternate, so both see the same load."""
    rows = []
    for site in SITES:
        fast_times, cell_times, ratios, diff = [], [], [], 0.0
        for _ in range(rounds):
            t_fast, fast_result = timed(lambda s=site: sweep(model, PAIR_12, s))
            per_cell_s, d = per_cell_sample(model, PAIR_12, site, fast_result)
            cells = fast_result.values.numel()
            fast_times.append(t_fast)
            cell_times.append(per_cell_s * cells)
            ratios.append(per_cell_s * cells / t_fast)
            diff = max(diff, d)
        rows.append(Row(f"patch {site}, 12-token pair ({cells} cells): per cell ÷ batched",
                        f"{median(fast_times):.2f} s", f"≈ {median(cell_times):.0f} s ({SAMPLED_CELLS} sampled "
                        f"cells × {cells})", median(ratios), "—", None,
                        f"ratio per round {', '.join(f'{r:.1f}' for r in ratios)}; max |Δ metric| on the sampled "
                        f"cells {diff:.1e}"))
    return rows


def attribution_rows(model) -> list[Row]:
    from slmviz.interventions.attribution import exact_correlation

    rows = []
    for site in ATTRIBUTION_SITES:
        t_attr, attr = timed(lambda s=site: sweep(model, PAIR_12, s, method="attribution"))
        t_exact, exact = timed(lambda s=site: sweep(model, PAIR_12, s))
        r = exact_correlation(attr, exact)
        rows.append(Row(f"attribution patching {site}, 12-token pair: Pearson r with the exact sweep",
                        f"r = {r:.2f}", "", r, "—", None, f"attribution {t_attr:.2f} s, exact batched {t_exact:.2f} s"))
    return rows


def run(args: argparse.Namespace) -> list[Row]:
    import slmviz

    model = slmviz.load()
    assert model.encode(PAIR_12[0]).numel() == 12 and model.encode(PAIR_20[0]).numel() == 20
    rounds = max(1, min(args.repeats, 3))  # a one-forward-per-cell sweep takes minutes: at most 3 rounds
    groups = set(args.groups.split(","))
    unknown = groups - set(GROUPS)
    if unknown:
        raise SystemExit(f"unknown --groups {sorted(unknown)}; choose from {GROUPS}")
    rows: list[Row] = []
    if "resid" in groups:
        rows += resid_rows(model, rounds)
    if "sites" in groups:
        rows += site_rows(model, rounds)
    if "app" in groups:
        times = app_sweep(rounds)
        rows.append(Row("app: layer × position sweep (resid_pre) of a 20-token pair, /patch_sweep round trip",
                        f"{median(times):.2f} s", "", median(times), f"< {APP_TARGET_S:.0f} s",
                        median(times) < APP_TARGET_S, spread(times)))
    if "attribution" in groups:
        rows += attribution_rows(model)
    return rows


GROUPS = ("resid", "sites", "app", "attribution")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--groups", default=",".join(GROUPS), help="comma-separated subset of " + ",".join(GROUPS))


if __name__ == "__main__":
    main(run, __doc__, add_args)
