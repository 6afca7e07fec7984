"""train_sae's whole pipeline (activations + training) against SAELens's training runner, side by side on this CPU.

Both train a TopK SAE (k 32, d_sae 4608) on SmolLM2-135M-Instruct's blocks.15.hook_resid_post (transformers'
`model.layers.15` output) over the same jsonl corpus (the broad corpus's training split, features.bundled), context
128, 4096-token batches, the same number of tokens, each in a fresh process. SAELens 6.54 runs through
/work/shared/peers/saelens_train_bench.py in its own venv (never a dependency of slmviz):

    python3 -m venv /tmp/saelens-venv
    /tmp/saelens-venv/bin/pip install --find-links /opt/wheels torch==2.13.0 sae-lens==6.54.12

Rows: tokens/s of the train_sae call (model loaded; corpus read, forwards, steps, save) with slmviz's default
dtype (measured: features.train.fastest_dtype) and with fp32, against SAELens's end-to-end training tokens/s
(runner built, fp32, its default); and the explained variance and L0 of each SAE on held-out text, computed by
the same code for both (slmviz.evaluate_sae loads SAELens's saved folder). SAELens's learning rate is 2e-3, the
value its peer script notes learns far more than its default 3e-4 in so few tokens; slmviz uses its own default.

`--memory`: peak RSS of train_sae at 1x and 4x the tokens (fresh processes, layer-3 hook, the peak during the call).

    OMP_NUM_THREADS=1 .venv/bin/python bench/peers/sae_train.py [--tokens 98304] [--memory]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import REPO, Row, cpu_model, main

SAELENS_PYTHON = Path(os.environ.get("SAELENS_PYTHON", "/tmp/saelens-venv/bin/python"))
PEER = Path(os.environ.get("SAELENS_PEER", "/work/shared/peers/saelens_train_bench.py"))
HOOK = "blocks.15.hook_resid_post"
TARGET = 1.5

CHILD = r"""
import json, sys, time
sys.path.insert(0, {repo!r})
import slmviz
from slmviz import train_sae
model = slmviz.load()
t = time.perf_counter()
sae = train_sae(model, {hook!r}, {corpus!r}, d_sae=4608, k=32, tokens={tokens}, out={out!r}, dtype={dtype!r},
                batch_tokens=4096, window=128, progress=False, buffer_tokens={buffer})
seconds = time.perf_counter() - t
print(json.dumps({{"seconds": seconds, "tokens": sae.metadata["trained_on_tokens"],
                   "dtype": sae.metadata["training_config"]["dtype"]}}))
