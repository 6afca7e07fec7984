"""A patching sweep on GPT-2 small's shape: slmviz's `patch` against TransformerLens 4.3's
`patching.get_act_patch_resid_pre` (one hooked forward per cell), on the same weights and token ids.

GPT-2 small is built by transformers from its config (random weights: no checkpoint can be downloaded here) and
saved; slmviz loads the folder, and a worker subprocess in TransformerLens's own venv loads the same transformers
model and boots TransformerLens 4's TransformerBridge on it (compatibility mode's hook names, no weight
processing). Both patch `resid_pre` at every (layer, position) of a corrupted prompt with the clean run's value and
read the logit difference of two tokens at the last position; the two heatmaps are compared (max |difference|).

    python3 -m venv /tmp/tl-venv
    /tmp/tl-venv/bin/pip install --find-links /opt/wheels torch==2.13.0 transformer-lens==4.3.0
    .venv/bin/python bench/peers/tl_patching_families.py [--tokens 16] [--repeats 3] [--tl-python PYTHON]

The sides alternate (slmviz, TransformerLens, ...) `--repeats` times; medians are printed with the load average.
Issue 53's goal: a patching sweep far ahead of TransformerLens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TL_PYTHON = os.environ.get("TL_PYTHON", "/tmp/tl-venv/bin/python")
ANSWER, WRONG = 11, 12  # two token ids whose logit difference the sweep reads


def worker(folder: str, data_file: str) -> None:
    """In TransformerLens's venv: the sweep once as a warm-up, then one timed sweep per line on stdin."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformer_lens import patching
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(int(os.environ.get("TL_THREADS", torch.get_num_threads())))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    model = TransformerBridge.boot_transformers(folder, hf_model=hf, device="cpu")
    # HookedTransformer's hook names (blocks.L.hook_resid_pre), without its weight processing: HF's numerics, as
    # slmviz computes them
    model.enable_compatibility_mode(disable_warnings=True, no_processing=True)
    data = json.loads(Path(data_file).read_text())
    clean, corrupted = torch.tensor(data["clean"])[None], torch.tensor(data["corrupted"])[None]

    def metric(logits):
        return logits[0, -1, ANSWER] - logits[0, -1, WRONG]

    def sweep():
        with torch.inference_mode():
            _, cache = model.run_with_cache(clean)
            return patching.get_act_patch_resid_pre(model, corrupted, cache, metric)

    sweep()
    from importlib.metadata import version

    print(json.dumps({"ready": True, "version": version("transformer-lens"), "threads": torch.get_num_threads()}),
          flush=True)
    for _ in sys.stdin:
        start = time.perf_counter()
        result = sweep()
        seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds, "values": result.tolist()}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tl-python", default=TL_PYTHON)
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf"))
    import common
    import torch
    from families import build

    import slmviz

    if not Path(args.tl_python).exists():
        sys.exit(f"no TransformerLens venv at {args.tl_python}: see this script's docstring")
    print(f"{common.cpu_model()}, torch {torch.get_num_threads()} threads; load {common.load_average()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="slmviz-tl-patch-") as tmp:
        build("gpt2", Path(tmp), None, None)
        ours = slmviz.load(tmp)
        g = torch.Generator().manual_seed(0)
        clean = torch.randint(100, ours.cfg.vocab_size, (args.tokens,), generator=g)
        corrupted = clean.clone()
        corrupted[args.tokens // 2] = (int(clean[args.tokens // 2]) + 1) % ours.cfg.vocab_size  # one token differs
        data = Path(tmp) / "data.json"
        data.write_text(json.dumps({"clean": clean.tolist(), "corrupted": corrupted.tolist()}))
        peer = subprocess.Popen([args.tl_python, __file__, "--worker", tmp, str(data)],
                                text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)

        def reply() -> dict:
            while True:
                line = peer.stdout.readline()
                if not line:
                    raise RuntimeError(f"the TransformerLens worker exited (code {peer.wait()})")
                if line.startswith("{"):
                    return json.loads(line)

        info = reply()

        def ours_sweep():
            return slmviz.patch(clean, corrupted, answer=ANSWER, wrong=WRONG, site="resid_pre", model=ours)

        ours_sweep()  # warm-up
        times: dict[str, list[float]] = {"slmviz": [], "TransformerLens": []}
        worst = 0.0
        for _ in range(args.repeats):
            start = time.perf_counter()
            r = ours_sweep()
            times["slmviz"].append(time.perf_counter() - start)
            peer.stdin.write("run\n")
            peer.stdin.flush()
            theirs = reply()
            times["TransformerLens"].append(theirs["seconds"])
            # slmviz's values: the metric of each patched run, [layer, position] like TransformerLens's
            worst = max(worst, float((r.values.double() - torch.tensor(theirs["values"]).double()).abs().max()))
            print({k: round(v[-1], 3) for k, v in times.items()}, f"load {common.load_average()}", flush=True)
        peer.stdin.close()
        peer.wait(timeout=60)
    a, b = (sorted(v)[len(v) // 2] for v in (times["slmviz"], times["TransformerLens"]))
    cells = ours.cfg.n_layers * args.tokens
    print(f"\nGPT-2 small shape ({ours.cfg.n_layers} layers, random weights), resid_pre sweep of {cells} cells on "
          f"{args.tokens} tokens: slmviz {a:.2f} s, TransformerLens {info['version']} "
          f"get_act_patch_resid_pre {b:.2f} s -> {b / a:.1f}x faster; largest difference between the heatmaps "
          f"{worst:.1e}")


if __name__ == "__main__":
    main()
