"""Bad input gives a clear, specific error: what was wrong and what is accepted.

Never a bare KeyError, a ZeroDivisionError or an index error from deep inside torch. Odd but valid text
(emoji, control characters, other scripts, long words, whitespace) runs. Loading cases build broken
copies of the tiny transformers-made checkpoint; prompt, variant and hook cases use the tiny model, and
the odd-text cases use the real SmolLM2 tokenizer.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import slmviz
from slmviz.config import SUPPORTED_ARCHITECTURES, UnsupportedModelError
from slmviz.hooks import HookError, HookNameError
from slmviz.loading.weights import WeightsError
from slmviz.tokens import PromptError
from slmviz.variants import PRESETS

ATTN_Q = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture
def broken_copy(tiny_dir, tmp_path):
    """A fresh, writable copy of the tiny llama checkpoint to damage."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_dir, folder)
    return folder


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))


# --- loading -------------------------------------------------------------------------------------


def test_a_missing_model_path_is_a_file_not_found_error_that_names_it(tmp_path, monkeypatch):
    """A path that does not exist (and is not owner/name shaped) is refused without any download.
    Does not cover a missing owner/name-shaped path, which is a hub lookup (see test_safety.py)."""
    monkeypatch.chdir(tmp_path)
    missing = tmp_path / "no" / "such" / "model"
    with pytest.raises(FileNotFoundError, match="No model folder") as err:
        slmviz.load(missing)
    assert str(missing) in str(err.value)
    assert "hub id" in str(err.value)  # says what else would have been accepted


