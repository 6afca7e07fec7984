"""An attribution graph over SmolLM2's full prepared PLT set (`slmviz prepare --transcoders plt`) or its CLT
(`--kind clt`), for 16- and 64-token prompts: slmviz against circuit-tracer (side venv, CPU) on the same model,
replacement model, token ids and settings.

Both keep the `--max-feature-nodes` most influential features (default 4096, what the app uses for a full set) by
circuit-tracer's partial-influence rounds, and take the same salient logits (10, 0.95). The set reaches circuit-tracer
as files: slmviz saves a PLT set in circuit-tracer's transcoder_set layout, which circuit-tracer's
`load_transcoder_set` reads; a CLT with a skip path is prepared in Gemma Scope 2's layout, which its
`load_gemma_scope_2_clt` reads (given one path more than there are layers: its loop runs over range(max(paths)), which
would leave out the last layer, bench/results/clt_circuit_tracer.md). Its TransformerLens backend runs SmolLM2's
weights (bench/peers/attribution_graph_circuit_tracer.py shows that layout and backend build the same graphs as slmviz).
Each figure is measured in a fresh process, after the model and set are loaded:
- time: the graph call alone (slmviz.attribution_graph; circuit_tracer.attribute), each side's default batch size;
- peak memory: the process's peak resident set during that call above its resident set just before it (the peak is
  reset through /proc/self/clear_refs first), so the model and set each side holds are not counted.
The token ids start with the tokenizer's special token, which both sides keep as it is.

    .venv/bin/python bench/peers/graph_full_set.py [--kind plt|clt] [--ct-python /work/ct-venv/bin/python]
        [--lengths 16 64] [--sides slmviz circuit-tracer] [--max-feature-nodes 4096] [--out FILE]

`--sides slmviz` measures slmviz alone (circuit-tracer's column then reads "not run"). A side that the kernel kills
for memory is recorded as such; circuit-tracer is then run again at `--ct-fallback-batch-size` (64, slmviz's
default), and its cell names that batch size.

The side venv is built as bench/peers/attribution_graph_circuit_tracer.py's docstring says. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

# common is imported inside the functions: the circuit-tracer side venv runs this file too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first

WORK = Path("/tmp/slmviz_graph_full_set")
SIDES = ("slmviz", "circuit-tracer")
XEON = "Intel(R) Xeon(R) Processor"  # the CPU of the rows measured before each row named its own
TEXT = ("When Maria finished her shift at the hospital, she walked to the small bakery on the corner, where the owner "
        "had saved her a loaf of rye bread as he did every Friday. They talked about the storm that was coming from "
        "the coast, the price of flour, and his daughter, who had just started university in Lyon to study chemistry "
        "and wrote home every week about her classes, her roommate and the food, which she said was better than his")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", default="", choices=["", *SIDES])
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    parser.add_argument("--kind", default="plt", choices=["plt", "clt"])
    parser.add_argument("--ct-python", default="/work/ct-venv/bin/python")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--max-feature-nodes", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=0, help="(a side's) batch size; 0: that side's default")
    parser.add_argument("--ct-fallback-batch-size", type=int, default=64,
                        help="where circuit-tracer at its default batch size is killed for memory, run it again "
                             "at this one (0: do not)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.side == "slmviz":
        print(json.dumps(slmviz_side(args.kind, args.length, args.max_feature_nodes)))
    elif args.side == "circuit-tracer":
        print(json.dumps(circuit_tracer_side(args.kind, args.length, args.max_feature_nodes, args.batch_size)))
    else:
        run(args)


def run(args: argparse.Namespace) -> None:
    from common import RESULTS, cpu_model

    import slmviz
    from slmviz.graphs.attribution import prepend_special
    from slmviz.replacement.prepared import prepared_dir

    model = slmviz.load()
    ts = slmviz.load_transcoders(args.kind, model=model)
    work = WORK / args.kind
    work.mkdir(parents=True, exist_ok=True)
    if args.kind == "clt":  # prepared in Gemma Scope 2's layout (a JumpReLU CLT with a skip path): read in place
        (work / "set_dir").write_text(str(prepared_dir(model, "clt")))
    elif not (work / "set" / "config.yaml").exists():
        ts.save(work / "set", format="circuit-tracer")
    ids = prepend_special(model.tokenizer, model.encode(TEXT)).tolist()
    if len(ids) < max(args.lengths):
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {max(args.lengths)}")
    (work / "model").write_text(str(model.path))
    args.out = args.out or RESULTS / ("graph_full_set.md" if args.kind == "plt" else "graph_full_set_clt.md")
    figures_file = RESULTS / "graph_full_set.json"  # every run's figures, by "kind cap", then tokens, then side
    runs = json.loads(figures_file.read_text()) if figures_file.exists() else {}
    kept = runs.setdefault(f"{args.kind} {args.max_feature_nodes}", {})  # tokens -> side -> its figures
    for n in args.lengths:
        (work / f"ids_{n}.json").write_text(json.dumps(ids[:n]))
        torch.save(model.logits(ids[:n]).float(), work / f"logits_{n}.pt")  # the side checks its model against it
        for side, python in (("slmviz", sys.executable), ("circuit-tracer", args.ct_python)):
            if side not in args.sides:
                continue
            figures = run_side(python, side, args, n)
            if figures.get("killed") and side == "circuit-tracer" and args.ct_fallback_batch_size:
                print(f"circuit-tracer was killed for memory at {n} tokens; again at batch size "
                      f"{args.ct_fallback_batch_size}", flush=True)
                figures = {**run_side(python, side, args, n, args.ct_fallback_batch_size),
                           "default_batch_size": "killed for memory"}
            kept.setdefault(str(n), {})[side] = {**figures, "cpu": cpu_model()}
            print(n, side, kept[str(n)][side], flush=True)
            figures_file.write_text(json.dumps(runs, indent=1) + "\n")  # each side as it ends: a later failure keeps it
    args.out.write_text(markdown(kept, args, ts))
    print(f"wrote {args.out}")


def run_side(python: str, side: str, args: argparse.Namespace, n: int, batch_size: int = 0) -> dict:
    """One side's figures from a fresh process; {"killed": True} where the kernel killed it (SIGKILL: on this
    machine, its out-of-memory killer), which is a result to record, not a failure of the bench."""
    out = subprocess.run([python, __file__, "--side", side, "--kind", args.kind, "--length", str(n),
                          "--max-feature-nodes", str(args.max_feature_nodes), "--batch-size", str(batch_size)],
                         capture_output=True, text=True)
    if out.returncode == -9:
        return {"killed": True, "batch_size": batch_size or "default"}
    if out.returncode:
        raise SystemExit(f"{side} failed at {n} tokens:\n{out.stderr[-4000:]}")
    return {**json.loads(out.stdout.strip().splitlines()[-1]), **({"batch_size": batch_size} if batch_size else {})}


def markdown(kept: dict[str, dict], args: argparse.Namespace, ts) -> str:
    """The table of every length measured for this kind and cap (graph_full_set.json keeps earlier runs' rows)."""
    probe = "import importlib.metadata as m; print(m.version('circuit-tracer'))"
    version = subprocess.run([args.ct_python, "-c", probe], capture_output=True, text=True).stdout.strip()
    from common import cpu_model

    what = (f"its prepared full set ({len(ts)} per-layer transcoders of {ts.d_sae} features)" if args.kind == "plt"
            else f"its prepared cross-layer transcoder ({ts.n_layers} layers of {ts.d_sae} features)")
    diffs = [r["circuit-tracer"]["logits_vs_slmviz_max_abs"] for r in kept.values() if "circuit-tracer" in r]
    # each side's row keeps the CPU it ran on (a row measured before that was kept is the 2-core Xeon's, 2026-12-02)
    cpus = sorted({r.get("cpu", XEON) for sides in kept.values() for r in sides.values()}) or [cpu_model()]
    lines = [f"Measured by `bench/peers/graph_full_set.py{' --kind clt' if args.kind == 'clt' else ''}` on "
             f"{' and '.join(cpus)} (2 cores; the CPU column names each row's), "
             f"torch {torch.__version__} with {torch.get_num_threads()} threads: SmolLM2-135M-Instruct with {what}, "
             f"the {args.max_feature_nodes} most influential features kept, against circuit-tracer {version} "
             "(TransformerLens backend) in a side venv. Time: the graph call alone; memory: its peak resident set "
             "above the process's before the call."
             + (" circuit-tracer's model (TransformerLens, SmolLM2's weights) against slmviz's logits on the same "
                f"ids: max |Δ| {max(diffs):.1g}." if diffs else ""), "",
             "| prompt | CPU | slmviz | circuit-tracer | time ratio | slmviz peak | circuit-tracer peak | "
             "features kept | replacement / completeness (slmviz; circuit-tracer) |", "|" + " --- |" * 9]
    for n in sorted(kept, key=int):
        a, b = kept[n].get("slmviz"), kept[n].get("circuit-tracer")
        ratio = f"{b['seconds'] / a['seconds']:.2f}x faster" if a and b and "seconds" in a and "seconds" in b else "—"
        features = " / ".join(str(r["features"]) for r in (a, b) if r and "features" in r)
        cpu = " / ".join(sorted({r.get("cpu", XEON) for r in (a, b) if r}))
        lines.append(f"| {n} tokens | {cpu} | {cell(a, '{seconds:.1f} s')} | "
                     f"{cell(b, '{seconds:.1f} s', note=True)} | {ratio} | "
                     f"{cell(a, '{peak_gb:.2f} GiB')} | {cell(b, '{peak_gb:.2f} GiB')} | {features or '—'} | "
                     f"{cell(a, '{replacement:.3f} / {completeness:.3f}')}; "
                     f"{cell(b, '{replacement:.3f} / {completeness:.3f}')} |")
    return "\n".join(lines) + "\n"


def cell(figures: dict | None, template: str, note: bool = False) -> str:
    """One side's figures in a table cell, or "not run" where that side was not measured at that length, or what
    stopped it; with `note` (the row's first cell of that side), a run at another batch size than its default says
    so."""
    if not figures:
        return "not run"
    if figures.get("killed"):
        return "killed for memory"
    if not note:
        return template.format(**figures)
    suffix = (f" (batch {figures['batch_size']}; at its default batch size it was killed for memory)"
              if figures.get("default_batch_size") else f" (batch {figures['batch_size']})" if "batch_size" in figures
              else "")
    return template.format(**figures) + suffix


def slmviz_side(kind: str, n: int, cap: int) -> dict:
    from common import reset_peak, status_gb

    import slmviz

    model = slmviz.load()
    ts = slmviz.load_transcoders(kind, model=model)
    ids = json.loads((WORK / kind / f"ids_{n}.json").read_text())
    before = reset_peak()
    t = time.perf_counter()
    g = slmviz.attribution_graph(ids, transcoders=ts, model=model, max_feature_nodes=cap, progress=False)
    seconds = time.perf_counter() - t
    peak = status_gb("VmHWM") - before
    scores = g.scores()
    return {"seconds": seconds, "peak_gb": peak, "features": int((g.nodes["kind"] == "feature").sum()), **scores}


def circuit_tracer_side(kind: str, n: int, cap: int, batch_size: int = 0) -> dict:
    import transformers
    from attribution_graph_circuit_tracer import tl_replacement_model
    from circuit_tracer import attribute
    from circuit_tracer.graph import compute_graph_scores
    from common import reset_peak, status_gb

    work = WORK / kind
    folder = Path((work / "model").read_text())
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    # the folder's tokenizer_config.json names transformers 5's TokenizersBackend, which transformers 4 lacks; and
    # TransformerLens needs a tokenizer with a name_or_path: so save one from tokenizer.json and load it back
    special = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"),
        **{k: special[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if k in special})
    tokenizer.save_pretrained(work / "tokenizer")
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(work / "tokenizer")
    tset = circuit_tracer_clt(work, hf.config.num_hidden_layers) if kind == "clt" else circuit_tracer_set(work)
    model = tl_replacement_model(hf, tokenizer, work / "tokenizer", tset, "SmolLM2-135M-Instruct")
    del hf
    ids = torch.tensor(json.loads((work / f"ids_{n}.json").read_text()))
    with torch.no_grad():
        same_model = float((model(ids[None])[0] - torch.load(work / f"logits_{n}.pt")).abs().max())
    before = reset_peak()
    t = time.perf_counter()
    graph = attribute(ids, model, max_feature_nodes=cap, **({"batch_size": batch_size} if batch_size else {}))
    seconds = time.perf_counter() - t
    peak = status_gb("VmHWM") - before
    replacement, completeness = compute_graph_scores(graph)
    return {"seconds": seconds, "peak_gb": peak, "features": int(len(graph.selected_features)),
            "replacement": float(replacement), "completeness": float(completeness),
            "logits_vs_slmviz_max_abs": same_model}


def circuit_tracer_set(work: Path):
    """circuit-tracer's TranscoderSet of the PLT set slmviz saved in its layout."""
    import yaml
    from circuit_tracer.transcoder.single_layer_transcoder import load_transcoder_set

    config = yaml.safe_load((work / "set" / "config.yaml").read_text())
    paths = {i: str(work / "set" / f) for i, f in enumerate(config["transcoders"])}
    return load_transcoder_set(paths, scan=config["scan"], feature_input_hook=config["feature_input_hook"],
                               feature_output_hook=config["feature_output_hook"], device=torch.device("cpu"),
                               dtype=torch.float32, lazy_encoder=False, lazy_decoder=False)


def circuit_tracer_clt(work: Path, n_layers: int):
    """circuit-tracer's CrossLayerTranscoder of the prepared CLT (Gemma Scope 2's layout, read in place). Its
    load_gemma_scope_2_clt reads the files of range(max(paths)): one key past the last layer makes that every layer
    (the value is never opened). The CLT reads the MLP's input after the norm's weight and writes its output: in
    circuit-tracer's names for its ReplacementMLP, mlp.hook_in and mlp.hook_out (formats.circuit_tracer's
    SET_INPUT_HOOKS)."""
    from circuit_tracer.transcoder.cross_layer_transcoder import load_gemma_scope_2_clt

    folder = Path((work / "set_dir").read_text())
    paths = {i: str(folder / f"params_layer_{i}.safetensors") for i in range(n_layers)}
    paths[n_layers] = "never read: circuit-tracer's loop stops before its largest key"
    return load_gemma_scope_2_clt(paths, feature_input_hook="mlp.hook_in", feature_output_hook="mlp.hook_out",
                                  device=torch.device("cpu"), dtype=torch.float32)


if __name__ == "__main__":
    main()
