"""Model folders without a tokenizer (toy models trained on algorithmic tasks), `tokenizer=` and `device=`.

A tiny LlamaConfig checkpoint saved by transformers' own save_pretrained, with no tokenizer file at all:
it loads, traces and generates from token ids (shown as "<17>"), refuses text with a message naming
the fix, and takes a tokenizer from elsewhere. Does not cover a hub id for `tokenizer=` (no network
here) nor a real GPU (the CUDA test is skipped without one).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import slmviz
from slmviz.model_api import params_to

IDS = [5, 17, 3, 99, 42, 8]


@pytest.fixture(scope="module")
def bare_dir(tmp_path_factory) -> Path:
    """config.json + model.safetensors (+ generation_config.json) and nothing else."""
    import transformers

    folder = tmp_path_factory.mktemp("bare")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    assert not any(f.name.startswith(("tokenizer", "vocab", "special_tokens")) for f in folder.iterdir())
    return folder


@pytest.fixture(scope="module")
def bare(bare_dir) -> slmviz.Model:
    return slmviz.load(bare_dir)


def test_a_folder_without_tokenizer_files_loads_with_no_tokenizer(bare):
    assert bare.tokenizer is None
    assert bare.device == torch.device("cpu")


def test_it_traces_from_token_ids_and_shows_ids_as_tokens(bare):
    t = bare.trace(IDS)
    assert t.tokens == [f"<{i}>" for i in IDS]
    assert t.logits.shape == (len(IDS), 128)
    assert t["blocks.1.attn.hook_pattern"].shape == (4, len(IDS), len(IDS))
    assert bare.trace(torch.tensor(IDS)).logits.equal(t.logits)


def test_its_logits_equal_transformers_on_the_same_ids(bare_dir, bare):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(bare_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    assert (bare.trace(IDS).logits - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_next_token_tables_show_ids_without_a_tokenizer(bare):
    top = bare.trace(IDS).top_tokens(k=3)
    assert top["token"].tolist() == [f"<{i}>" for i in top["token_id"]]


@pytest.mark.parametrize("text", ["hello", "", "The capital of France is"])
def test_text_is_refused_with_a_message_naming_token_ids_and_the_tokenizer_argument(bare, text):
    with pytest.raises(slmviz.PromptError, match="no tokenizer") as err:
        bare.trace(text)
    assert "token ids" in str(err.value) and "tokenizer=" in str(err.value)
    with pytest.raises(slmviz.PromptError, match="no tokenizer"):
        bare.generate(text, 4)


def test_generate_from_ids_returns_ids_and_id_text_like_transformers_greedy(bare_dir, bare):
    """No tokenizer means no EOS to stop at: it decodes all max_new_tokens (transformers told the same)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(bare_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([IDS]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(IDS):].tolist()
    ids = bare.generate_ids(IDS, 8)
    assert ids == ref
    assert bare.generate(IDS, 8) == "".join(f"<{i}>" for i in ids)
    steps = list(bare.stream(IDS, 3))
    assert [s.token for s in steps] == [f"<{i}>" for i in ids[:3]]


def test_a_tokenizer_from_another_folder_makes_text_work(bare_dir, tiny_dir):
    """The conftest tiny model's word-level tokenizer (ids w0..w126) read from its folder by path."""
    m = slmviz.load(bare_dir, tokenizer=tiny_dir)
    t = m.trace("w5 w7 w3")
    assert t.input_ids.tolist() == [5, 7, 3] and t.tokens == ["w5", "w7", "w3"]
    assert m.generate("w5 w7", 3)  # decoded by the supplied tokenizer
    assert m.trace([5, 7, 3]).logits.equal(t.logits)


def test_a_tokenizer_object_is_used_as_given(bare_dir, tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    m = slmviz.load(str(bare_dir), tokenizer=tok)
    assert m.tokenizer is tok and m.trace("w9").tokens == ["w9"]


@pytest.mark.parametrize("bad, error", [(42, TypeError), ({"a": 1}, TypeError),
                                        ("./no/such/folder", FileNotFoundError)])
def test_a_bad_tokenizer_argument_is_a_clear_error(bare_dir, bad, error):
    with pytest.raises(error, match="tokenizer"):
        slmviz.load(bare_dir, tokenizer=bad)


def test_a_folder_tokenizer_argument_without_tokenizer_files_says_so(bare_dir):
    with pytest.raises(slmviz.WeightsError, match="no tokenizer files"):
        slmviz.load(bare_dir, tokenizer=bare_dir)


def test_the_device_argument_is_checked_and_recorded(bare_dir):
    assert slmviz.load(bare_dir, device=torch.device("cpu")).device == torch.device("cpu")
    with pytest.raises(ValueError, match="device"):
        slmviz.load(bare_dir, device="gpu-please")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            slmviz.load(bare_dir, device="cuda")


def test_moving_params_moves_every_tensor_and_keeps_tied_embeddings_one_tensor(tiny_dirs):
    """The meta device stands in for a GPU: every tensor moves, and a tied unembed stays the embed."""
    from dataclasses import fields

    from slmviz.model_api import load_folder

    params = load_folder(tiny_dirs["llama_mqa_tied"]).decoder.params
    moved = params_to(params, torch.device("meta"))
    assert moved.unembed is moved.embed
    tensors = [getattr(moved, f.name) for f in fields(moved) if isinstance(getattr(moved, f.name), torch.Tensor)]
    tensors += [getattr(layer, f.name) for layer in moved.layers for f in fields(layer)
                if isinstance(getattr(layer, f.name), torch.Tensor)]
    assert tensors and all(t.device.type == "meta" for t in tensors)
    assert params.embed.device.type == "cpu"  # the original is untouched
    assert params_to(params, torch.device("cpu")).embed is params.embed  # no copy on the same device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_a_model_loads_and_traces_on_cuda(bare_dir, bare):
    m = slmviz.load(bare_dir, device="cuda")
    assert m.device.type == "cuda" and m.decoder.params.embed.device.type == "cuda"
    assert torch.allclose(m.trace(IDS).logits.cpu(), bare.trace(IDS).logits, atol=1e-4)
