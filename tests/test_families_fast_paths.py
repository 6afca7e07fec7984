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


@pytest.mark.parametrize(("norm_type", "bias", "in_fp32", "dtype"), [
    ("layer", True, False, torch.float32), ("rms", False, True, torch.float32), ("rms", False, False, torch.bfloat16),
    ("layer", True, False, torch.bfloat16),
])
def test_hooked_norms_give_the_same_values_on_one_thread(two_threads, monkeypatch, norm_type, bias, in_fp32, dtype):
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

    *one, hook_threads = run()
    monkeypatch.setattr(norm, "hooked_norm_threads", lambda x: contextlib.nullcontext())
    *every, _ = run()
    assert hook_threads == [2, 2]
    for a, e in zip(one, every, strict=True):
        assert torch.equal(a, e)


def test_hooked_norms_keep_every_thread_for_rows_past_the_grain(two_threads):
    """A row longer than ATen's grain is summed in pieces by several threads; on one thread it would round
    otherwise, so such rows keep every thread."""
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


def _threads_per_forward(m, monkeypatch) -> list[tuple[int, int]]:
    """(positions, torch's thread count) of each forward the decoder runs from now on."""
    seen: list[tuple[int, int]] = []
    real = m.decoder._run
    monkeypatch.setattr(m.decoder, "_run", lambda x, *a: seen.append((x.shape[1], torch.get_num_threads())) or
                        real(x, *a))
    return seen


@pytest.mark.parametrize("arch", FAMILIES)
def test_decoding_steps_measure_one_thread_against_every_thread(two_threads, models, monkeypatch, arch):
    """A plain decoding step runs on every thread or on one, as params.StepThreads measures (Decoder.is_plain_step):
    the prompt keeps every thread, the steps try both, and the tokens are transformers' greedy ones either way."""
    from slmviz.loading.reference import load_reference, reference_generate
    from slmviz.model.params import StepThreads

    m = models[arch]
    monkeypatch.setattr(m.decoder, "_step_threads", StepThreads())
    seen = _threads_per_forward(m, monkeypatch)
    ids, n = torch.arange(3, 12), 2 * StepThreads.EXPLORE
    new = m.generate_ids(ids, n, stop_at_eos=False)
    assert seen[0] == (len(ids), 2)  # the prompt
    steps = [threads for positions, threads in seen[1:] if positions == 1]
    assert len(steps) == n - 1 and set(steps) == {1, 2}
    assert torch.get_num_threads() == 2
    assert new == reference_generate(load_reference(m.path), ids, n)[:n]
    assert all(cost < float("inf") for cost in m.decoder._step_threads.cost.values())


def test_hooked_decoding_steps_keep_every_thread(two_threads, models, monkeypatch):
    """A step whose hook points someone reads is not timed, and runs on every thread (its hook fns with it)."""
    m = models["gpt2"]
    monkeypatch.setattr(m.decoder._step_threads, "cost", {"one": 0.0, "every": 1.0})  # one thread would win
    seen = _threads_per_forward(m, monkeypatch)
    hook_threads: list[int] = []
    m.generate_ids(torch.arange(3, 8), 4, stop_at_eos=False,
                   hooks={"blocks.0.hook_resid_post": lambda x, name: hook_threads.append(torch.get_num_threads())})
    assert {threads for _, threads in seen} == {2} and set(hook_threads) == {2}
    m.generate_ids(torch.arange(3, 8), 4, stop_at_eos=False)
    assert {threads for positions, threads in seen[-3:]} == {1}


def test_step_threads_retry_the_slower_way_rarely_when_it_is_much_slower():
    """StepThreads' retries of the slower way cost at most OVERHEAD of the steps between them: with every thread
    four times slower, the next run of them comes hundreds of steps later, not after EXPLORE."""
    from slmviz.model.params import StepThreads

    choice = StepThreads()
    picks = []
    for _ in range(600):
        kernel = choice.pick()
        picks.append(kernel)
        choice.record(kernel, 4.0 if kernel == "every" else 1.0)
    assert picks[: StepThreads.EXPLORE - 1] == ["every"] * (StepThreads.EXPLORE - 1)  # unmeasured: every thread
    first_one = picks.index("one")
    retries = [i for i in range(first_one + 1, len(picks)) if picks[i] == "every" and picks[i - 1] == "one"]
    ratio_bound = StepThreads.RUN * (4.0 - 1) / StepThreads.OVERHEAD
    assert retries and all(b - a >= ratio_bound for a, b in zip([first_one, *retries], retries, strict=False))
    assert picks.count("every") <= StepThreads.EXPLORE + 3 * StepThreads.RUN


def test_a_step_on_one_thread_leaves_other_python_threads_on_theirs(two_threads):
    """torch's thread count is OpenMP's, per Python thread, once that thread has run torch: a decoding step on one
    thread (params.one_thread) in one request of the app leaves a concurrent request's forwards on every thread.
    (A thread whose very first torch call falls inside such a step starts from the process-wide count, 1 then.)"""
    import threading

    from slmviz.model.params import one_thread

    started, step_open, seen = threading.Event(), threading.Event(), []

    def other_request() -> None:
        seen.append(torch.get_num_threads())  # this thread's first torch call: it takes the process's count
        started.set()
        step_open.wait(timeout=30)
        seen.append(torch.get_num_threads())

    worker = threading.Thread(target=other_request)
    worker.start()
    assert started.wait(timeout=30)
    with one_thread(torch.device("cpu")):
        step_open.set()
        worker.join(timeout=30)
    assert seen == [2, 2] and torch.get_num_threads() == 2