@pytest.mark.parametrize("path", ["", "   "])
def test_an_empty_model_path_is_refused_rather_than_loading_the_current_folder(path, tmp_path, monkeypatch):
    """"" would otherwise be Path(".") and load whatever folder the process runs in."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="empty"):
        slmviz.load(path)


def test_a_model_argument_of_the_wrong_type_is_a_type_error():
    """load(3) says what load() takes instead of failing inside pathlib."""
    with pytest.raises(TypeError, match="folder path or a hub id"):
        slmviz.load(3)


def test_a_folder_without_config_json_is_refused(broken_copy):
    """A folder of weights with no config.json is not guessed at."""
    (broken_copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        slmviz.load(broken_copy)


def _config_folder(tmp_path: Path, kind: str) -> Path:
    """A folder holding only the config.json transformers itself writes for `kind` (no weights at all)."""
    import transformers

    folder = tmp_path / kind
    if kind == "bloom":  # an architecture transformers knows and slmviz does not reimplement
        transformers.BloomConfig(n_layer=1, hidden_size=32, n_head=2).save_pretrained(folder)
    elif kind == "gemma3_text":
        transformers.Gemma3TextConfig(num_hidden_layers=1, hidden_size=32).save_pretrained(folder)
    elif kind == "gemma3":
        transformers.Gemma3Config().save_pretrained(folder)
    else:  # a model_type transformers does not know either
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": kind, "hidden_size": 8}))
    return folder


@pytest.mark.parametrize("kind", ["bloom", "gemma3_text", "gemma3", "made_up_arch"])
def test_an_unsupported_architecture_names_the_supported_ones(kind, tmp_path):
    """A config of another architecture fails on the config (before weights are read) with
    UnsupportedModelError naming the model_type and every supported one.
    Does not cover Gemma 3 once it is supported: the test then follows SUPPORTED_ARCHITECTURES."""
    if kind.startswith("gemma3") and any(a.startswith("gemma3") for a in SUPPORTED_ARCHITECTURES):
        pytest.skip("Gemma 3 is supported now")
    folder = _config_folder(tmp_path, kind)
    with pytest.raises(UnsupportedModelError) as err:
        slmviz.load(folder)
    message = str(err.value)
    assert repr(kind) in message
    for supported in SUPPORTED_ARCHITECTURES:
        assert supported in message


def test_a_config_without_model_type_names_the_supported_architectures(broken_copy):
    """config.json without model_type: say so, and what would be accepted."""
    _edit_config(broken_copy, model_type=None)
    with pytest.raises(UnsupportedModelError, match="no model_type") as err:
        slmviz.load(broken_copy)
    assert "llama" in str(err.value)


@pytest.mark.parametrize("text", ["{not json", "", "[1, 2]", "\xff\xfe"])
def test_a_config_that_is_not_a_json_object_is_refused_clearly(broken_copy, text):
    """Invalid JSON, an empty file, a list, or non-UTF-8 bytes in config.json."""
    (broken_copy / "config.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(UnsupportedModelError, match="config.json"):
        slmviz.load(broken_copy)


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"num_attention_heads": 0, "num_key_value_heads": 0}, "num_attention_heads"),
        ({"num_hidden_layers": -1}, "num_hidden_layers"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),  # 4 heads do not split into 3 groups
    ],
)
def test_impossible_sizes_in_the_config_are_refused_by_name(broken_copy, changes, key):
    """Sizes that would end in a ZeroDivisionError or a torch shape error are named instead."""
    _edit_config(broken_copy, **changes)
    with pytest.raises(UnsupportedModelError, match=key):
        slmviz.load(broken_copy)


def _damage(data: bytes, how: str) -> bytes:
    if how == "half":
        return data[: len(data) // 2]
    if how == "last_byte":
        return data[:-1]
    if how == "header_only":
        return data[: 8 + int.from_bytes(data[:8], "little")]
    if how == "eight_bytes":
        return data[:8]
    if how == "empty":
        return b""
    if how == "garbage":
        return bytes(range(256)) * 64
    if how == "header_bytes":  # non-UTF-8 bytes inside the JSON header
        return data[:12] + b"\xff" * 8 + data[20:]
    if how == "header_lies":  # header length field larger than the file
        return (len(data) * 2).to_bytes(8, "little") + data[8:]
    raise AssertionError(how)


@pytest.mark.parametrize(
    "how", ["half", "last_byte", "header_only", "eight_bytes", "empty", "garbage", "header_bytes", "header_lies"]
)
def test_a_corrupt_or_truncated_safetensors_file_is_a_weights_error(broken_copy, how):
    """Truncated at several points, emptied, overwritten, or with a damaged header: WeightsError naming
    the file and saying it is corrupt or truncated. Does not cover flipped bits inside the tensor data,
    which safetensors has no checksum to detect."""
    weights = broken_copy / "model.safetensors"
    weights.write_bytes(_damage(weights.read_bytes(), how))
    with pytest.raises(WeightsError, match="corrupt or truncated") as err:
        slmviz.load(broken_copy)
    assert str(weights) in str(err.value)


def _rewrite_weights(folder: Path, edit) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_a_weight_whose_shape_does_not_match_the_config_is_named_with_both_shapes(broken_copy):
    """One projection stored with too few rows: the message names it, its shape and the expected one."""
    _rewrite_weights(broken_copy, lambda t: t.__setitem__(ATTN_Q, t[ATTN_Q][:-8].clone()))
    with pytest.raises(WeightsError) as err:
        slmviz.load(broken_copy)
    message = str(err.value)
    assert ATTN_Q in message and "(56, 64)" in message and "(64, 64)" in message


def test_a_config_that_does_not_fit_its_weights_is_a_weights_error(broken_copy):
    """The weights are right, the config is wrong (hidden_size halved): caught by the shape check."""
    _edit_config(broken_copy, hidden_size=32)
    with pytest.raises(WeightsError, match="shape"):
        slmviz.load(broken_copy)


def test_a_config_with_more_layers_than_the_weights_names_the_missing_weight(broken_copy):
    """num_hidden_layers says 3, the checkpoint has 2: the first missing layer's weight is named.
    Does not cover the reverse (fewer layers in the config), which transformers also loads silently."""
    _edit_config(broken_copy, num_hidden_layers=3)
    with pytest.raises(WeightsError, match=r"model\.layers\.2\..* is missing"):
        slmviz.load(broken_copy)


def test_a_missing_weight_is_named(broken_copy):
    """A checkpoint without one tensor names that tensor instead of raising a bare KeyError."""
    _rewrite_weights(broken_copy, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(WeightsError, match=r"'model\.norm\.weight' is missing"):
        slmviz.load(broken_copy)


def _shard(folder: Path, weight_map: dict | str) -> None:
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    text = weight_map if isinstance(weight_map, str) else json.dumps({"weight_map": weight_map})
    (folder / "model.safetensors.index.json").write_text(text)


def test_a_sharded_checkpoint_loads_through_its_index(broken_copy, tiny_model):
    """Positive control for the index cases below: the same weights as one named shard load and agree."""
    keys = load_file(str(broken_copy / "model.safetensors")).keys()
    _shard(broken_copy, {k: "model-00001-of-00001.safetensors" for k in keys})
    ids = [1, 2, 3]
    assert torch.equal(slmviz.load(broken_copy).logits(ids), tiny_model.logits(ids))


@pytest.mark.parametrize(
    "weight_map, match",
    [
        ("{broken", "not a valid safetensors index"),
        ('{"no_weight_map": {}}', "not a valid safetensors index"),
        ({"x": "model-00002-of-00002.safetensors"}, "Missing weight shard"),
        ({"x": "../model-00001-of-00001.safetensors"}, "expected a \\*.safetensors file in"),
        ({"x": "/etc/passwd"}, "expected a \\*.safetensors file in"),
        ({"x": "pytorch_model.bin"}, "expected a \\*.safetensors file in"),
    ],
)
def test_a_broken_shard_index_is_a_weights_error(broken_copy, weight_map, match):
    """Unreadable index, no weight_map, a missing shard, or a shard outside the folder (an index must
    not make slmviz read files elsewhere on disk) or not safetensors."""
    _shard(broken_copy, weight_map)
    with pytest.raises(WeightsError, match=match):
        slmviz.load(broken_copy)


def test_a_folder_with_a_broken_tokenizer_says_what_is_wrong(broken_copy):
    """Weights and config and an unreadable tokenizer.json: WeightsError that mentions the tokenizer. (A folder
    with no tokenizer files at all loads, for token ids only: tests/test_tokenizerless.py.)"""
    (broken_copy / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(WeightsError, match="tokenizer"):
        slmviz.load(broken_copy)


# --- prompts -------------------------------------------------------------------------------------

ENTRY_POINTS = {
    "trace": lambda m, p: m.trace(p),
    "logits": lambda m, p: m.logits(p),
    "generate": lambda m, p: m.generate(p, max_new_tokens=1),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize(
    "prompt", ["", [], (), torch.empty(0, dtype=torch.long)], ids=["str", "list", "tuple", "tensor"]
)
def test_an_empty_prompt_is_a_prompt_error(tiny_model, entry, prompt):
    """Empty text or no ids, through each public entry point, says the prompt is empty."""
    with pytest.raises(PromptError, match="empty"):
        ENTRY_POINTS[entry](tiny_model, prompt)


@pytest.mark.parametrize("prompt", [None, 3, 2.5, True, b"bytes", {"a": 1}])
def test_a_prompt_of_the_wrong_type_says_what_is_accepted(tiny_model, prompt):
    """Anything that is neither text nor token ids."""
    with pytest.raises(PromptError, match="must be text"):
        tiny_model.trace(prompt)


@pytest.mark.parametrize(
    "prompt, match",
    [
        (["a", "b"], "integers"),
        ([1.5, 2.0], "integers"),
        (torch.tensor([True, False]), "integers"),
        ([1, [2, 3]], "integers"),
        ([2**70], "integers"),
        ([[1, 2], [3, 4]], r"one sequence \[pos\]"),
    ],
)
def test_ids_that_are_not_a_flat_integer_sequence_are_a_prompt_error(tiny_model, prompt, match):
    """Strings, floats, bools, ragged or nested lists, or overflowing ints as token ids."""
    with pytest.raises(PromptError, match=match):
        tiny_model.trace(prompt)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("bad, position", [([5, 128], 1), ([-1, 3], 0), ([1, 2, 3, 10**6], 3)])
def test_token_ids_outside_the_vocabulary_are_named_with_their_position(tiny_model, entry, bad, position):
    """An id < 0 or >= vocab_size (128) never reaches the embedding lookup (an IndexError deep in torch)."""
    with pytest.raises(PromptError, match="outside the vocabulary") as err:
        ENTRY_POINTS[entry](tiny_model, bad)
    assert f"{bad[position]} at position {position}" in str(err.value)
    assert "[0, 128)" in str(err.value)


def test_the_first_and_last_vocabulary_ids_are_accepted(tiny_model):
    """Boundary control for the range check: 0 and vocab_size - 1 are valid, also as a [1, pos] tensor."""
    assert tiny_model.trace([0, 127]).logits.shape == (2, 128)
    assert tiny_model.trace(torch.tensor([[0, 127]])).logits.shape == (2, 128)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_a_prompt_longer_than_the_context_is_a_prompt_error(tiny_model, entry):
    """The tiny model's context is 64: 65 ids are refused, naming the limit; 64 run (for trace)."""
    with pytest.raises(PromptError, match=r"65 tokens; the limit is 64 \(the model's context length\)"):
        ENTRY_POINTS[entry](tiny_model, [1] * 65)
    assert tiny_model.trace([1] * 64).logits.shape == (64, 128)


