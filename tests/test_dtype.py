"""slmviz.load(dtype=...): bf16 equals transformers in bf16 on the same weights, within transformers' own
eager-vs-sdpa difference (measured here, on the same inputs, not a constant); dtype errors and the slow-bf16
warning; hooks and every variant in bf16.

Not covered here: scans and patch sweeps in bf16 (tests/test_dtype_bulk.py) and fp16 (CUDA only; bench/perf/gpu.py).
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from conftest import TINY_ARCHS

import slmviz
from slmviz.loading.reference import load_reference, reference_generate, relative_error, run_reference
from slmviz.model import params
from slmviz.model_api import SlowDtypeWarning, checked_dtype

IDS = torch.arange(3, 23)  # 20 tokens: past the tiny Gemma's and Mistral's windows
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def fast_bf16(monkeypatch):
    """Skip the timing: these tests are about numbers, and the warning has its own test."""
    monkeypatch.setattr(params, "_bf16_slowdown", 0.5)


@pytest.fixture(scope="module")
def bf16_models(tiny_dirs) -> dict[str, slmviz.Model]:
    return {arch: slmviz.load(tiny_dirs[arch], dtype="bfloat16") for arch in TINY_ARCHS}


@pytest.fixture(scope="module")
def bf16_references(tiny_dirs) -> dict[str, tuple[object, object]]:
    """transformers' bf16 models of every tiny checkpoint: (eager, sdpa)."""
    return {arch: (load_reference(tiny_dirs[arch], dtype=BF16), load_reference(tiny_dirs[arch], "sdpa", dtype=BF16))
            for arch in TINY_ARCHS}


def _transformers_tolerance(pair, ids: torch.Tensor) -> tuple[object, object, float, float]:
    """(eager run, sdpa run, logits tolerance, residual tolerance): transformers' own bf16 eager-vs-sdpa difference
    on these ids, relative to each tensor's size (the largest over layers for the residual)."""
    eager = run_reference(pair[0], ids)
    sdpa = run_reference(pair[1], ids, attentions=False)
    return eager, sdpa, *_tolerance(eager, sdpa)


def _tolerance(eager, sdpa) -> tuple[float, float]:
    """(logits tolerance, residual tolerance) from transformers' eager and sdpa runs of the same ids."""
    logit_tol = relative_error(eager.logits, sdpa.logits)
    resid_tol = max(relative_error(a, b) for a, b in zip(eager.resid_post, sdpa.resid_post, strict=True))
    assert logit_tol > 0  # the two implementations do differ in bf16, so the tolerance is a real measurement
    return logit_tol, resid_tol


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_bf16_matches_transformers_bf16_within_its_own_eager_vs_sdpa_difference(bf16_references, bf16_models,
                                                                               arch):
    """A full trace (eager attention: patterns captured) against transformers' eager run, and the capture-off
    forward (fused attention) against its sdpa run; logits and every layer's residual, relative to their size.
    On this CPU both come out bit-identical; the tolerance is what transformers itself moves between its two
    attention implementations on the same prompt in bf16."""
    m = bf16_models[arch]
    eager, sdpa, logit_tol, resid_tol = _transformers_tolerance(bf16_references[arch], IDS)
    t = m.trace(IDS)
    assert t.logits.dtype == BF16 and t["blocks.0.hook_resid_post"].dtype == BF16
    assert relative_error(eager.logits, t.logits) <= logit_tol
    assert relative_error(sdpa.logits, m.logits(IDS)) <= logit_tol
    for layer, resid in enumerate(eager.resid_post):
        assert relative_error(resid, t[f"blocks.{layer}.hook_resid_post"]) <= resid_tol, layer
        # Patterns: sdpa has none to measure against; one bf16 step of a probability in [0.5, 1).
        pattern = t[f"blocks.{layer}.attn.hook_pattern"].float()
        assert float((eager.patterns[layer].float() - pattern).abs().max()) <= 2.0**-8, layer


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_bf16_greedy_decoding_equals_one_of_transformers_two_implementations(bf16_references, bf16_models, arch):
    """Cached bf16 decoding picks the same 12 tokens as transformers' generate with eager or with sdpa attention.
    In bf16 the two disagree with each other on some models (the tiny Gemma here), so slmviz must equal one."""
    ours = bf16_models[arch].generate_ids(IDS, 12, stop_at_eos=False)
    runs = [reference_generate(hf, IDS, 12)[:12] for hf in bf16_references[arch]]
    assert ours in runs


def test_rope_rotates_in_the_dtype_its_family_uses(bf16_references, bf16_models):
    """OLMo-2 rotates q, k in fp32 and casts back; LLaMA (and Qwen, Gemma) casts cos/sin to bf16 and rotates in
    bf16. Either family run with the other's rule differs from transformers in bf16 (rope.rotation_dtype)."""
    for arch in ("olmo2", "llama_gqa"):
        m = bf16_models[arch]
        eager = run_reference(bf16_references[arch][0], IDS)
        assert torch.equal(m.trace(IDS).logits, eager.logits), arch  # a full trace: eager attention, like the run
        swapped = dataclasses.replace(m.cfg, rope_in_fp32=not m.cfg.rope_in_fp32)
        wrong = slmviz.Model(swapped, type(m.decoder)(swapped, m.decoder.params), m.tokenizer, m.name)
        assert not torch.equal(wrong.trace(IDS).logits, eager.logits), arch