"""

MEMORY_CHILD = r"""
import json, sys
sys.path.insert(0, {repo!r})
import slmviz
from slmviz import train_sae
def status_gb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1e6
model = slmviz.load()
after_load = status_gb("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := current RSS: the peak from here on is the training's
train_sae(model, "blocks.3.hook_resid_post", {corpus!r}, d_sae=4608, k=32, tokens={tokens}, out={out!r},
          batch_tokens=4096, window=128, progress=False, buffer_tokens=16384)
print(json.dumps({{"after_load_gb": after_load, "peak_gb": status_gb("VmHWM")}}))
"""


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def run_slmviz(corpus: str, tokens: int, dtype: str | None, scratch: Path) -> dict:
    out = scratch / f"slmviz_{dtype}"
    code = CHILD.format(repo=str(REPO), hook=HOOK, corpus=corpus, tokens=tokens, out=str(out), dtype=dtype,
                        buffer=min(65_536, tokens))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result = _last_json(done.stdout)
    result["folder"] = str(out)
    print("slmviz", result, flush=True)
    return result


def run_saelens(corpus: str, tokens: int, scratch: Path) -> dict:
    import slmviz

    out = scratch / "saelens"
    env = {**os.environ, "MODEL_DIR": str(slmviz.load().path), "CORPUS": corpus, "OUT": str(out),
           "TRAIN_TOKENS": str(tokens), "LR": "2e-3", "EVAL": "0"}
    done = subprocess.run([str(SAELENS_PYTHON), str(PEER)], capture_output=True, text=True, env=env, check=True)
    text = done.stdout
    summary = json.loads(text[text.index("SUMMARY ") + len("SUMMARY "):])
    summary["folder"] = str(out)
    print("saelens", {k: summary[k] for k in ("train_tokens", "t_train_loop_s", "t_run_total_incl_save_s",
                                              "train_phase_tok_s", "steady_state_tok_s", "llm_forward_s",
                                              "sae_step_s")}, flush=True)
    return summary


def quality(folder: str, heldout: str, tokens: int) -> dict:
    import slmviz
    from slmviz.features.load import load_folder

    model = slmviz.load()
    sae = load_folder(folder)
    if sae.hook_name not in model.hook_names:  # SAELens's cfg.json names the module it read: model.layers.15
        sae.hook_name = sae.hook_name_out = HOOK
    return slmviz.evaluate_sae(sae, heldout, model=model, tokens=tokens, progress=False)


def throughput_rows(args: argparse.Namespace) -> list[Row]:
    from slmviz.corpora.broad import broad_corpus

    train, heldout = (str(p) for p in broad_corpus())
    scratch = Path(tempfile.mkdtemp(prefix="sae_train_bench_"))
    try:
        ours = run_slmviz(train, args.tokens, None, scratch)
        ours32 = run_slmviz(train, args.tokens, "float32", scratch)
        theirs = run_saelens(train, args.tokens, scratch)
        q_ours = quality(ours["folder"], heldout, args.eval_tokens)
        q_theirs = quality(theirs["folder"], heldout, args.eval_tokens)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    ours_tps = ours["tokens"] / ours["seconds"]
    ours32_tps = ours32["tokens"] / ours32["seconds"]
    theirs_tps = theirs["train_tokens"] / theirs["t_run_total_incl_save_s"]
    ratio = ours_tps / theirs_tps
    q_note = (f"held-out ({args.eval_tokens} tokens, evaluate_sae): slmviz EV {q_ours['explained_variance']:.3f} at "
              f"L0 {q_ours['l0']:.1f}, SAELens EV {q_theirs['explained_variance']:.3f} at L0 {q_theirs['l0']:.1f}; "
              f"CE-loss score {q_ours['ce_loss_score']:.3f} vs {q_theirs['ce_loss_score']:.3f}")
    cpu = f"{cpu_model()}, {os.environ.get('OMP_NUM_THREADS', 'default')} OMP threads, CPU shared with other agents"
    better = q_ours["explained_variance"] >= q_theirs["explained_variance"]
    return [
        Row(f"train_sae pipeline tokens/s ÷ SAELens 6.54 runner: TopK k=32, d_sae 4608, {HOOK}, context 128, "
            f"4096-token batches, {args.tokens} tokens", f"{ours_tps:.0f} tokens/s ({ours['dtype']})",
            f"{theirs_tps:.0f} tokens/s (fp32)", ratio, f"≥ {TARGET}, EV at least as good",
            ratio >= TARGET and better,
            f"{cpu}; SAELens's training loop alone {theirs['train_phase_tok_s']:.0f} tokens/s, its forwards "
            f"{theirs['llm_forward_s']:.0f} s of {theirs['t_train_loop_s']:.0f} s; {q_note}"),
        Row("(evidence) train_sae in fp32 ÷ SAELens (the dtype default is measured: fastest_dtype)",
            f"{ours32_tps:.0f} tokens/s", f"{theirs_tps:.0f} tokens/s", ours32_tps / theirs_tps, "—", None,
            f"slmviz {ours['dtype']} ÷ fp32: {ours_tps / ours32_tps:.2f}"),
    ]


def memory_rows(args: argparse.Namespace) -> list[Row]:
    from slmviz.corpora.broad import broad_corpus

    train = str(broad_corpus()[0])
    results = []
    for tokens in (args.memory_tokens, 4 * args.memory_tokens):
        with tempfile.TemporaryDirectory() as out:
            code = MEMORY_CHILD.format(repo=str(REPO), corpus=train, tokens=tokens, out=out)
            start = time.perf_counter()
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            results.append({"tokens": tokens, "seconds": time.perf_counter() - start, **_last_json(done.stdout)})
            print(results[-1], flush=True)
    small, large = results
    ratio = large["peak_gb"] / small["peak_gb"]
    note = "; ".join(f"{r['tokens']} tokens: peak {r['peak_gb']:.3f} GB (after load {r['after_load_gb']:.3f} GB), "
                     f"{r['seconds']:.0f} s" for r in results)
    return [Row("train_sae peak RSS, 4x tokens ÷ 1x (fresh processes, blocks.3.hook_resid_post, 16k-token buffer)",
                f"{large['peak_gb']:.3f} GB", f"{small['peak_gb']:.3f} GB", ratio, "≤ 1.05", ratio <= 1.05, note)]


def run(args: argparse.Namespace) -> list[Row]:
    return memory_rows(args) if args.memory else throughput_rows(args)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=24 * 4096, help="tokens each side trains on")
    parser.add_argument("--eval-tokens", type=int, default=20_000, help="held-out tokens for EV / L0 / CE")
    parser.add_argument("--memory", action="store_true", help="only the peak-RSS rows")
    parser.add_argument("--memory-tokens", type=int, default=65_536)


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0], add_args)
