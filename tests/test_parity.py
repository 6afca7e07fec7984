"""slmviz equals transformers on the same weights: the default model and tiny random models of every option."""

from __future__ import annotations

import pytest
import torch

import slmviz
from slmviz.loading.reference import load_reference, reference_generate, relative_error, run_reference

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)",
    "Once upon a time, in a small village by the sea, there lived an old fisherman. Every morning he rowed "
    "out before dawn, and every evening he came back with a story. " * 3,
]


@pytest.fixture(scope="module", params=range(len(PROMPTS)), ids=["short", "code", "long"])
def pair(request, model, hf_model):
    ids = model.encode(PROMPTS[request.param])
    return ids, model.trace(ids), run_reference(hf_model, ids)


def test_default_model_logits_match_transformers(pair):
    """max |Δlogit| ≤ 1e-4 and the same argmax at every position, full capture on."""
    _, ours, ref = pair
    assert float((ours.logits - ref.logits).abs().max()) <= 1e-4
    assert torch.equal(ours.logits.argmax(-1), ref.logits.argmax(-1))


def test_default_model_residual_stream_matches_every_layer(pair, model):
    """Every layer's resid_post within 1e-5 relative (to the tensor's max, SmolLM2 reaches ~1e4)."""
    _, ours, ref = pair
    for layer in range(model.cfg.n_layers):
        assert relative_error(ref.resid_post[layer], ours[f"blocks.{layer}.hook_resid_post"]) <= 1e-5, layer


def test_default_model_attention_patterns_match(pair, model):
    _, ours, ref = pair
    for layer in range(model.cfg.n_layers):
        assert float((ref.patterns[layer] - ours[f"blocks.{layer}.attn.hook_pattern"]).abs().max()) <= 1e-5, layer


def test_capture_off_fast_path_matches_transformers(pair, model):
    """The fused-attention path (no hooks captured) gives the same logits as transformers and as full capture."""
    ids, ours, ref = pair
    fast = model.logits(ids)
    assert float((fast - ref.logits).abs().max()) <= 1e-4
    assert relative_error(ours.logits, fast) <= 1e-5


def test_greedy_generation_matches_transformers_token_for_token(model, hf_model):
    """32 greedy tokens through slmviz's KV cache equal transformers' generate on two prompts."""
    for prompt in PROMPTS[:2]:
        ids = model.encode(prompt)
        assert_same_generation(model, model.generate_ids(ids, 32), reference_generate(hf_model, ids, 32))


def assert_same_generation(model, ours: list[int], ref: list[int]) -> None:
    """transformers keeps the EOS token it stopped at; slmviz stops before yielding it."""
    if ref and ref[-1] == model.tokenizer.eos_token_id:
        assert ours == ref[:-1]
    else:
        assert ours == ref


def test_chat_template_generation_matches_transformers(model, hf_model):
    ids = model.encode("What is the capital of France?", chat=True)
    assert model.tokenizer.decode(ids).startswith("<|im_start|>system")
    assert_same_generation(model, model.generate_ids(ids, 16), reference_generate(hf_model, ids, 16))


def test_tiny_random_models_match_transformers(tiny_dirs):
    """Every architecture option (GQA/MHA/MQA, biases, tied, head_dim, RoPE scaling, sliding window):
    relative logit error ≤ 1e-5, patterns and residuals too. Prompt length 30 > the sliding window (5)
    and > max_position_embeddings (16) of the dynamic-NTK model, so those paths are exercised."""
    gen = torch.Generator().manual_seed(0)
    for arch, folder in tiny_dirs.items():
        model = slmviz.load(folder)
        hf = load_reference(folder)
        ids = torch.randint(0, model.cfg.vocab_size, (30,), generator=gen)
        ours, ref = model.trace(ids), run_reference(hf, ids)
        assert relative_error(ref.logits, ours.logits) <= 1e-5, arch
        assert relative_error(ref.logits, model.logits(ids)) <= 1e-5, arch
        for layer in range(model.cfg.n_layers):
            assert relative_error(ref.resid_post[layer], ours[f"blocks.{layer}.hook_resid_post"]) <= 1e-5, arch
            assert float((ref.patterns[layer] - ours[f"blocks.{layer}.attn.hook_pattern"]).abs().max()) <= 1e-5


@pytest.mark.parametrize("arch", ["llama_gqa", "llama_bias", "qwen2", "mistral_window", "llama3"])
def test_tiny_models_generate_like_transformers(tiny_dirs, arch):
    """Cached decoding (KV cache, position offset, sliding window past its size) matches transformers' generate."""
    model = slmviz.load(tiny_dirs[arch])
    hf = load_reference(tiny_dirs[arch])
    ids = torch.arange(3, 15)
    assert_same_generation(model, model.generate_ids(ids, 12), reference_generate(hf, ids, 12))


def test_slmviz_check_passes_and_fails_on_a_broken_convention(tiny_dir, monkeypatch, capsys):
    """`slmviz check` exits 0 when equal, and non-zero once a convention is broken (RoPE pairing swapped)."""
    from slmviz import cli
    from slmviz.model import rope

    assert cli.main(["check", "--model", str(tiny_dir), "--prompt", "w3 w4 w5 w6 w7 w8"]) == 0
    assert "OK" in capsys.readouterr().out
    monkeypatch.setitem(rope.ROTATIONS, "rotate_half", rope.rotate_interleaved)
    assert cli.main(["check", "--model", str(tiny_dir), "--prompt", "w3 w4 w5 w6 w7 w8"]) == 1
    assert "MISMATCH" in capsys.readouterr().out
