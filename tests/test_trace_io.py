"""Saving and loading traces: exact round trips, atomic saves, and clear errors for files that are not
traces of this format version.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import slmviz
from slmviz.trace import FORMAT_VERSION, Trace, TraceFormatError
from slmviz.variants import Variant

# slmviz.trace is also the name of the trace() function, so reach the module through sys.modules.
trace_module = sys.modules["slmviz.trace"]

BROKEN = Variant(norm="post", norm_type="layer", rope="interleaved", rope_theta=12345.5, gqa="tile", causal=False,
                 mlp="standard", kv_position_bug=True)


def assert_same_trace(a: Trace, b: Trace) -> None:
    """Everything a Trace saves, compared exactly (NaN equal to NaN, dtypes included)."""
    assert a.tokens == b.tokens
    assert a.names == b.names  # same hooks, same order
    for name, x in [("input_ids", a.input_ids), ("logits", a.logits), *a.cache.items()]:
        y = b.input_ids if name == "input_ids" else b.logits if name == "logits" else b.cache[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        torch.testing.assert_close(y, x, rtol=0, atol=0, equal_nan=True, msg=name)
    assert a.config == b.config
    assert a.variant == b.variant
    assert a.model_name == b.model_name
    assert a.vocab_strings == b.vocab_strings


@pytest.fixture
def saved(tiny_model, tmp_path) -> tuple[Trace, Path]:
    """A full trace of the tiny model under a variant that changes every field, saved once."""
    t = tiny_model.trace("w1 w2 w3 w4 w5", variant=BROKEN)
    t.top_tokens(k=3)  # fills vocab_strings, which are saved too
    path = tmp_path / "traces" / "a.safetensors"
    t.save(path)
    return t, path


# --- round trips ---------------------------------------------------------------------------------


def test_save_then_load_is_an_exact_round_trip(saved):
    """Every tensor (bit for bit and dtype), the tokens, the hook order, config, variant (all fields
    changed, a non-default rope_theta), model name and vocab strings come back; the loaded trace answers
    the same questions without a model attached."""
    t, path = saved
    loaded = Trace.load(path)
    assert len(t.vocab_strings) == 3
    assert_same_trace(t, loaded)
    assert loaded._model is None
    assert loaded.top_tokens(k=3).equals(t.top_tokens(k=3))
    assert loaded.residual_norms().equals(t.residual_norms())


@pytest.mark.parametrize("ids", [[7], [1, 2, 3]], ids=["one_token", "three_tokens"])
def test_a_full_default_trace_saves_even_though_hooks_share_tensors(tiny_model, tmp_path, ids):
    """hook_embed is the same tensor as blocks.0.hook_resid_pre, resid_pre[L+1] is resid_post[L], and with one
    token q/k/v are views of one buffer; safetensors refuses shared memory, so save() must copy them apart.
    (Before the fix, saving any default trace raised.)"""
    t = tiny_model.trace(ids)
    assert t["hook_embed"].data_ptr() == t["blocks.0.hook_resid_pre"].data_ptr()  # one buffer, two names
    path = t.save(tmp_path / "t.safetensors")
    assert_same_trace(t, Trace.load(path))


def test_a_partial_capture_round_trips(tiny_model, tmp_path):
    """A trace of a few hooks (names=) saves only those and loads them back in the same order."""
    names = ["blocks.1.attn.hook_pattern", "hook_embed", "blocks.0.mlp.hook_post"]
    t = tiny_model.trace([3, 4, 5, 6], names=names)
    loaded = Trace.load(t.save(tmp_path / "p.safetensors"))
    assert loaded.names == t.names and set(loaded.names) == set(names)
    assert_same_trace(t, loaded)


@pytest.mark.slow
def test_the_real_model_round_trips_odd_tokens_and_non_finite_values(model, tmp_path):
    """SmolLM2 under no_norm on text with emoji, control characters and other scripts: token strings
    (including lone replacement characters from split emoji) and any inf/NaN values survive the round trip."""
    text = "Hi 😀\x00\x1b[0m 日本語\n\t ok"
    t = model.trace(text, variant="no_norm", names=lambda n: "resid" in n or "ln_final" in n)
    loaded = Trace.load(t.save(tmp_path / "real.safetensors"))
    assert_same_trace(t, loaded)
    assert loaded.first_nonfinite() == t.first_nonfinite()


# --- atomic saves --------------------------------------------------------------------------------


def _half_write_then(error: BaseException):
    """A save_file that writes the first part of the file, as a full disk or an interrupt would, then fails."""

    def broken_save_file(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x00" * 100)
        raise error

    return broken_save_file


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()],
                         ids=["disk_full", "interrupt"])
def test_a_failure_mid_save_keeps_the_previous_trace_and_leaves_no_temp_file(saved, tiny_model, monkeypatch, error):
    """Saving a second trace over the first fails part-way: the error propagates, the first trace still loads
    exactly, and the folder holds only that file (the partial temp file is gone)."""
    first, path = saved
    second = tiny_model.trace("w9 w8")
    monkeypatch.setattr(trace_module, "save_file", _half_write_then(error))
    with pytest.raises(type(error)):
        second.save(path)
    assert sorted(os.listdir(path.parent)) == [path.name]
    assert_same_trace(first, Trace.load(path))


def test_a_failed_rename_keeps_the_previous_trace_and_leaves_no_temp_file(saved, tiny_model, monkeypatch):
    """The last step (rename over the target) fails: same guarantees as a failure while writing."""
    first, path = saved

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied", str(dst))

    monkeypatch.setattr(trace_module.os, "replace", refuse)
    with pytest.raises(PermissionError):
        tiny_model.trace("w9 w8").save(path)
    monkeypatch.undo()
    assert sorted(os.listdir(path.parent)) == [path.name]
    assert_same_trace(first, Trace.load(path))


def test_a_failure_on_a_first_save_leaves_nothing_behind(tiny_model, monkeypatch, tmp_path):
    """No earlier file: a failed save leaves neither a partial target nor a temp file."""
    monkeypatch.setattr(trace_module, "save_file", _half_write_then(OSError(28, "No space left on device")))
    with pytest.raises(OSError):
        tiny_model.trace("w1").save(tmp_path / "new.safetensors")
    assert os.listdir(tmp_path) == []


def test_a_successful_save_replaces_the_previous_trace(saved, tiny_model):
    """Control for the failure tests: without a failure the second trace replaces the first, no temp file."""
    _, path = saved
    second = tiny_model.trace("w9 w8")
    second.save(path)
    assert sorted(os.listdir(path.parent)) == [path.name]
    assert_same_trace(second, Trace.load(path))


def test_a_saved_trace_gets_ordinary_file_permissions(saved):
    """The temp file is created like any new file (0o666 minus the umask), not owner-only as mkstemp makes it,
    so a trace saved for download or sharing is readable like the user's other files."""
    _, path = saved
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


