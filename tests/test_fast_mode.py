"""The app's "fast (bf16)" switch (app/fast_mode.py) and the model store's bf16 copies, in process.

The switch is offered only where a bf16 matmul measures at least MIN_SPEEDUP faster than fp32; the store keeps
bf16 copies apart from the fp32 models, so switching never evicts the startup model.
Does not cover: a sweep through the server (tests/test_patch_app.py) nor bf16 accuracy (tests/test_dtype_bulk.py).
"""

from __future__ import annotations

import gradio as gr
import pytest
import torch
from app_helpers import REPO  # noqa: F401  (puts the repository on sys.path for `app`)

from app import fast_mode
from app.models import ModelStore
from slmviz.model import params


@pytest.fixture()
def measured(monkeypatch):
    def set_slowdown(value: float) -> None:
        monkeypatch.setattr(params, "_bf16_bulk_speedup", 1 / value)
    return set_slowdown


def test_the_switch_is_offered_only_where_bf16_measures_fast(measured):
    measured(1 / 3)  # bf16 3x faster (this machine kind's AMD EPYC)
    choice = fast_mode.fast_choice()
    assert choice.available and choice.speedup == pytest.approx(3.0) and "3.0x faster" in choice.info
    assert fast_mode.dtype_for(True) == "bfloat16" and fast_mode.dtype_for(False) == "float32"
    measured(40.0)  # software bf16: 40x slower
    choice = fast_mode.fast_choice()
    assert not choice.available and "40.0x slower" in choice.info
    assert fast_mode.dtype_for(None) == "float32"
    with pytest.raises(gr.Error, match="slower than fp32"):
        fast_mode.dtype_for(True)  # an API client sending True to the disabled box


def test_the_threshold_is_the_stated_one(measured):
    measured(1 / (fast_mode.MIN_SPEEDUP * 0.99))
    assert not fast_mode.fast_choice().available
    measured(1 / (fast_mode.MIN_SPEEDUP * 1.01))
    assert fast_mode.fast_choice().available


def test_the_store_keeps_bf16_copies_apart_from_the_fp32_models():
    store = ModelStore()
    fp32 = store.get()
    copy = store.get(dtype="bfloat16")
    assert fp32.dtype == torch.float32 and copy.dtype == torch.bfloat16
    assert store.get(dtype="bfloat16") is copy and store.get() is fp32  # each loaded once
    assert store.is_loaded(None)
    ids = fp32.encode("In the beginning")
    top3 = copy.logits(ids).topk(3, dim=-1).indices  # bf16 may swap near-ties (top-1 agreement ~99 %)
    assert (top3 == fp32.logits(ids).argmax(-1, keepdim=True)).any(-1).all()
