"""circuit-tracer 0.5.0's own CLT loaders on folders slmviz wrote, and slmviz's on folders circuit-tracer wrote.

circuit-tracer's transcoder/cross_layer_transcoder.py imports only torch, numpy and safetensors, so it runs from the
unpacked wheel without its side venv (TransformerLens, nnsight); its graph code does not, and is not run here.

    mkdir -p /tmp/ctw && cd /tmp/ctw && unzip -q circuit_tracer-0.5.0-py3-none-any.whl -d src   # pip download
    .venv/bin/python bench/peers/clt_circuit_tracer.py [--ct-src /tmp/ctw/src] [--out FILE]

What it checks, on a random 4-layer CLT (d_model 64, d_sae 128, JumpReLU and ReLU):
1. circuit-tracer's `load_clt` reads slmviz's `save(format="circuit-tracer")` folder (lazy and eager decoders): the
   same features (`encode`) and the same reconstruction (`decode`) as slmviz's CLT on the same inputs.
2. slmviz's `load_clt` reads the folder circuit-tracer's `to_safetensors` writes: the same tensors.
3. circuit-tracer's `load_gemma_scope_2_clt` on slmviz's `save(format="gemma-scope-2")` folder with the paths
   {0: ..., n-1: ...} its caching code builds: what it does with the last layer (its loop is
   `range(max(paths.keys()))`).
Prints the figures and writes them to --out; nothing is asserted.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import RESULTS

from slmviz.replacement.clt import CrossLayerTranscoder  # noqa: E402
from slmviz.replacement.load import load_clt  # noqa: E402

N_LAYERS, D_MODEL, D_SAE, POS = 4, 64, 128, 9


def compare(ct_mod, architecture: str, work: Path) -> list[str]:
    clt = CrossLayerTranscoder.random(N_LAYERS, D_MODEL, D_SAE, seed=3, architecture=architecture,
                                      input_hook="hook_resid_mid")
    x = torch.randn(N_LAYERS, POS, D_MODEL, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours_f = torch.stack([clt.encode(L, x[L]) for L in range(N_LAYERS)])  # [n, pos, d_sae]
        ours_y = clt(x)  # [n, pos, d_model]
    folder = clt.save(work / f"ct_{architecture}", format="circuit-tracer")
    lines = []
    for lazy in (False, True):
        ct = ct_mod.load_clt(str(folder), device=torch.device("cpu"), dtype=torch.float32, lazy_decoder=lazy)
        with torch.no_grad():
            f = ct.encode(x)
            y = ct.decode(f.to_sparse())
        lines.append(f"| {architecture} | load_clt(lazy_decoder={lazy}) | {ct.n_layers} | "
                     f"{(f - ours_f).abs().max().item():.2e} | {(y - ours_y).abs().max().item():.2e} | "
                     f"{int((f > 0).sum())} |")
    ct = ct_mod.load_clt(str(folder), device=torch.device("cpu"), dtype=torch.float32, lazy_decoder=False)
    back_dir = work / f"ct_written_{architecture}"
    ct.to_safetensors(str(back_dir))
    back = load_clt(back_dir, input_hook="hook_resid_mid")
    worst = max((back.tensors()[k] - v).abs().max().item() for k, v in clt.tensors().items())
    lines.append(f"| {architecture} | slmviz load_clt of ct.to_safetensors | {back.n_layers} | max tensor diff "
                 f"{worst:.1e} | | |")
    return lines


def gemma_scope_2(ct_mod, work: Path) -> str:
    clt = CrossLayerTranscoder.random(N_LAYERS, D_MODEL, D_SAE, seed=4)
    folder = clt.save(work / "clt" / "width_128_l0_medium", format="gemma-scope-2")
    paths = {i: str(folder / f"params_layer_{i}.safetensors") for i in range(N_LAYERS)}
    ours = load_clt(folder)
    try:
        ct = ct_mod.load_gemma_scope_2_clt(paths, device=torch.device("cpu"), dtype=torch.float32)
        got = f"a CLT of {ct.n_layers} layers"
    except Exception as e:  # what circuit-tracer raises is the finding
        got = f"{type(e).__name__}: " + " ".join(line.strip() for line in str(e).splitlines()[:2])[:300].rstrip(".")
    return (f"circuit-tracer's load_gemma_scope_2_clt on {N_LAYERS} files (paths 0..{N_LAYERS - 1}): {got}. Its loop "
            f"reads the files 0..{N_LAYERS - 2}, so its CLT has {N_LAYERS - 1} layers while each w_dec has {N_LAYERS} "
            f"slots: load_state_dict refuses the shapes, and the last layer's file is never read. slmviz's load_clt: a "
            f"CLT of {ours.n_layers} layers.")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ct-src", default="/tmp/ctw/src")
    ap.add_argument("--out", default=str(RESULTS / "clt_circuit_tracer.md"))
    args = ap.parse_args()
    sys.path.insert(0, args.ct_src)
    from circuit_tracer.transcoder import cross_layer_transcoder as ct_mod

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows = compare(ct_mod, "jumprelu", work) + compare(ct_mod, "relu", work)
        gs = gemma_scope_2(ct_mod, work)
    text = "\n".join([
        "# circuit-tracer 0.5.0's CLT loaders and slmviz's CLT files", "",
        f"Made by `bench/peers/clt_circuit_tracer.py` (a random CLT: {N_LAYERS} layers, d_model {D_MODEL}, "
        f"d_sae {D_SAE}, {POS} positions of random inputs, fp32, CPU).", "",
        "| activation | reader | layers | max |features diff| | max |reconstruction diff| | active |",
        "| --- | --- | --- | --- | --- | --- |", *rows, "", gs, ""])
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