def test_a_configured_max_tokens_limits_text_prompts(tiny_model, monkeypatch):
    """model.max_tokens below the context (as the app sets it) refuses longer prompts and says why."""
    monkeypatch.setattr(tiny_model, "max_tokens", 4)
    with pytest.raises(PromptError, match=r"5 tokens; the limit is 4 \(the configured limit model.max_tokens\)"):
        tiny_model.trace("w1 w2 w3 w4 w5")
    assert len(tiny_model.trace("w1 w2 w3 w4").tokens) == 4


def test_max_tokens_above_the_context_does_not_lift_the_context_limit(tiny_model, monkeypatch):
    """Raising model.max_tokens past the checkpoint's context still refuses prompts beyond the context."""
    monkeypatch.setattr(tiny_model, "max_tokens", 1000)
    with pytest.raises(PromptError, match="context length"):
        tiny_model.trace([1] * 65)


@pytest.mark.slow
def test_the_real_model_applies_max_tokens_to_text(model, monkeypatch):
    """The limit counts tokens of the real tokenizer, not characters."""
    monkeypatch.setattr(model, "max_tokens", 8)
    with pytest.raises(PromptError, match="the limit is 8"):
        model.trace("one two three four five six seven eight nine ten")


def test_whitespace_that_tokenizes_to_nothing_is_a_prompt_error(tiny_model):
    """The tiny word-level tokenizer drops whitespace entirely; that is a PromptError, not an empty tensor
    in the model. (Byte-level tokenizers like SmolLM2's keep whitespace: see the odd-text test.)"""
    with pytest.raises(PromptError, match="produced no tokens"):
        tiny_model.trace(" \n\t ")


