"""slmviz's full trace ÷ TransformerLens 4.3's `run_with_cache`, same weights, same token ids, one run each, in
alternating rounds.

TransformerLens is never a dependency of slmviz: it runs in a venv of its own (it pins its own transformers),
as a worker subprocess of this script that boots a `TransformerBridge` offline from transformers' model of the
same folder and answers one line per request, so the two sides still alternate round by round:

    python3 -m venv /tmp/tl-venv
    /tmp/tl-venv/bin/pip install --find-links /opt/wheels torch==2.13.0 transformer-lens==4.3.0
    .venv/bin/python bench/perf/tl_compare.py [--repeats 7] [--tl-python /tmp/tl-venv/bin/python]

The worker's cache is then written to a safetensors file and every hook both sides name alike is compared
(max |Δ| over all of them, logits included). Without the venv the row says how to make it and is skipped.
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

# common is imported where slmviz runs: the worker half runs in the TransformerLens venv.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first

TARGET = 2.0
DEFAULT_TL_PYTHON = os.environ.get("TL_PYTHON", "/tmp/tl-venv/bin/python")
N_TOKENS = 128


def worker(folder: str, ids_file: str) -> None:
    """Runs in the TransformerLens venv: boot the bridge, then answer `run` (seconds of one run_with_cache) and
    `save PATH` (the cache of one run, batch dimension dropped, plus the logits) until stdin closes."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from safetensors.torch import save_file
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(int(os.environ.get("TL_THREADS", torch.get_num_threads())))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    start = time.perf_counter()
    bridge = TransformerBridge.boot_transformers(folder, hf_model=hf, tokenizer=tokenizer, device="cpu")
    boot = time.perf_counter() - start
    ids = torch.tensor(json.loads(Path(ids_file).read_text()))[None]  # [1, pos]

    def run():
        with torch.inference_mode():
            return bridge.run_with_cache(ids)

    run()  # warm-up
    from importlib.metadata import version

    print(json.dumps({"ready": True, "boot_s": boot, "version": version("transformer-lens"),
                      "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        command = line.split()
        if command[0] == "run":
            start = time.perf_counter()
            run()
            print(json.dumps({"seconds": time.perf_counter() - start}), flush=True)
        elif command[0] == "save":
            logits, cache = run()
            tensors = {name: t[0].clone() for name, t in cache.items()
                       if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == 1}
            tensors["logits"] = logits[0].clone()
            save_file(tensors, command[1])
            print(json.dumps({"saved": len(tensors)}), flush=True)


def _max_diff(a, b) -> float:
    """max |a - b| over the entries both hold as numbers; a masked score is -inf on one side and the dtype's most
    negative number on the other (the hook contract allows either), which counts as equal. inf if masks disagree."""
    import torch

    finite = torch.isfinite(a) & torch.isfinite(b)
    masked = ~finite & (a < -1e38) & (b < -1e38)
    if not bool((finite | masked).all()):
        return float("inf")
    return float((a - b).abs()[finite].max()) if bool(finite.any()) else 0.0


class Peer:
    """The worker subprocess, driven one request at a time."""

    def __init__(self, python: str, folder: Path, ids) -> None:
        fd, self._ids = tempfile.mkstemp(suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(ids.tolist(), f)
        self.proc = subprocess.Popen([python, __file__, "--worker", str(folder), self._ids], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.info = self._reply()

    def _reply(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the TransformerLens worker exited (code {self.proc.wait()})")
            if line.startswith("{"):
                return json.loads(line)

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        os.unlink(self._ids)


def run(args: argparse.Namespace):
    import torch
    from common import Row, median, prompt_ids, spread
    from safetensors.torch import load_file

    import slmviz

    what = f"full trace, {N_TOKENS} tokens, all hooks: TransformerLens 4.3 run_with_cache ÷ slmviz (same weights)"
    if not Path(args.tl_python).exists():
        return [Row(what, "skipped", "", None, f"≥ {TARGET}×", None,
                    f"no TransformerLens venv at {args.tl_python}: create it as this script's docstring says")]
    model = slmviz.load()
    ids = prompt_ids(model, N_TOKENS)
    peer = Peer(args.tl_python, model.path, ids)
    try:
        times: dict[str, list[float]] = {"slmviz": [], "transformer_lens": []}
        with torch.inference_mode():
            model.trace(ids)  # warm-up (the worker warmed up before it said ready)
            for _ in range(args.repeats):
                start = time.perf_counter()
                model.trace(ids)
                times["slmviz"].append(time.perf_counter() - start)
                times["transformer_lens"].append(peer.ask("run")["seconds"])
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "tl.safetensors"
            peer.ask(f"save {path}")
            theirs = load_file(str(path))
        ours = model.trace(ids)
        common = [n for n in ours.names if n in theirs and tuple(theirs[n].shape) == tuple(ours[n].shape)]
        diff = max([_max_diff(ours[n], theirs[n]) for n in common] + [_max_diff(ours.logits, theirs["logits"])])
    finally:
        peer.close()
    a, b = median(times["slmviz"]), median(times["transformer_lens"])
    return [Row(what, f"{a:.3f} s", f"{b:.3f} s", b / a, f"≥ {TARGET}×", b / a >= TARGET,
                f"TransformerLens {peer.info['version']} (TransformerBridge over transformers' eager model, its own "
                f"venv, {peer.info['threads']} threads, booted in {peer.info['boot_s']:.1f} s); max |Δ| over the "
                f"{len(common)} hooks both name alike and the logits: {diff:.1e}; spread slmviz "
                f"{spread(times['slmviz'])}, TransformerLens {spread(times['transformer_lens'])}")]


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        from common import main

        main(run, __doc__, lambda p: p.add_argument("--tl-python", default=DEFAULT_TL_PYTHON))
