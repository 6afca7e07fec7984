"""Tiny random checkpoints of the field's families (GPT-2, GPT-NeoX / Pythia, Gemma 2), built by transformers'
own config classes, for tests/test_families_*.py (conftest's TINY_ARCHS covers the six earlier families)."""

from __future__ import annotations

from pathlib import Path

import torch

# name -> (config class name, kwargs). Each exercises its family's conventions: GPT-2 learned positions, Conv1D,
# fused c_attn, gelu_new; Pythia partial rotary (rotary_pct 0.25 of d_head 16: 4 dims), parallel residual,
# per-head fused QKV; Gemma 2 GQA, alternating sliding (window 4) / global layers, soft-capping with caps small
# enough that random scores reach them, query_pre_attn_scalar != head_dim.
NEW_FAMILIES: dict[str, tuple[str, dict]] = {
    "gpt2": ("GPT2Config", dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=1,
                                 eos_token_id=1)),
    "gpt_neox": ("GPTNeoXConfig", dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
        max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                                                     "partial_rotary_factor": 0.25})),
    "gemma2": ("Gemma2Config", dict(
        vocab_size=128, hidden_size=80, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=4, query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0, final_logit_softcapping=1.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
}


def build_family_model(folder: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """Save a random-weight checkpoint of `arch` (non-unit norm weights, non-zero biases) with a tiny tokenizer."""
    import transformers

    cls_name, kwargs = NEW_FAMILIES[arch]
    config = getattr(transformers, cls_name)(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight", "layernorm.weight")):
                p.copy_((0.0 if arch == "gemma2" else 1.0) + 0.5 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("wpe.weight"):
                p.copy_(0.5 * torch.randn_like(p))  # positions large enough that a wrong row shows
            elif arch == "gpt2" and name.endswith("mlp.c_fc.weight"):
                p.mul_(20.0)  # pre-activations of order 1, where gelu_new and the exact GELU part
            elif arch == "gemma2" and name.endswith(("q_proj.weight", "k_proj.weight", "embed_tokens.weight")):
                p.mul_(6.0)  # scores and logits past the caps, so that capping shows
    model.save_pretrained(folder)
    from conftest import _write_tokenizer  # the tiny word-level tokenizer every tiny model here gets

    _write_tokenizer(folder, config.vocab_size)
    return folder
