"""The fast kernels agree with the plain formulas they replace: row-split matmuls, one-query attention,
the fused SDPA path, and the preallocated KV cache. (End-to-end parity is in test_parity.py; these pin
each piece on its own, so a failure names the kernel.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slmviz.model import params
from slmviz.model.attention import attention_mask, eager_attention, fused_attention, kv_head_index
from slmviz.model.kv_cache import KVCache
from slmviz.model.params import _MIN_SPLIT, linear


@pytest.fixture(autouse=True)
def row_split(monkeypatch):
    """Exercise the row-split kernel whichever kernel this CPU's measurement picked (params.row_split_wins)."""
    monkeypatch.setattr(params, "_row_split_wins", True)
    monkeypatch.setattr(params, "_online", None)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_one_row_linear_equals_f_linear(bias, threads):
    """A decoding step's row-split product equals F.linear whatever the thread count (3 does not divide 1536)."""
    torch.manual_seed(0)
    w = torch.randn(1536, 576)
    assert w.numel() >= _MIN_SPLIT  # large enough to be split
    b = torch.randn(1536) if bias else None
    x = torch.randn(1, 576)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = linear(x, w, b)
    finally:
        torch.set_num_threads(saved)
    assert out.shape == (1, 1536) and out.is_contiguous()
    assert _relative(out, F.linear(x, w, b)) <= 1e-6


def test_one_row_linear_reads_a_strided_row():
    """The row may be a view with gaps (e.g. one half of the fused gate|up output)."""
    torch.manual_seed(0)
    w = torch.randn(576, 1536)
    both = torch.randn(1, 3072)
    half = both[:, :1536]  # stride (3072, 1)
    assert _relative(linear(half, w, None), F.linear(half.contiguous(), w)) <= 1e-6
    column_view = both.t()[:1536].t()  # same values, last-dim stride 1 but built differently
    assert _relative(linear(column_view, w, None), F.linear(half.contiguous(), w)) <= 1e-6


def _reference_attention(q, k, v, allowed, scale, kv_index):
    """The textbook path: gather each query head's KV head, scores, softmax, weighted sum."""
    _, pattern = eager_attention(q, k[:, kv_index], allowed, scale)
    return pattern @ v[:, kv_index]


@pytest.mark.parametrize("n_q,n_k,window", [(1, 9, None), (1, 9, 4), (7, 7, None), (7, 7, 3), (3, 10, None)])
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("batch", [1, 3])
def test_fused_attention_equals_the_eager_formula(n_q, n_k, window, grouped, batch):
    """One-query decoding (two small bmm), SDPA with is_causal, and SDPA with a mask all match eager attention,
    with KV heads shared the kv_head_of way (g < h, no copies) or gathered per query head, for one prompt
    or a batch."""
    torch.manual_seed(0)
    h, g, dh = 6, 2, 8
    q, k, v = torch.randn(batch, h, n_q, dh), torch.randn(batch, g, n_k, dh), torch.randn(batch, g, n_k, dh)
    allowed = attention_mask(n_q, n_k, causal=True, sliding_window=window)
    kv_index = kv_head_index(h, g)
    scale = dh**-0.5
    expected = _reference_attention(q, k, v, allowed, scale, kv_index)
    if grouped:
        z = fused_attention(q, k, v, allowed, scale)
    else:
        z = fused_attention(q, k[:, kv_index], v[:, kv_index], allowed, scale)
    assert z.shape == (batch, h, n_q, dh)
    assert torch.allclose(z, expected, atol=1e-6)


def test_one_query_attention_takes_a_query_transposed_from_pos_major():
    """In the block q arrives as [b, pos, h, dh].transpose(1, 2): the grouping must still pair the right heads."""
    torch.manual_seed(0)
    h, g, dh, n_k = 6, 3, 8, 5
    q = torch.randn(1, 1, h, dh).transpose(1, 2)  # [1, h, 1, dh], strided like the block's
    k, v = torch.randn(1, g, n_k, dh), torch.randn(1, g, n_k, dh)
    expected = _reference_attention(q, k, v, None, dh**-0.5, kv_head_index(h, g))
    assert torch.allclose(fused_attention(q, k, v, None, dh**-0.5), expected, atol=1e-6)


