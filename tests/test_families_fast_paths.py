"""The speed paths issue 53's families lean on give the values of the plain paths: a hooked norm's ops on one
thread, a soft-capped decoding step through the one-query kernel, and decoding steps on one thread or all of them
(whichever the decoder measures faster). bench/perf/families.py measures them; no timing here.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from family_models import NEW_FAMILIES, build_family_model

import slmviz
from slmviz.model import norm
from slmviz.model.norm import normalize

FAMILIES = list(NEW_FAMILIES)


@contextlib.contextmanager
def threads(n: int):
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize(("norm_type", "bias", "in_fp32", "dtype"), [
    ("layer", True, False, torch.float32), ("rms", False, True, torch.float32), ("rms", False, False, torch.bfloat16),
    ("layer", True, False, torch.bfloat16),
])
def test_hooked_norms_give_the_same_values_on_one_thread(monkeypatch, norm_type, bias, in_fp32, dtype):
    """norm.hooked_norm_threads runs a hooked norm's ops on one thread: its scale, normalized value and output equal
    those of the same ops on every thread bit for bit, on rows far past ATen's grain in all (so that the ops on
    every thread do split), and the hook fns themselves still run on every thread."""
    torch.manual_seed(0)
    x = (3 * torch.randn(1, 300, 768) + 1).to(dtype)
    weight, b = 1 + 0.1 * torch.randn(768), (0.1 * torch.randn(768) if bias else None)
    if not in_fp32:
        weight = weight.to(dtype)
    b = None if b is None else b.to(dtype)

    def run() -> tuple[torch.Tensor, ...]:
        seen: dict[str, torch.Tensor] = {}
        counts: list[int] = []

        def keep(name):
            def fn(t: torch.Tensor) -> torch.Tensor:
                seen[name] = t
                counts.append(torch.get_num_threads())
                return t
            return fn

        out = normalize(x, weight, 1e-5, norm_type, keep("scale"), keep("normalized"), in_fp32, b)
        return out, seen["scale"], seen["normalized"], counts

    with threads(2):
        *one, hook_threads = run()
        monkeypatch.setattr(norm, "hooked_norm_threads", lambda x: contextlib.nullcontext())
        *every, _ = run()
    assert hook_threads == [2, 2]
    for a, e in zip(one, every, strict=True):
        assert torch.equal(a, e)


def test_hooked_norms_keep_every_thread_for_rows_past_the_grain():
    """A row longer than ATen's grain is summed in pieces by several threads; on one thread it would round
    otherwise, so such rows keep every thread."""
    with threads(2):
        with norm.hooked_norm_threads(torch.zeros(1, 2, 768)):
            assert torch.get_num_threads() == 1
        with norm.hooked_norm_threads(torch.zeros(1, 1, norm._GRAIN)):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 2


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("family-fast")
    return {arch: slmviz.load(build_family_model(root / arch, arch)) for arch in FAMILIES}


@pytest.mark.parametrize("window", [None, 5])
def test_a_soft_capped_decoding_step_takes_the_one_query_kernel_with_the_eager_values(window):
    """Gemma 2's decoding step caps its scores in the one-query kernel (attention._one_query_attention) instead of
    taking the eager path: the same z to fp32 rounding, with scores far past the cap, GQA groups and a window."""
    from slmviz.model.attention import attention_mask, eager_attention, fused_attention, gather_kv

    torch.manual_seed(0)
    h, g, dh, n_k, cap, scale = 8, 4, 16, 12, 50.0, 16**-0.5
    q, k, v = 30 * torch.randn(1, h, 1, dh), 30 * torch.randn(1, g, n_k, dh), torch.randn(1, g, n_k, dh)
    allowed = attention_mask(1, n_k, True, window)
    kv_index = torch.arange(g).repeat_interleave(h // g)
    scores, pattern = eager_attention(q, gather_kv(k, kv_index, True), allowed, scale, cap)
    assert scores[torch.isfinite(scores)].abs().max() > 0.9 * cap  # the cap is what decides these scores
    eager_z = torch.matmul(pattern, gather_kv(v, kv_index, True))
    torch.testing.assert_close(fused_attention(q, k, v, allowed, scale, cap), eager_z, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="soft-cap"):
        fused_attention(q.expand(1, h, 2, dh), k, v, None, scale, cap)


def test_gemma2_decodes_through_the_one_query_kernel(models, monkeypatch):
    """No hook reads Gemma 2's scores during plain generation, so its steps skip the eager path (which a prompt of
    several tokens still takes), and decode the same tokens as the full forward's greedy argmax."""
    from slmviz.model import block

    m = models["gemma2"]
    eager_calls = []
    real = block.eager_attention
    monkeypatch.setattr(block, "eager_attention", lambda q, *a: eager_calls.append(q.shape[2]) or real(q, *a))
    ids = torch.arange(3, 12)
    new = m.generate_ids(ids, 6, stop_at_eos=False)
    assert eager_calls and set(eager_calls) == {len(ids)}  # the prefill only
    full = torch.cat([ids, torch.tensor(new)])
    assert m.logits(full)[len(ids) - 1:-1].argmax(-1).tolist() == new
