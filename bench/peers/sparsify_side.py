"""The sparsify half of bench/peers/sparsify_compare.py, run by that script in eai-sparsify's side venv (never imported
by slmviz): train skip transcoders on SmolLM2's `layers.L.mlp` (input: the pre-MLP norm's output, slmviz's
blocks.L.mlp.hook_in; output: the MLP's, blocks.L.hook_mlp_out) from one forward per batch, on the token windows
the caller wrote, and save each coder's tensors for the caller to evaluate with slmviz's own metrics.

    <side venv>/bin/python bench/peers/sparsify_side.py MODEL_DIR TOKENS.u16 CTX LAYERS D_SAE K OUT

Prints one JSON line: {"fit_s": seconds in Trainer.fit alone (not the model's load), "tokens": tokens trained}.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from sparsify import SparseCoderConfig, TrainConfig, Trainer
from sparsify.data import MemmapDataset
from transformers import AutoModelForCausalLM


def main() -> None:
    model_dir, tokens_path, ctx, layers, d_sae, k, out = sys.argv[1:8]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dataset = MemmapDataset(tokens_path, int(ctx))
    layers = [int(L) for L in layers.split(",")]
    # batch_size 4 sequences of 128 tokens = slmviz's batch_tokens 512; sparsify's own defaults otherwise (signum
    # with its width-scaled learning rate, the FVU loss, TopK), as its README trains transcoders.
    cfg = TrainConfig(SparseCoderConfig(num_latents=int(d_sae), k=int(k), transcode=True, skip_connection=True),
                      batch_size=512 // int(ctx), loss_fn="fvu", hookpoints=[f"layers.{L}.mlp" for L in layers],
                      log_to_wandb=False, save_every=10**9, save_dir=tempfile.mkdtemp())
    trainer = Trainer(cfg, dataset, model)
    t = time.perf_counter()
    trainer.fit()
    fit_s = time.perf_counter() - t
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for hook, coder in trainer.saes.items():
        save_file({name: p.detach().contiguous() for name, p in coder.state_dict().items()},
                  str(out / f"{hook}.safetensors"))
    print(json.dumps({"fit_s": fit_s, "tokens": len(dataset) * int(ctx)}))


if __name__ == "__main__":
    main()