def test_every_variant_and_hook_runs_in_bf16(bf16_models):
    """Every preset that applies traces and decodes in bf16 on every family; a hook fn edits a bf16 value; a hook
    returning fp32 into a bf16 model is refused with a message naming both dtypes."""
    for m in bf16_models.values():
        for name in slmviz.variants(m):
            t = m.trace(IDS, variant=name, names=["blocks.0.hook_resid_post"])
            assert t.logits.dtype == BF16 and t["blocks.0.hook_resid_post"].dtype == BF16, name
            assert len(m.generate_ids(IDS, 2, variant=name, stop_at_eos=False)) == 2, name
    m = bf16_models["llama_gqa"]
    zeroed = m.trace(IDS, hooks={"blocks.1.hook_mlp_out": lambda x, _n: torch.zeros_like(x)})
    assert not torch.equal(zeroed.logits, m.trace(IDS).logits)
    assert torch.equal(zeroed["blocks.1.hook_resid_post"], zeroed["blocks.1.hook_resid_mid"])
    with pytest.raises(ValueError, match="returned dtype torch.float32, expected torch.bfloat16"):
        m.trace(IDS, hooks={"blocks.0.hook_attn_out": lambda x, _n: x.float()})


def test_a_bf16_traces_views_and_plots_work(bf16_models):
    """The pandas views and figures of a bf16 trace (numpy has no bf16: each view upcasts what it shows)."""
    t = bf16_models["gemma3"].trace(IDS)
    assert len(t.logit_lens()) and len(t.top_tokens()) and len(t.residual_norms())
    assert t.plot_attention(1) is not None and t.plot_residual_norms() is not None
    assert len(t.logit_attribution(20, 21, by="head"))


def test_a_bf16_trace_saves_and_loads_in_bf16(bf16_models, tmp_path):
    t = bf16_models["gemma3"].trace(IDS)
    back = slmviz.Trace.load(t.save(tmp_path / "t.safetensors"))
    assert back.logits.dtype == BF16 and torch.equal(back.logits, t.logits)
    assert torch.equal(back["blocks.1.attn.hook_result"], t["blocks.1.attn.hook_result"])


def test_float32_stays_the_default_and_dtype_names_are_checked(tiny_dir):
    assert slmviz.load(tiny_dir).dtype == torch.float32
    assert checked_dtype("bf16", torch.device("cpu")) == BF16 and checked_dtype(BF16, torch.device("cpu")) == BF16
    with pytest.raises(ValueError, match=r"float16.*CUDA only.*bfloat16"):
        slmviz.load(tiny_dir, dtype="float16")
    with pytest.raises(ValueError, match=r"dtype must be 'float32' \(default\), 'bfloat16'.*'int8'"):
        slmviz.load(tiny_dir, dtype="int8")
    with pytest.raises(ValueError, match="dtype must be"):
        slmviz.load(tiny_dir, dtype=torch.int64)


def test_bf16_on_a_cpu_without_fast_bf16_warns_with_the_measured_slowdown(tiny_dir, monkeypatch):
    monkeypatch.setattr(params, "_bf16_slowdown", 37.0)
    with pytest.warns(SlowDtypeWarning, match=r"37x slower than float32.*dtype='float32'"):
        slmviz.load(tiny_dir, dtype="bfloat16")
    monkeypatch.setattr(params, "_bf16_slowdown", 0.4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowDtypeWarning)
        slmviz.load(tiny_dir, dtype="bfloat16")
        slmviz.load(tiny_dir)  # fp32 never asks


def test_the_bf16_slowdown_is_measured_once(monkeypatch):
    monkeypatch.setattr(params, "_bf16_slowdown", None)
    first = params.bf16_matmul_slowdown()
    assert first > 0 and params.bf16_matmul_slowdown() == first


def test_slmviz_check_runs_in_bf16(tiny_dir, capsys):
    from slmviz.cli import main

    assert main(["check", "--model", str(tiny_dir), "--dtype", "bfloat16", "--prompt", "w3 w4 w5 w6 w7"]) == 0
    out = capsys.readouterr().out
    assert "eager attention, bfloat16" in out and "eager vs sdpa" in out and "OK: slmviz matches" in out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["SmolLM2-135M-Instruct", "gemma-3-270m"])
def test_bundled_models_in_bf16_match_transformers_bf16(name):
    """Both bundled models, a 21-token prompt: bf16 trace vs transformers' bf16 eager run, capture-off forward vs
    its sdpa run, within transformers' own eager-vs-sdpa difference; loaded once per dtype."""
    m = slmviz.load(name, dtype="bfloat16")
    assert m.dtype == BF16 and slmviz.load(name, dtype="bf16") is m
    if name == "SmolLM2-135M-Instruct":  # the default dtype is still fp32 after a bf16 load (not Gemma's 1 GB again)
        assert slmviz.load(name).dtype == torch.float32
    ids = m.encode("Once upon a time, in a small village by the sea, there lived")
    reference = load_reference(m.path, dtype=BF16)
    eager = run_reference(reference, ids)
    reference.set_attn_implementation("sdpa")  # the same weights, not a second 1 GB model of Gemma's
    sdpa = run_reference(reference, ids, attentions=False)
    logit_tol, resid_tol = _tolerance(eager, sdpa)
    t = m.trace(ids, names=lambda n: n.endswith("hook_resid_post"))
    assert relative_error(eager.logits, t.logits) <= logit_tol
    assert relative_error(sdpa.logits, m.logits(ids)) <= logit_tol
    for layer, resid in enumerate(eager.resid_post):
        assert relative_error(resid, t[f"blocks.{layer}.hook_resid_post"]) <= resid_tol, layer


def test_slmviz_check_refuses_float16_on_the_cpu(tiny_dir, capsys):
    from slmviz.cli import main

    assert main(["check", "--model", str(tiny_dir), "--dtype", "float16"]) == 2
    err = capsys.readouterr().err
    assert "float16" in err and "CUDA only" in err
