"""Write the files 0.2.0 saved, once, with 0.2.0's code: the fixtures tests/test_saved_files.py reads back.

Run from the repository root at the 0.2.0 commit (a3c8453), never again after the 0.3 redesign (its point is that
today's code reads what yesterday's wrote):

    .venv/bin/python tests/data/v0_2/make_fixtures.py

Everything is trained on a tiny random LLaMA (saved here too, so the fixtures never depend on transformers'
random initialisation) with a fixed corpus and seed:
- sae/, transcoder/        train_sae's out folders (SAELens layout + the finished checkpoint);
- plt/                     train_transcoders(kind="plt")'s out folder (slmviz's layout + checkpoint);
- plt_circuit_tracer/      the same set saved in circuit-tracer's layout;
- clt/                     train_transcoders(kind="clt")'s out folder (Gemma Scope 2's layout + checkpoint);
- clt_plain/               a CLT without a skip path (train_transcoders' out folder);
- clt_circuit_tracer/      that CLT saved in circuit-tracer's layout (which has no skip path);
- cut_sae/, cut_plt/, cut_clt/  checkpoints of the same three runs stopped part way (a resume must end on the
                           finished weights above);
- trace.safetensors, scan/ a saved Trace and a saved Scan;
- graph.json, graph_clt.json  attribution graphs with pins, supernodes and labels (the workbench's state).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/, for conftest.build_tiny_model

from conftest import build_tiny_model  # noqa: E402
from slmviz.features.train import train_sae  # noqa: E402
from slmviz.features.train_set import train_transcoders  # noqa: E402

import slmviz  # noqa: E402

SMALL = dict(d_sae=48, k=4, batch_tokens=128, window=16, forward_tokens=128, buffer_tokens=512, progress=False,
             dtype="float32", checkpoint_every=0)
TOKENS = 1200
PROMPT = [1, 7, 12, 3, 44, 9, 101, 23]
RUNS = {  # name -> (trainer, its arguments beyond SMALL and the corpus)
    "sae": (train_sae, dict(hook="blocks.1.hook_resid_post", architecture="topk")),
    "transcoder": (train_sae, dict(hook="blocks.0.mlp.hook_in", hook_out="blocks.0.hook_mlp_out",
                                   architecture="batchtopk", skip=True)),
    "plt": (train_transcoders, dict(kind="plt", architecture="batchtopk", skip=True)),
    "clt": (train_transcoders, dict(kind="clt", architecture="batchtopk", skip=True)),
    "clt_plain": (train_transcoders, dict(kind="clt", architecture="batchtopk", skip=False)),
}
STOP_AFTER = {"sae": 5, "plt": 4, "clt": 5}  # progress calls before the cut (mid-block in each)


def corpus() -> list[str]:
    return [" ".join(f"w{(i * 7 + j * 3) % 120}" for j in range(20 + i % 13)) for i in range(60)]


def train(name: str, model, out: Path, stop: int | None = None):
    fn, extra = RUNS[name]
    args = {**SMALL, **extra, "corpus": corpus(), "tokens": TOKENS, "out": out}
    if stop is not None:
        calls = []

        def cut(stats):
            calls.append(stats["tokens"])
            if len(calls) == stop:
                raise KeyboardInterrupt

        args["progress"] = cut
        try:
            fn(model, **args)
        except KeyboardInterrupt:
            return None
        raise AssertionError(f"{name} finished before its cut")
    return fn(model, **args)


def workbench(graph) -> None:
    features = graph.nodes[graph.nodes.kind == "feature"].node_id.tolist()
    graph.pin(*features[:4])
    graph.supernode("pair", features[:2])
    graph.label(features[0], "a hand-written label")


def main() -> None:
    for old in HERE.iterdir():
        if old.is_dir():
            shutil.rmtree(old)
    tiny = build_tiny_model(HERE / "tiny_llama", "llama_gqa")
    model = slmviz.load(tiny)
    (HERE / "corpus.json").write_text(json.dumps(corpus()))
    trained = {name: train(name, model, HERE / name) for name in RUNS}
    for name, stop in STOP_AFTER.items():
        train(name, model, HERE / f"cut_{name}", stop=stop)
    trained["plt"].save(HERE / "plt_circuit_tracer", format="circuit-tracer")
    trained["clt_plain"].save(HERE / "clt_circuit_tracer", format="circuit-tracer")  # no skip path there
    for name, path in (("plt", "graph.json"), ("clt", "graph_clt.json")):
        g = slmviz.attribution_graph(PROMPT, transcoders=trained[name], model=model, progress=False)
        workbench(g)
        g.save_json(HERE / path)
    model.trace(PROMPT).save(HERE / "trace.safetensors")
    scan = slmviz.scan(corpus()[:6], hooks=["blocks.1.hook_resid_post"], top_k=4, model=model, progress=False)
    scan.save(HERE / "scan")
    (HERE / "VERSION").write_text(f"slmviz {slmviz.__version__}, torch {torch.__version__}\n")


if __name__ == "__main__":
    main()
