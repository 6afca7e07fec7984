"""train_transcoders against EleutherAI's sparsify (`eai-sparsify`, in a side venv), on the same model, hookpoints,
width, k and tokens, in one run; both sets then scored by the same slmviz code on the same held-out text.

- Hookpoints: every chosen layer's MLP, read at its input (the pre-MLP norm's output: slmviz's blocks.L.mlp.hook_in,
  sparsify's `layers.L.mlp` input) and written at its output (blocks.L.hook_mlp_out); skip transcoders.
- Tokens: the first documents of the "mixed" corpus (the prepared sets' corpus), the same text for both. slmviz
  cuts it into windows of 128 tokens per document, as its trainer does; sparsify gets the same token stream cut
  into rows of 128 (its chunk_and_tokenize concatenates documents the same way). 512 tokens a step for both.
  slmviz shuffles within blocks of train_transcoders' default 16,384 tokens (the prepared recipe's; its memory is
  one block's rows, whatever the tokens), sparsify streams its batches.
- Each trains as its authors recommend: slmviz BatchTopK with Adam (the prepared recipe's lr 2e-3), saved as
  JumpReLU; sparsify TopK with its default signum optimizer and width-scaled learning rate. Timed: the training
  call alone (train_transcoders; sparsify's Trainer.fit), after each has loaded the model, with torch's default
  threads. Dtypes: each side's own default on a CPU. sparsify keeps its coders and the model in fp32 there (its
  bf16 autocast is enabled only where torch.cuda.is_bf16_supported()); slmviz's dtype=None picks bf16 matmuls
  where they measure >= 1.5x faster than fp32 on this CPU (features.train.fastest_dtype), else fp32. `--dtype
  float32` forces slmviz to fp32 for a like-for-like figure. The table names the dtype each side ran.
- Quality: slmviz.evaluate_transcoders on the corpus's held-out split (every layer's EV, L0, dead fraction, and the
  model with every chosen MLP replaced at once), sparsify's coders converted to slmviz TopK skip transcoders
  (encoder.weight -> W_enc.T, W_dec, b_dec, W_skip as saved; sparsify adds no b_dec to a transcoder's input).

    .venv/bin/python bench/peers/sparsify_compare.py --sparsify-python /work/sparsify-venv/bin/python \
        [--layers 30] [--tokens 32768] [--d-sae 4096] [--k 64] [--eval-tokens 8192]

The side venv: python3 -m venv /work/sparsify-venv && /work/sparsify-venv/bin/pip install
/opt/wheels/torch-2.13.0*.whl eai-sparsify (the CPU torch wheel first, so no CUDA build is pulled).
Targets (issue 24): slmviz >= 1.5x sparsify's tokens/s, with EV at least as good. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import Row, head_of, main
from safetensors.torch import load_file

import slmviz
from slmviz import TranscoderSet, train_transcoders
from slmviz.corpora.named import resolve_corpus
from slmviz.corpora.reading import iter_documents
from slmviz.scans.batches import iter_windows
from slmviz.training.config import fastest_dtype

CTX = 128
SIDE = Path(__file__).with_name("sparsify_side.py")


def run(args: argparse.Namespace) -> list[Row]:
    model = slmviz.load()
    layers = list(range(min(args.layers, model.cfg.n_layers)))
    corpus = head_of(resolve_corpus("mixed", model), 2 * args.tokens, model)
    heldout = resolve_corpus("mixed", model, split="heldout")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        stream = [i for w in iter_windows(model.tokenizer, iter_documents(corpus), CTX) for i in w.ids]
        n_rows = args.tokens // CTX
        if len(stream) < n_rows * CTX:
            raise SystemExit(f"the corpus head has {len(stream)} tokens, fewer than {args.tokens}")
        np.asarray(stream[:n_rows * CTX], dtype=np.uint16).tofile(tmp / "tokens.u16")

        ours_dtype = args.dtype or fastest_dtype("cpu")  # what dtype=None picks (measured once per process)
        t = time.perf_counter()
        ours = train_transcoders(model, layers=layers, corpus=corpus, d_sae=args.d_sae, k=args.k,
                                 tokens=args.tokens, architecture="batchtopk", skip=True, batch_tokens=512, lr=2e-3,
                                 dtype=args.dtype, out=tmp / "slmviz", progress=False)
        ours_s = time.perf_counter() - t
        print(f"slmviz: {ours_s:.1f} s ({ours_dtype})", flush=True)

        side = subprocess.run([args.sparsify_python, str(SIDE), str(model.path), str(tmp / "tokens.u16"), str(CTX),
                               ",".join(map(str, layers)), str(args.d_sae), str(args.k), str(tmp / "sparsify")],
                              capture_output=True, text=True)
        if side.returncode:
            raise SystemExit(f"sparsify failed:\n{side.stderr[-4000:]}")
        theirs = json.loads(side.stdout.strip().splitlines()[-1])
        print(f"sparsify: {theirs['fit_s']:.1f} s", flush=True)
        theirs_set = TranscoderSet([from_sparsify(tmp / "sparsify" / f"layers.{L}.mlp.safetensors", L, args.k)
                                    for L in layers], name="sparsify")

        scores = {name: slmviz.evaluate_transcoders(ts, heldout, model=model, tokens=args.eval_tokens,
                                                    progress=False)
                  for name, ts in (("slmviz", ours), ("sparsify", theirs_set))}

    layer_tokens = args.tokens * len(layers)
    ours_rate, theirs_rate = layer_tokens / ours_s, layer_tokens / theirs["fit_s"]
    ev = {name: s["layers"]["explained_variance"] for name, s in scores.items()}
    shape = f"{len(layers)} layers x {args.tokens:,} tokens, d_sae {args.d_sae}, k {args.k}"
    rows = [Row(f"train_transcoders vs sparsify ({shape}), layer-tokens/s", f"{ours_rate:,.0f}",
                f"{theirs_rate:,.0f}", ours_rate / theirs_rate, ">= 1.5", ours_rate / theirs_rate >= 1.5,
                f"{ours_s:.1f} s vs {theirs['fit_s']:.1f} s; slmviz's matmuls in {ours_dtype}"
                f"{' (measured: dtype=None)' if args.dtype is None else ''}, sparsify's in float32")]
    rows.append(Row(f"median per-layer EV on mixed held-out ({args.eval_tokens:,} tokens)",
                    f"{ev['slmviz'].median():.3f}", f"{ev['sparsify'].median():.3f}",
                    ev["slmviz"].median() - ev["sparsify"].median(), ">= 0 (difference)",
                    bool(ev["slmviz"].median() >= ev["sparsify"].median()),
                    f"min {ev['slmviz'].min():.3f} vs {ev['sparsify'].min():.3f}; layers where slmviz's EV is "
                    f"higher: {int((ev['slmviz'] >= ev['sparsify']).sum())}/{len(layers)}"))
    l0 = {name: s["layers"]["l0"].median() for name, s in scores.items()}
    dead = {name: s["layers"]["frac_dead"].median() for name, s in scores.items()}
    rows.append(Row("median per-layer L0 / dead fraction", f"{l0['slmviz']:.1f} / {dead['slmviz']:.3f}",
                    f"{l0['sparsify']:.1f} / {dead['sparsify']:.3f}", None, "", None))
    rep = {name: s["replaced"] for name, s in scores.items()}
    rows.append(Row("every chosen MLP replaced at once: CE-loss score / top-1 agreement",
                    f"{rep['slmviz']['ce_loss_score']:.3f} / {rep['slmviz']['top1_agreement']:.3f}",
                    f"{rep['sparsify']['ce_loss_score']:.3f} / {rep['sparsify']['top1_agreement']:.3f}",
                    rep["slmviz"]["ce_loss_score"] - rep["sparsify"]["ce_loss_score"], "", None))
    for name, s in scores.items():
        print(f"\n{name} per layer:\n{s['layers'].to_string()}")
    return rows


def from_sparsify(path: Path, layer: int, k: int) -> slmviz.SAE:
    """A sparsify skip transcoder's tensors -> slmviz's TopK skip transcoder at blocks.{layer}.mlp.hook_in ->
    blocks.{layer}.hook_mlp_out. sparsify computes relu(x @ encoder.weight.T + encoder.bias), keeps the top k,
    decodes with W_dec [d_sae, d_out] + b_dec, and adds x @ W_skip.T: slmviz's TopK formula with the same tensors
    (the ReLU before or after the top k gives the same activations)."""
    s = load_file(str(path))
    state = {"W_enc": s["encoder.weight"].T.contiguous(), "b_enc": s["encoder.bias"], "W_dec": s["W_dec"],
             "b_dec": s["b_dec"], "W_skip": s["W_skip"]}
    return slmviz.SAE.from_state(state, architecture="topk", k=k, skip=True, hook_name=f"blocks.{layer}.mlp.hook_in",
                                 hook_name_out=f"blocks.{layer}.hook_mlp_out")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sparsify-python", default="/work/sparsify-venv/bin/python")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=32_768)
    parser.add_argument("--d-sae", type=int, default=4096)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--eval-tokens", type=int, default=8192)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="slmviz's training dtype (default: measured, as train_transcoders' dtype=None)")


if __name__ == "__main__":
    torch.manual_seed(0)
    sys.exit(main(run, __doc__.splitlines()[0], add_args))