def test_a_string_with_an_unpaired_surrogate_is_a_prompt_error(tiny_model):
    """Python strings can hold lone surrogates (e.g. from a bad decode); tokenizers reject them with a TypeError."""
    with pytest.raises(PromptError, match="not valid Unicode"):
        tiny_model.trace("ok \ud800 ok")


def test_chat_mode_without_a_chat_template_is_a_prompt_error(tiny_model):
    """The tiny tokenizer has no chat template."""
    with pytest.raises(PromptError, match="chat template"):
        tiny_model.trace("w1", chat=True)


ODD_TEXTS = {
    "emoji": "😀 👩‍👩‍👧 🇫🇷",
    "control": "a\x00b\x01c\x07d\x1b[31m\x7f",
    "scripts": "日本語 العربية Здравствуйте हिन्दी עברית",
    "combining": "e\u0301 a\u0308\u0308\u0308 Z\u0351\u0352\u0353",
    "bidi_zero_width": "\u202eabc\u202c \u200b\u200d\ufeff",
    "long_word": "supercalifragilistic" * 20,
    "whitespace_only": " \t\n\r\n   ",
    "single_space": " ",
    "astral": "\U0010ffff\U0001f600",
}


@pytest.mark.slow
@pytest.mark.parametrize("text", list(ODD_TEXTS.values()), ids=list(ODD_TEXTS))
def test_odd_but_valid_text_runs_on_the_real_model(model, text):
    """Emoji, control characters, other scripts, combining marks, bidi/zero-width characters, a 400-character
    word and whitespace-only text all trace: one token label per id, the ids decode back to the text, and the
    logits are finite. Random text is covered by tests/test_properties.py."""
    t = model.trace(text)
    assert len(t.tokens) == t.input_ids.numel() > 0
    assert model.tokenizer.decode(t.input_ids) == text
    assert torch.isfinite(t.logits).all()


