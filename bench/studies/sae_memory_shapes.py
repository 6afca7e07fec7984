"""Why train_sae's peak RSS grows from 1x to 4x the tokens in bf16: RSS after each block of activations, by mode.

    OMP_NUM_THREADS=1 .venv/bin/python bench/studies/sae_memory_shapes.py MODE [--blocks 12]
    MODE: bf16 (as train_sae runs) | fixed (bf16, every forward padded to [>= 16, 128]) | fp32
    Run `bf16` again with LRU_CACHE_CAPACITY=1 and/or ONEDNN_PRIMITIVE_CACHE_CAPACITY=0 set for the process.

The activation stream of bench/peers/sae_train.py --memory (SmolLM2, blocks.3.hook_resid_post, 16k-token blocks of the
broad corpus, forwards of 1024 tokens in windows of 128), without the SAE step, printing the process's RSS after
each block (freed heap trimmed, as train_sae does) and how many distinct forward input shapes it has seen so far.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
import common  # noqa: F401 - this checkout's slmviz first


def rss_gb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1e6
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["bf16", "fixed", "fp32"])
    parser.add_argument("--blocks", type=int, default=12)
    args = parser.parse_args()

    import torch

    import slmviz
    import slmviz.features.activations as acts
    from slmviz.corpora.broad import broad_corpus

    model = slmviz.load()
    shapes: set[tuple[int, ...]] = set()
    batch_ids, forward_hooks = acts.batch_ids, acts.forward_hooks

    def fixed_ids(batch):  # one padded shape for nearly every forward
        ids, real = batch_ids(batch)
        n = max(16, ids.shape[0])
        out = torch.full((n, 128), acts.PAD_ID, dtype=torch.long)
        mask = torch.zeros(n, 128, dtype=torch.bool)
        out[:ids.shape[0], :ids.shape[1]], mask[:ids.shape[0], :ids.shape[1]] = ids, real
        return out, mask

    def counting(model, ids, hooks):
        shapes.add(tuple(ids.shape))
        return forward_hooks(model, ids, hooks)

    if args.mode == "fixed":
        acts.batch_ids = fixed_ids
    acts.forward_hooks = counting
    source = acts.Source("blocks.3.hook_resid_post", "blocks.3.hook_resid_post", 128, 1024, 16_384)
    corpus = acts.checked_corpus(str(broad_corpus()[0]))
    print(f"{args.mode}: after load {rss_gb():.3f} GB", flush=True)
    for i, block in enumerate(acts.plan_blocks(model.tokenizer, corpus, source)):
        bf16 = torch.autocast("cpu", dtype=torch.bfloat16) if args.mode != "fp32" else contextlib.nullcontext()
        with bf16:
            rows = acts.block_rows(model, block, source)
        del rows
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        print(f"{args.mode}: block {i}: RSS {rss_gb():.3f} GB, {len(shapes)} distinct forward shapes", flush=True)
        if i + 1 >= args.blocks:
            break


if __name__ == "__main__":
    main()
