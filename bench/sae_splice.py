"""The cost of splicing an SAE into a trace: `m.trace(ids, saes=[sae])` ÷ `m.trace(ids)`, alternating rounds.

SmolLM2-135M (the bundled model), 128 tokens, every hook captured (the default trace). The SAE is a random TopK
SAE of SmolLM2's training width (d_sae 4608 = 8 × d_model, k 32) at blocks.15.hook_resid_post, with the error term
(outputs unchanged; the splice runs the encoder and decoder once and records its six hooks). Evidence rows: the
same with a 4608-wide JumpReLU transcoder at layer 15 (mlp.hook_in -> hook_mlp_out), and with capture off
(names=[]: only the SAE's work is added to a bare forward).

    .venv/bin/python bench/sae_splice.py [--repeats 7]
"""

from __future__ import annotations

import argparse

from common import Row, interleaved, main, median, prompt_ids, spread

TARGET = 1.1
N_TOKENS = 128


def run(args: argparse.Namespace) -> list[Row]:
    import slmviz
    from slmviz.features.sae import SAE

    model = slmviz.load()
    ids = prompt_ids(model, N_TOKENS)
    d = model.cfg.d_model
    sae = SAE.random(d, 8 * d, architecture="topk", k=32, hook_name="blocks.15.hook_resid_post")
    tc = SAE.random(d, 8 * d, architecture="jumprelu", hook_name="blocks.15.mlp.hook_in",
                    hook_name_out="blocks.15.hook_mlp_out", seed=1)
    t = interleaved({
        "plain": lambda: model.trace(ids),
        "sae": lambda: model.trace(ids, saes=[sae]),
        "transcoder": lambda: model.trace(ids, saes=[tc]),
        "bare": lambda: model.trace(ids, names=[]),
        "bare_sae": lambda: model.trace(ids, names=[], saes=[sae]),
    }, warmup=2, repeats=args.repeats)
    plain, with_sae, with_tc = median(t["plain"]), median(t["sae"]), median(t["transcoder"])
    bare, bare_sae = median(t["bare"]), median(t["bare_sae"])
    exact = float((model.trace(ids, saes=[sae]).logits - model.trace(ids).logits).abs().max())
    return [
        Row(f"trace, {N_TOKENS} tokens, all hooks, one TopK SAE spliced (d_sae {8 * d}, k 32, layer 15) ÷ the same "
            "trace without", f"{with_sae:.3f} s", f"{plain:.3f} s", with_sae / plain, f"≤ {TARGET}",
            with_sae / plain <= TARGET,
            f"error term on: max |Δlogit| {exact:.1e}; spread spliced {spread(t['sae'])}, plain {spread(t['plain'])}"),
        Row(f"(evidence) the same trace with a JumpReLU transcoder (d_sae {8 * d}, layer 15) ÷ without",
            f"{with_tc:.3f} s", f"{plain:.3f} s", with_tc / plain, "—", None, f"spread {spread(t['transcoder'])}"),
        Row(f"(evidence) capture off (names=[]), {N_TOKENS} tokens, the TopK SAE spliced ÷ without",
            f"{bare_sae:.3f} s", f"{bare:.3f} s", bare_sae / bare, "—", None,
            f"the SAE's own work on a bare forward; spread {spread(t['bare_sae'])}, {spread(t['bare'])}"),
    ]


if __name__ == "__main__":
    main(run, __doc__)