# --- variants ------------------------------------------------------------------------------------


def test_an_unknown_variant_name_lists_the_presets_and_suggests_one(tiny_model):
    """A typo in a preset name: ValueError with the closest preset and the full list."""
    with pytest.raises(ValueError, match="did you mean 'post_norm'") as err:
        tiny_model.trace("w1", variant="postnorm")
    assert all(name in str(err.value) for name in PRESETS)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"norm": "middle"}, r"Variant\.norm='middle' is not valid; choose one of \['pre', 'output', 'sandwich', "
                             r"'post', 'none'\] \(or None: the checkpoint's own\)"),
        ({"norm_type": "batch"}, r"Variant\.norm_type='batch'.*'rms', 'layer'"),
        ({"rope": "alibi"}, r"Variant\.rope='alibi'.*'rotate_half'"),
        ({"gqa": "random"}, r"Variant\.gqa='random'.*'grouped', 'tile'"),
        ({"mlp": "moe"}, r"Variant\.mlp='moe'.*'swiglu', 'standard'"),
        ({"causal": "yes"}, r"Variant\.causal must be True or False"),
        ({"kv_position_bug": 1}, r"Variant\.kv_position_bug must be True or False"),
        ({"rope_theta": 0}, r"Variant\.rope_theta must be a finite number > 1"),
        ({"rope_theta": -5.0}, r"Variant\.rope_theta"),
        ({"rope_theta": "big"}, r"Variant\.rope_theta"),
        ({"rope_theta": math.nan}, r"Variant\.rope_theta"),
        ({"rope_theta": math.inf}, r"Variant\.rope_theta"),
        ({"rope_theta": True}, r"Variant\.rope_theta"),
        ({"nrom": "pre"}, r"Unknown Variant field\(s\) \['nrom'\]; fields are: .*'norm'"),
    ],
)
def test_an_invalid_variant_field_names_the_field_and_the_choices(tiny_model, fields, match):
    """Each Variant field refuses a wrong value, whether given as a dict or to Variant() directly."""
    with pytest.raises(ValueError, match=match):
        tiny_model.trace("w1", variant=fields)
    if "nrom" not in fields:
        with pytest.raises(ValueError, match=match):
            slmviz.Variant(**fields)


def test_a_variant_of_the_wrong_type_is_a_type_error(tiny_model):
    """variant=3 says what is accepted."""
    with pytest.raises(TypeError, match="preset name, a Variant or a dict"):
        tiny_model.trace("w1", variant=3)


# --- hooks ---------------------------------------------------------------------------------------


def _keep(x, name):
    return None


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.trace("w1", hooks={"blocks.0.attn.hook_patern": _keep}),
        lambda m: m.trace("w1", names=["blocks.0.attn.hook_patern"]),
        lambda m: m.trace("w1", names="blocks.0.attn.hook_patern"),
        lambda m: m.trace("w1")["blocks.0.attn.hook_patern"],
        lambda m: m.generate("w1", 1, hooks={"blocks.0.attn.hook_patern": _keep}),
    ],
    ids=["hooks", "names", "name_str", "getitem", "generate"],
)
def test_an_unknown_hook_name_suggests_the_closest_valid_one(tiny_model, call):
    """HookNameError is both a KeyError (dict-style access keeps working) and a ValueError, and its str()
    is the readable message (a plain KeyError would quote it)."""
    with pytest.raises(HookNameError) as err:
        call(tiny_model)
    assert isinstance(err.value, KeyError) and isinstance(err.value, ValueError)
    message = str(err.value)
    assert message.startswith("Unknown hook name 'blocks.0.attn.hook_patern'")
    assert "did you mean 'blocks.0.attn.hook_pattern'" in message