def test_the_one_row_kernel_is_measured_once_or_forced(monkeypatch, two_threads):
    """Forced by $SLMVIZ_ONE_ROW_KERNEL: a fixed choice. Measured: the first choice, then an OnlineChoice."""
    for forced, split in (("linear", False), ("split", True)):
        monkeypatch.setattr(params, "_row_split_wins", None)
        monkeypatch.setattr(params, "_online", None)
        monkeypatch.setenv(params.ONE_ROW_KERNEL_ENV, forced)
        assert params.row_split_wins() is split and params._online is None
    monkeypatch.setattr(params, "_row_split_wins", None)
    monkeypatch.delenv(params.ONE_ROW_KERNEL_ENV)
    wins = params.row_split_wins()  # measured: either kernel, the same numbers
    assert isinstance(params._online, params.OnlineChoice)
    assert (params._online.cost["split"] < params._online.cost["linear"]) is wins


def test_the_online_choice_follows_the_cheaper_kernel_and_retries_the_other_less_and_less():
    choice = params.OnlineChoice(split=1.0, linear=2.0)
    tried = []
    for call in range(1, 10 * choice.EXPLORE):
        kernel = choice.pick()
        if kernel == "linear":
            tried.append(call)
        choice.record(kernel, 1.0 if kernel == "split" else 2.0)
    E, R = choice.EXPLORE, choice.RUN
    runs = [list(range(start, start + R)) for start in (E, E + R - 1 + 2 * E, E + 2 * (R - 1) + 6 * E)]
    assert tried == [c for run in runs for c in run]  # runs of R calls, after 32 calls, then 64 more, then 128 more
    for _ in range(20):  # the split gets slow (a busy machine): its average passes the other's
        choice.record("split", 5.0)
    assert choice.pick() == "linear"


def test_a_retried_runs_first_call_is_not_counted():
    """A lone retried split pays its sleeping thread's wake-up: the run's first call must not decide (see
    OnlineChoice). Here the split's first call of each run is slow and the rest fast: the split must win."""
    choice = params.OnlineChoice(split=3.0, linear=2.0)
    first = True
    for _ in range(4 * choice.EXPLORE):
        kernel = choice.pick()
        if kernel == "split":
            choice.record(kernel, 50.0 if first else 1.0)
            first = False
        else:
            choice.record(kernel, 2.0)
            first = True
    assert choice.best() == "split"


def test_the_adaptive_one_row_product_equals_f_linear(monkeypatch, two_threads):
    """With an OnlineChoice, whichever kernel each call runs, the product equals F.linear to fp32 rounding."""
    monkeypatch.setattr(params, "_online", params.OnlineChoice(split=1.0, linear=1.0))
    monkeypatch.setattr(params, "_online_by_dtype", {})
    torch.manual_seed(0)
    w, b, x = torch.randn(1536, 576), torch.randn(1536), torch.randn(1, 576)
    for _ in range(2 * params.OnlineChoice.EXPLORE):
        assert _relative(linear(x, w, b), F.linear(x, w, b)) <= 1e-6
    assert params._online_by_dtype[torch.float32].calls == 2 * params.OnlineChoice.EXPLORE


