"""The independent reference: Hugging Face transformers on the same weights (eager attention, fp32 unless asked).

Only tests, bench/ and the `slmviz check` command import this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class ReferenceRun:
    logits: torch.Tensor  # [pos, vocab]
    resid_post: list[torch.Tensor]  # per layer [pos, d_model]; the last is *before* the final norm
    patterns: list[torch.Tensor]  # per layer [h, pos, pos]


def load_reference(folder: str | Path, attn_implementation: str = "eager", dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu"):
    """transformers' own model of a folder, in `dtype` (every parameter cast to it, as slmviz.load(dtype=) does)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=dtype, attn_implementation=attn_implementation
    )
    return model.to(device).eval()


@torch.inference_mode()
def run_reference(hf_model, input_ids: torch.Tensor, attentions: bool = True) -> ReferenceRun:
    """One forward with hidden states and attentions (`attentions=False`: patterns is empty, e.g. for the
    sdpa implementation, which has none). transformers' hidden_states[L+1] is block L's output, except the
    last entry, which has the final norm applied; that layer is captured with a forward hook on the block."""
    last_block = reference_blocks(hf_model)[-1]
    captured: dict[str, torch.Tensor] = {}
    handle = last_block.register_forward_hook(
        lambda _m, _i, out: captured.__setitem__("last", out[0] if isinstance(out, tuple) else out)
    )
    try:
        out = hf_model(input_ids[None].to(hf_model.device), output_hidden_states=True, output_attentions=attentions)
    finally:
        handle.remove()
    n = hf_model.config.num_hidden_layers
    resid = [out.hidden_states[i + 1][0] for i in range(n - 1)] + [captured["last"][0]]
    return ReferenceRun(out.logits[0], resid, [a[0] for a in out.attentions] if attentions else [])


def reference_blocks(hf_model) -> list:
    """transformers' decoder blocks of any family: model.layers (LLaMA, Gemma), transformer.h (GPT-2),
    gpt_neox.layers (GPT-NeoX)."""
    base = hf_model.base_model
    return list(getattr(base, "layers", None) or base.h)


@torch.inference_mode()
def reference_generate(hf_model, input_ids: torch.Tensor, max_new_tokens: int) -> list[int]:
    """Greedy continuation token ids from transformers' own `generate`."""
    input_ids = input_ids.to(hf_model.device)
    out = hf_model.generate(
        input_ids[None], attention_mask=torch.ones_like(input_ids)[None], max_new_tokens=max_new_tokens,
        do_sample=False, pad_token_id=hf_model.config.eos_token_id,
    )
    return out[0, input_ids.numel():].tolist()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |a|: differences relative to the tensor's size (SmolLM2's residual reaches ~1e4)."""
    return float((a.float() - b.float()).abs().max() / a.float().abs().max().clamp_min(1e-12))
