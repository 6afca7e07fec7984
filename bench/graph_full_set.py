"""An attribution graph over SmolLM2's full prepared PLT set (`slmviz prepare --transcoders plt`), for 16- and
64-token prompts: slmviz against circuit-tracer (side venv, CPU) on the same model, set, token ids and settings.

Both keep the `--max-feature-nodes` most influential features (default 4096, what the app uses for a full set) by
circuit-tracer's partial-influence rounds, and take the same salient logits (10, 0.95). The set reaches circuit-tracer
as files: slmviz saves it in circuit-tracer's transcoder_set layout, circuit-tracer's `load_transcoder_set` reads
it, and its TransformerLens backend runs SmolLM2's weights (bench/attribution_graph_circuit_tracer.py shows that
layout and backend build the same graphs as slmviz). Each figure is measured in a fresh process, after the model
and set are loaded:
- time: the graph call alone (slmviz.attribution_graph; circuit_tracer.attribute), each side's default batch size;
- peak memory: the process's peak resident set during that call above its resident set just before it (the peak is
  reset through /proc/self/clear_refs first), so the model and set each side holds are not counted.
The token ids start with the tokenizer's special token, which both sides keep as it is.

    .venv/bin/python bench/graph_full_set.py [--ct-python /work/ct-venv/bin/python] [--lengths 16 64]
        [--max-feature-nodes 4096] [--out bench/graph_full_set.md]

The side venv is built as bench/attribution_graph_circuit_tracer.py's docstring says. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
WORK = Path("/tmp/slmviz_graph_full_set")
TEXT = ("When Maria finished her shift at the hospital, she walked to the small bakery on the corner, where the owner "
        "had saved her a loaf of rye bread as he did every Friday. They talked about the storm that was coming from "
        "the coast, the price of flour, and his daughter, who had just started university in Lyon to study chemistry "
        "and wrote home every week about her classes, her roommate and the food, which she said was better than his")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", default="", choices=["", "slmviz", "circuit-tracer"])
    parser.add_argument("--ct-python", default="/work/ct-venv/bin/python")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--max-feature-nodes", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "graph_full_set.md")
    args = parser.parse_args()
    if args.side == "slmviz":
        print(json.dumps(slmviz_side(args.length, args.max_feature_nodes)))
    elif args.side == "circuit-tracer":
        print(json.dumps(circuit_tracer_side(args.length, args.max_feature_nodes)))
    else:
        run(args)


def run(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(REPO))
    import slmviz
    from slmviz.circuits.attribution import prepend_special

    model = slmviz.load()
    ts = slmviz.load_transcoders("plt", model=model)
    if not (WORK / "set" / "config.yaml").exists():
        ts.save(WORK / "set", format="circuit-tracer")
    ids = prepend_special(model.tokenizer, model.encode(TEXT)).tolist()
    if len(ids) < max(args.lengths):
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {max(args.lengths)}")
    (WORK / "model").write_text(str(model.path))
    results = []
    for n in args.lengths:
        (WORK / f"ids_{n}.json").write_text(json.dumps(ids[:n]))
        torch.save(model.logits(ids[:n]).float(), WORK / f"logits_{n}.pt")  # the side checks its model against it
        row = {"tokens": n}
        for side, python in (("slmviz", sys.executable), ("circuit-tracer", args.ct_python)):
            out = subprocess.run([python, __file__, "--side", side, "--length", str(n), "--max-feature-nodes",
                                  str(args.max_feature_nodes)], capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"{side} failed at {n} tokens:\n{out.stderr[-4000:]}")
            row[side] = json.loads(out.stdout.strip().splitlines()[-1])
            print(n, side, row[side], flush=True)
        results.append(row)
    args.out.write_text(markdown(results, args, ts))
    print(f"wrote {args.out}")


def markdown(results: list[dict], args: argparse.Namespace, ts) -> str:
    probe = "import importlib.metadata as m; print(m.version('circuit-tracer'))"
    version = subprocess.run([args.ct_python, "-c", probe], capture_output=True, text=True).stdout.strip()
    from common import cpu_model  # here, not at the top: the side venv imports this file too

    lines = [f"Measured by `bench/graph_full_set.py` on {cpu_model()}, torch {torch.__version__} with "
             f"{torch.get_num_threads()} threads: SmolLM2-135M-Instruct with its prepared full set "
             f"({len(ts)} per-layer transcoders of {ts.d_sae} features), the {args.max_feature_nodes} most "
             f"influential features kept, against circuit-tracer {version} (TransformerLens backend) in a side venv. "
             "Time: the graph call alone; memory: its peak resident set above the process's before the call. "
             "circuit-tracer's model (TransformerLens, SmolLM2's weights) against slmviz's logits on the same ids: "
             f"max |Δ| {max(r['circuit-tracer']['logits_vs_slmviz_max_abs'] for r in results):.1g}.", "",
             "| prompt | slmviz | circuit-tracer | time ratio | slmviz peak | circuit-tracer peak | "
             "replacement / completeness (slmviz; circuit-tracer) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        a, b = r["slmviz"], r["circuit-tracer"]
        lines.append(f"| {r['tokens']} tokens | {a['seconds']:.1f} s | {b['seconds']:.1f} s | "
                     f"{b['seconds'] / a['seconds']:.2f}x faster | {a['peak_gb']:.2f} GB | {b['peak_gb']:.2f} GB | "
                     f"{a['replacement']:.3f} / {a['completeness']:.3f}; {b['replacement']:.3f} / "
                     f"{b['completeness']:.3f} |")
    return "\n".join(lines) + "\n"


def reset_peak() -> float:
    """Reset this process's peak resident set (VmHWM) to its current one; return that, in GB."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_gb("VmRSS")