def test_kv_cache_appends_in_place_and_grows():
    cache = KVCache(n_layers=2, n_kv_heads=2, d_head=4, capacity=3)
    buffer = cache.k[0]
    first_k, first_v = torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4)
    keys, values = cache.append(0, first_k, first_v)
    assert keys.shape == (1, 2, 2, 4) and torch.equal(keys, first_k) and torch.equal(values, first_v)
    assert keys.data_ptr() == buffer.data_ptr()  # a view of the preallocated buffer, no copy per step
    cache.append(1, first_k, first_v)
    cache.advance(2)
    more_k, more_v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)  # past the capacity of 3
    keys, values = cache.append(0, more_k, more_v)
    assert cache.capacity >= 5
    assert torch.equal(keys, torch.cat((first_k, more_k), dim=2))
    assert torch.equal(values, torch.cat((first_v, more_v), dim=2))
    assert torch.equal(cache.k[1][:, :, :2], first_k)  # the other layer's entries survived the growth


@pytest.mark.parametrize("h,g", [(6, 2), (4, 4), (4, 1)])
def test_gathering_kv_heads_by_copy_equals_the_index_gather(h, g):
    """gather_kv's expand-and-copy (contiguous groups) gives exactly what indexing with kv_head_index gives."""
    from slmviz.model.attention import gather_kv

    torch.manual_seed(0)
    k = torch.randn(2, g, 5, 8)
    index = kv_head_index(h, g)
    assert torch.equal(gather_kv(k, index, grouped=True), k[:, index])
    tiled = kv_head_index(h, g, "tile")
    assert torch.equal(gather_kv(k, tiled, grouped=False), k[:, tiled])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_in_fp32", [False, True])
def test_the_unhooked_low_precision_norm_equals_the_hooked_formula(dtype, weight_in_fp32):
    """normalize's torch.rms_norm shortcut in bf16 / fp16 is bit-identical to the step-by-step path that hooks take
    (x.float() * rsqrt(mean(x²) + eps), the weight after the cast back, or before it in fp32)."""
    from slmviz.model.norm import normalize

    torch.manual_seed(0)
    x = (torch.randn(3, 7, 64) * 30).to(dtype)
    weight = 1 + 0.5 * torch.randn(64)
    weight = weight if weight_in_fp32 else weight.to(dtype)
    fast = normalize(x, weight, 1e-6, weight_in_fp32=weight_in_fp32)
    slow = normalize(x, weight, 1e-6, on_scale=lambda s: s, weight_in_fp32=weight_in_fp32)  # a hook: the long path
    assert fast.dtype == dtype and torch.equal(fast, slow)


def test_one_thread_restores_the_thread_count_and_changes_no_number():
    """The decoding step's attention runs on one thread (params.one_thread): the same values as its three ops on
    every thread, and torch's thread count is back afterwards, also when the block raises."""
    torch.manual_seed(0)
    h, g, dh, n_k = 9, 3, 64, 40
    q, k, v = torch.randn(1, h, 1, dh), torch.randn(1, g, n_k, dh), torch.randn(1, g, n_k, dh)
    scores = torch.baddbmm(torch.empty(()), q.reshape(g, h // g, dh), k.reshape(g, n_k, dh).transpose(1, 2), beta=0,
                           alpha=dh**-0.5)
    all_threads = torch.bmm(torch.softmax(scores, dim=-1), v.reshape(g, n_k, dh)).view(1, h, 1, dh)
    threads = torch.get_num_threads()
    with params.one_thread(torch.device("cpu")):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == threads
    assert torch.equal(fused_attention(q, k, v, None, dh**-0.5), all_threads)
    with pytest.raises(RuntimeError), params.one_thread(torch.device("cpu")):
        raise RuntimeError("inside")
    assert torch.get_num_threads() == threads


def test_the_kernel_probe_streams_from_memory_not_the_cache():
    """row_split_wins must time a working set the cache cannot hold (see params.probe_matrices)."""
    layer = 1536 * 576 * 4  # one [768 * 2 threads, 576] fp32 matrix
    assert params.probe_matrices(layer) * layer >= min(4 * params.last_level_cache_bytes(), 512 << 20)
    assert params.probe_matrices(layer) * layer >= 64 << 20
    assert params.last_level_cache_bytes() >= 1 << 20