# --- files that are not (this version's) traces --------------------------------------------------


def _rewrite_metadata(path: Path, **changes: str | None) -> None:
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    tensors = load_file(str(path))
    for key, value in changes.items():
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    save_file(tensors, str(path), metadata=meta)


@pytest.mark.parametrize("version, advice", [(FORMAT_VERSION - 1, "re-run the trace"), (FORMAT_VERSION + 1, "upgrade")],
                         ids=["older", "newer"])
def test_a_trace_of_another_format_version_is_a_trace_format_error(saved, version, advice):
    """Both versions are named, with what to do about it."""
    _, path = saved
    _rewrite_metadata(path, slmviz_format=str(version))
    with pytest.raises(TraceFormatError) as err:
        Trace.load(path)
    message = str(err.value)
    assert f"trace format {version}" in message and f"reads format {FORMAT_VERSION}" in message
    assert advice in message


def test_a_safetensors_file_that_is_not_a_trace_is_a_trace_format_error(tiny_dir, tmp_path):
    """A model checkpoint and a bare tensor file are valid safetensors but not traces."""
    bare = tmp_path / "bare.safetensors"
    save_file({"x": torch.ones(3)}, str(bare))
    for path in (bare, tiny_dir / "model.safetensors"):
        with pytest.raises(TraceFormatError, match="not a slmviz trace"):
            Trace.load(path)


@pytest.mark.parametrize("content", [b"", b"garbage" * 100, b"\xff" * 8, b"PK\x03\x04 a zip file"],
                         ids=["empty", "garbage", "huge_header", "zip"])
def test_a_garbage_file_is_a_trace_format_error(tmp_path, content):
    """Bytes that are not safetensors at all."""
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(TraceFormatError, match="not a readable .safetensors trace"):
        Trace.load(path)


def test_a_truncated_trace_is_a_trace_format_error(saved):
    """A download or copy that stopped half-way."""
    _, path = saved
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(TraceFormatError, match="not a readable"):
        Trace.load(path)


@pytest.mark.parametrize(
    "changes",
    [
        {"hook_order": None},
        {"hook_order": '["blocks.0.hook_resid_pre", "blocks.99.hook_missing"]'},
        {"tokens": "not json"},
        {"config": '{"model_type": "llama"}'},
        {"variant": '{"norm": "sideways"}'},
    ],
    ids=["no_hook_order", "missing_tensor", "bad_json", "incomplete_config", "invalid_variant"],
)
def test_a_trace_with_damaged_metadata_is_a_trace_format_error(saved, changes):
    """Right format version, but entries missing or unreadable: TraceFormatError, not a KeyError/TypeError."""
    _, path = saved
    _rewrite_metadata(path, **changes)
    with pytest.raises(TraceFormatError, match="damaged slmviz trace"):
        Trace.load(path)


def test_a_missing_trace_file_is_a_file_not_found_error(tmp_path):
    """A wrong path says so, rather than calling the (absent) file a bad trace."""
    with pytest.raises(FileNotFoundError, match="No saved trace"):
        Trace.load(tmp_path / "nope.safetensors")


def test_slmviz_exports_the_trace_error_types():
    """The error types callers catch are part of the public API."""
    assert slmviz.TraceFormatError is TraceFormatError and slmviz.Trace is Trace
