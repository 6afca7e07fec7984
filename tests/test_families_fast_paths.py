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
