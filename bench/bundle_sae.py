"""Ship a finished `slmviz train-sae` run as a bundled SAE: fp16 tensors in slmviz/features/bundled/<model>/<name>/,
evaluated (slmviz.evaluate_sae) on the broad corpus's held-out split, the metrics written into its cfg.json.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bundle_sae.py RUN_FOLDER NAME --model SmolLM2-135M-Instruct [--tokens N]

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

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="the --out folder of a finished train-sae run")
    parser.add_argument("name", help="the bundled name, e.g. resid_post_l15")
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", type=int, default=50_000, help="held-out tokens to evaluate on")
    args = parser.parse_args()

    import torch
    from safetensors.torch import save_file

    import slmviz
    from slmviz.features.bundled import BUNDLED_DIR, broad_corpus
    from slmviz.features.sae import CFG_FILENAME, SAE, WEIGHTS_FILENAME

    model = slmviz.load(args.model)
    sae = SAE.load(args.run)
    folder = BUNDLED_DIR / model.name / args.name
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.float16).contiguous() for k, v in sae.tensors().items()}, str(folder / WEIGHTS_FILENAME))
    cfg = sae.config()
    cfg["metadata"]["stored_dtype"] = "float16"
    (folder / CFG_FILENAME).write_text(json.dumps(cfg, indent=2) + "\n")

    shipped = slmviz.load_sae(folder, model=model)
    start = time.perf_counter()
    metrics = slmviz.evaluate_sae(shipped, str(broad_corpus()[1]), model=model, tokens=args.tokens)
    metrics["seconds"] = round(time.perf_counter() - start, 1)
    metrics["corpus"] = "broad-heldout"
    metrics["command"] = (f"slmviz evaluate-sae {args.name} --model {model.name} --corpus broad-heldout "
                          f"--tokens {args.tokens}")
    cfg["metadata"]["evaluation"] = metrics
    (folder / CFG_FILENAME).write_text(json.dumps(cfg, indent=2) + "\n")
    print(json.dumps({"folder": str(folder), "d_sae": sae.d_sae, **metrics}, indent=1))


if __name__ == "__main__":
    main()