def _status_gb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 2**20
    raise KeyError(key)


def slmviz_side(n: int, cap: int) -> dict:
    sys.path.insert(0, str(REPO))
    import slmviz

    model = slmviz.load()
    ts = slmviz.load_transcoders("plt", model=model)
    ids = json.loads((WORK / f"ids_{n}.json").read_text())
    before = reset_peak()
    t = time.perf_counter()
    g = slmviz.attribution_graph(ids, transcoders=ts, model=model, max_feature_nodes=cap, progress=False)
    seconds = time.perf_counter() - t
    peak = _status_gb("VmHWM") - before
    scores = g.scores()
    return {"seconds": seconds, "peak_gb": peak, "features": int((g.nodes["kind"] == "feature").sum()), **scores}


def circuit_tracer_side(n: int, cap: int) -> dict:
    import transformers
    import yaml
    from attribution_graph_circuit_tracer import tl_replacement_model
    from circuit_tracer import attribute
    from circuit_tracer.graph import compute_graph_scores
    from circuit_tracer.transcoder.single_layer_transcoder import load_transcoder_set

    folder = Path((WORK / "model").read_text())
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    # the folder's tokenizer_config.json names transformers 5's TokenizersBackend, which transformers 4 lacks; and
    # TransformerLens needs a tokenizer with a name_or_path: so save one from tokenizer.json and load it back
    special = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"),
        **{k: special[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if k in special})
    tokenizer.save_pretrained(WORK / "tokenizer")
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(WORK / "tokenizer")
    config = yaml.safe_load((WORK / "set" / "config.yaml").read_text())
    paths = {i: str(WORK / "set" / f) for i, f in enumerate(config["transcoders"])}
    tset = load_transcoder_set(paths, scan=config["scan"], feature_input_hook=config["feature_input_hook"],
                               feature_output_hook=config["feature_output_hook"], device=torch.device("cpu"),
                               dtype=torch.float32, lazy_encoder=False, lazy_decoder=False)
    model = tl_replacement_model(hf, tokenizer, WORK / "tokenizer", tset, "SmolLM2-135M-Instruct")
    del hf
    ids = torch.tensor(json.loads((WORK / f"ids_{n}.json").read_text()))
    with torch.no_grad():
        same_model = float((model(ids[None])[0] - torch.load(WORK / f"logits_{n}.pt")).abs().max())
    before = reset_peak()
    t = time.perf_counter()
    graph = attribute(ids, model, max_feature_nodes=cap)
    seconds = time.perf_counter() - t
    peak = _status_gb("VmHWM") - before
    replacement, completeness = compute_graph_scores(graph)
    return {"seconds": seconds, "peak_gb": peak, "features": int(len(graph.selected_features)),
            "replacement": float(replacement), "completeness": float(completeness),
            "logits_vs_slmviz_max_abs": same_model}


if __name__ == "__main__":
    sys.path.insert(0, str(BENCH_DIR))
    main()
