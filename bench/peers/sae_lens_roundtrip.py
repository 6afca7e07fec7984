"""Do SAE files move both ways between slmviz and SAELens with the same feature activations?

slmviz -> SAELens: every architecture slmviz writes (standard, topk, jumprelu, transcoder, skip_transcoder,
jumprelu_transcoder, jumprelu_skip_transcoder, and an attn.hook_z SAE) is saved with `SAE.save`, loaded with
`sae_lens.SAE.load_from_disk` in a subprocess of a separate venv, and both encode the same inputs.
SAELens -> slmviz: SAELens builds and saves SAEs of each architecture (its own random initialisation, a TopK one
with rescale_acts_by_decoder_norm, a standard one with apply_b_dec_to_input), and slmviz loads them.
Prints the largest |Δ| of the feature activations and of the reconstructions for each.

sae-lens pulls TransformerLens 3, so it lives in its own venv, never in the project's dependencies:

    python3 -m venv /tmp/saelens-venv
    /tmp/saelens-venv/bin/pip install --find-links /opt/wheels torch==2.13.0 sae-lens==6.54.12
    .venv/bin/python bench/peers/sae_lens_roundtrip.py [--venv /tmp/saelens-venv]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import REPO  # noqa: F401 - importing common puts this checkout's slmviz first

from slmviz import SAE

D_IN, D_SAE, D_OUT, N = 24, 96, 20, 64

# Run inside the SAELens venv: load every folder slmviz wrote, encode its inputs; then write SAELens's own SAEs.
SAELENS_SIDE = r'''
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
import sae_lens
from sae_lens import SAE

root = Path(sys.argv[1])
report = {"sae_lens": sae_lens.__version__}
for folder in sorted((root / "from_slmviz").iterdir()):
    sae = SAE.load_from_disk(str(folder), device="cpu")
    x = load_file(str(folder.parent.parent / "inputs" / f"{folder.name}.safetensors"))["x"]
    with torch.no_grad():
        acts = sae.encode(x)
        out = sae(x) if hasattr(sae, "W_skip") else sae.decode(acts)
    save_file({"acts": acts.contiguous(), "out": out.contiguous()}, str(folder / "sae_lens_out.safetensors"))
    report[folder.name] = type(sae).__name__

from sae_lens.saes.standard_sae import StandardSAE, StandardSAEConfig
from sae_lens.saes.topk_sae import TopKSAE, TopKSAEConfig
from sae_lens.saes.jumprelu_sae import JumpReLUSAE, JumpReLUSAEConfig
from sae_lens.saes.transcoder import (JumpReLUSkipTranscoder, JumpReLUSkipTranscoderConfig, SkipTranscoder,
                                     SkipTranscoderConfig)
torch.manual_seed(0)
made = {
    "standard_b_dec_in": StandardSAE(StandardSAEConfig(d_in=24, d_sae=96, apply_b_dec_to_input=True)),
    "topk_rescaled": TopKSAE(TopKSAEConfig(d_in=24, d_sae=96, k=8, rescale_acts_by_decoder_norm=True)),
    "jumprelu": JumpReLUSAE(JumpReLUSAEConfig(d_in=24, d_sae=96, apply_b_dec_to_input=False)),
    "skip_transcoder": SkipTranscoder(SkipTranscoderConfig(d_in=24, d_sae=96, d_out=20, apply_b_dec_to_input=False)),
    "jumprelu_skip_transcoder": JumpReLUSkipTranscoder(
        JumpReLUSkipTranscoderConfig(d_in=24, d_sae=96, d_out=20, apply_b_dec_to_input=False)),
}
x = torch.randn(64, 24) * 2
for name, sae in made.items():
    with torch.no_grad():  # non-zero biases, thresholds and skips, so every term is exercised
        for p in sae.parameters():
            p.add_(0.1 * torch.randn_like(p))
        if hasattr(sae, "threshold"):
            sae.threshold.copy_(torch.rand_like(sae.threshold) * 0.5)
        if hasattr(sae, "W_dec") and "topk" in name:
            sae.W_dec.mul_(torch.rand(sae.W_dec.shape[0], 1) + 0.5)  # decoder norms that differ
    folder = root / "from_sae_lens" / name
    sae.save_model(str(folder))
    with torch.no_grad():
        acts = sae.encode(x)
        out = sae(x) if hasattr(sae, "W_skip") else sae.decode(acts)
    save_file({"x": x, "acts": acts.contiguous(), "out": out.contiguous()}, str(folder / "sae_lens_out.safetensors"))
print(json.dumps(report))
'''


def slmviz_saes() -> dict[str, SAE]:
    """One SAE per architecture slmviz writes, with non-zero everything."""
    common = dict(seed=0, metadata={"model_name": "roundtrip"})
    return {
        "standard": SAE.random(D_IN, D_SAE, architecture="relu", hook_name="blocks.3.hook_resid_post",
                               apply_b_dec_to_input=True, **common),
        "topk": SAE.random(D_IN, D_SAE, architecture="topk", k=8, hook_name="blocks.3.hook_resid_post", **common),
        "jumprelu": SAE.random(D_IN, D_SAE, architecture="jumprelu", hook_name="blocks.3.hook_resid_post", **common),
        "hook_z": SAE.random(D_IN, D_SAE, architecture="jumprelu", hook_name="blocks.3.attn.hook_z",
                             reshape_activations="hook_z", **common),
        "transcoder": SAE.random(D_IN, D_SAE, d_out=D_OUT, hook_name="blocks.3.mlp.hook_in",
                                 hook_name_out="blocks.3.hook_mlp_out", **common),
        "skip_transcoder": SAE.random(D_IN, D_SAE, d_out=D_OUT, skip=True, hook_name="blocks.3.mlp.hook_in",
                                      hook_name_out="blocks.3.hook_mlp_out", **common),
        "jumprelu_transcoder": SAE.random(D_IN, D_SAE, d_out=D_OUT, architecture="jumprelu",
                                          hook_name="blocks.3.mlp.hook_in", hook_name_out="blocks.3.hook_mlp_out",
                                          **common),
        "jumprelu_skip_transcoder": SAE.random(D_IN, D_SAE, d_out=D_OUT, architecture="jumprelu", skip=True,
                                               hook_name="blocks.3.mlp.hook_in",
                                               hook_name_out="blocks.3.hook_mlp_out", **common),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", type=Path, default=Path("/tmp/saelens-venv"), help="the venv holding sae-lens")
    args = parser.parse_args()
    python = args.venv / "bin" / "python"
    if not python.exists():
        sys.exit(f"{python} not found; create the venv first (see this script's docstring)")
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "inputs").mkdir()
        g = torch.Generator().manual_seed(1)
        saes = slmviz_saes()
        for name, sae in saes.items():
            sae.save(root / "from_slmviz" / name)
            x = torch.randn(N, D_IN, generator=g) * 2
            if sae.reshape_activations == "hook_z":
                x = x.view(N, 4, D_IN // 4)  # [pos, h, d_head], as attn.hook_z hands it over
            save_file({"x": x}, str(root / "inputs" / f"{name}.safetensors"))
        done = subprocess.run([str(python), "-c", SAELENS_SIDE, str(root)], capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"the sae-lens side failed:\n{done.stderr[-4000:]}")
        report = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"sae-lens {report.pop('sae_lens')}, torch {torch.__version__}")
        print("slmviz SAE.save -> sae_lens.SAE.load_from_disk:")
        for name, sae in saes.items():
            theirs = load_file(str(root / "from_slmviz" / name / "sae_lens_out.safetensors"))
            x = load_file(str(root / "inputs" / f"{name}.safetensors"))["x"]
            with torch.no_grad():
                acts, out = sae.encode(x), sae(x)
            d_acts = float((acts - theirs["acts"]).abs().max())
            d_out = float((out.reshape(N, -1) - theirs["out"].reshape(N, -1)).abs().max())
            active = float((acts != 0).float().sum(-1).mean())
            worst = max(worst, d_acts, d_out)
            print(f"  {name:26s} as {report[name]:24s} max|Δ acts| {d_acts:.1e}  max|Δ x_hat| {d_out:.1e}"
                  f"  (L0 {active:.1f} of {sae.d_sae})")
        print("sae_lens save_model -> slmviz.load_sae:")
        import slmviz

        for folder in sorted((root / "from_sae_lens").iterdir()):
            theirs = load_file(str(folder / "sae_lens_out.safetensors"))
            sae = slmviz.load_sae(folder)
            with torch.no_grad():
                acts, out = sae.encode(theirs["x"]), sae(theirs["x"])
            d_acts = float((acts - theirs["acts"]).abs().max())
            d_out = float((out - theirs["out"]).abs().max())
            active = float((acts != 0).float().sum(-1).mean())
            worst = max(worst, d_acts, d_out)
            print(f"  {folder.name:26s} as {sae.architecture:9s}{' transcoder' if sae.is_transcoder else '':11s}"
                  f"      max|Δ acts| {d_acts:.1e}  max|Δ x_hat| {d_out:.1e}  (L0 {active:.1f} of {sae.d_sae})")
    print(f"largest difference: {worst:.1e}")


if __name__ == "__main__":
    main()