def test_a_hook_name_in_a_layer_the_model_does_not_have_is_refused(tiny_model):
    """The tiny model has layers 0 and 1 only."""
    with pytest.raises(HookNameError, match="'blocks.2.hook_resid_pre'"):
        tiny_model.trace("w1", hooks={"blocks.2.hook_resid_pre": _keep})


def test_a_hook_name_that_is_not_a_string_is_refused(tiny_model):
    """hooks={0: fn} names the bad key instead of failing inside difflib."""
    with pytest.raises(HookNameError, match="strings"):
        tiny_model.trace("w1", hooks={0: _keep})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"hooks": [_keep]}, "hooks= takes a dict"),
        ({"hooks": {"hook_embed": 3}}, "must be callable"),
        ({"names": 5}, "names= takes None"),
    ],
)
def test_hooks_and_names_of_the_wrong_type_say_what_is_accepted(tiny_model, kwargs, match):
    """hooks= must be a dict of callables and names= a list, a name or a predicate."""
    with pytest.raises(TypeError, match=match):
        tiny_model.trace("w1", **kwargs)


@pytest.mark.parametrize(
    "fn, error, match",
    [
        (lambda x, n: x[:1], ValueError, r"returned shape \(1, 64\), expected \(2, 64\)"),
        (lambda x, n: x[..., None], ValueError, r"returned shape \(2, 64, 1\), expected \(2, 64\)"),
        (lambda x, n: x.double(), ValueError, "returned dtype torch.float64, expected torch.float32"),
        (lambda x, n: x.half(), ValueError, "returned dtype torch.float16"),
        (lambda x, n: x.tolist(), TypeError, "returned list"),
        (lambda x, n: 0.0, TypeError, "returned float"),
    ],
)
def test_a_hook_returning_the_wrong_shape_dtype_or_type_is_refused_by_name(tiny_model, fn, error, match):
    """A replacement must keep shape and dtype; the message names the hook and says what to return."""
    with pytest.raises(error, match=match) as err:
        tiny_model.trace("w1 w2", hooks={"blocks.1.hook_resid_mid": fn})
    assert "'blocks.1.hook_resid_mid'" in str(err.value)
    assert "return None to keep the value" in str(err.value)


@pytest.mark.parametrize("entry", ["trace", "generate"])
def test_a_hook_fn_that_raises_names_the_hook_and_keeps_the_original_error(tiny_model, entry):
    """The user's exception comes back as HookError naming the hook and the error; the original is __cause__."""

    def broken(x, name):
        raise IndexError("my bug")

    hooks = {"blocks.1.attn.hook_z": broken}
    with pytest.raises(HookError) as err:
        if entry == "trace":
            tiny_model.trace("w1 w2", hooks=hooks)
        else:
            tiny_model.generate("w1 w2", max_new_tokens=2, hooks=hooks)
    assert "'blocks.1.attn.hook_z'" in str(err.value) and "IndexError: my bug" in str(err.value)
    assert "broken" in str(err.value)
    assert err.value.hook_name == "blocks.1.attn.hook_z"
    assert isinstance(err.value.__cause__, IndexError)


def test_valid_hook_replacements_still_take_effect(tiny_model):
    """Control for the checks above: a same-shape, same-dtype replacement passes through the error-naming
    wrapper and changes the output; a hook returning None changes nothing; a list of fns all run."""
    seen = []
    base = tiny_model.trace("w1 w2 w3")
    kept = tiny_model.trace("w1 w2 w3", hooks={"blocks.0.hook_attn_out": [_keep, lambda x, n: seen.append(n)]})
    zeroed = tiny_model.trace("w1 w2 w3", hooks={"blocks.0.hook_attn_out": lambda x, n: torch.zeros_like(x)})
    assert torch.equal(kept.logits, base.logits)
    assert seen == ["blocks.0.hook_attn_out"]
    assert not torch.allclose(zeroed.logits, base.logits)
    assert torch.equal(zeroed["blocks.0.hook_attn_out"], torch.zeros(3, 64))
