"""Ship a finished `slmviz train-sae` run as a bundled SAE: fp16 tensors in slmviz/features/bundled/<model>/<name>/,
evaluated (slmviz.evaluate_sae) on three held-out texts, the metrics written into its cfg.json.

    OMP_NUM_THREADS=1 .venv/bin/python bench/tools/bundle_sae.py RUN_FOLDER NAME --model SmolLM2-135M-Instruct \
        [--tokens N]

The three: the broad corpus's held-out split (`metadata.evaluation`, as before, `--tokens`), the chat corpus's
held-out split (the model's own chat and prose from seeds never trained on, `--chat-tokens`) and bench/
modern_prose.txt (32 short modern texts written by hand: news, facts, dialogue, chat turns, email; whole), all three
in `metadata.evaluations`. The last is the independent check of "the prompts people type": the chat split is the
model's own writing.

The tensors are stored in fp16 (half the bytes; their rounding, ~5e-4 relative, is below what the metrics resolve)
while cfg.json says float32, so load_sae reads them into fp32 and they run in fp32. The evaluation is of the files as
shipped: the folder is written first, loaded back, then evaluated.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import REPO


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="the --out folder of a finished train-sae run")
    parser.add_argument("name", help="the bundled name, e.g. resid_post_l15")
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", type=int, default=50_000, help="broad held-out tokens to evaluate on")
    parser.add_argument("--chat-tokens", type=int, default=10_000, help="chat held-out tokens to evaluate on")
    args = parser.parse_args()

    import torch
    from safetensors.torch import save_file

    import slmviz
    from slmviz.features.bundled import BUNDLED_DIR
    from slmviz.features.sae import SAE
    from slmviz.formats.saelens import CFG_FILENAME, WEIGHTS_FILENAME, cfg_of
    from slmviz.training.cli import resolve_corpus

    model = slmviz.load(args.model)
    sae = SAE.load(args.run)
    folder = BUNDLED_DIR / model.name / args.name
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.float16).contiguous() for k, v in sae.tensors().items()}, str(folder / WEIGHTS_FILENAME))
    cfg = cfg_of(sae.spec(), sae.tensors())
    cfg["metadata"]["stored_dtype"] = "float16"
    (folder / CFG_FILENAME).write_text(json.dumps(cfg, indent=2) + "\n")

    shipped = slmviz.load_sae(folder, model=model)
    evaluations = {}
    for name, corpus, tokens in (("broad-heldout", "broad-heldout", args.tokens),
                                 ("chat-heldout", "chat-heldout", args.chat_tokens),
                                 ("modern-prose", "bench/modern_prose.txt", 0)):
        start = time.perf_counter()
        text = resolve_corpus(corpus, model) if name != "modern-prose" else str(REPO / corpus)  # a path from here
        metrics = slmviz.evaluate_sae(shipped, text, model=model, tokens=tokens or None)
        metrics["seconds"] = round(time.perf_counter() - start, 1)
        metrics["corpus"] = name
        metrics["command"] = (f"slmviz evaluate-sae {args.name} --model {model.name} --corpus {corpus} "
                              f"--tokens {tokens}")
        evaluations[name] = metrics
        print(json.dumps({"folder": str(folder), "d_sae": sae.d_sae, **metrics}, indent=1), flush=True)
    cfg["metadata"]["evaluation"] = evaluations["broad-heldout"]
    cfg["metadata"]["evaluations"] = evaluations
    (folder / CFG_FILENAME).write_text(json.dumps(cfg, indent=2) + "\n")


if __name__ == "__main__":
    main()
