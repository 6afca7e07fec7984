"""Safety of loading: safetensors only, no pickle, no remote code, no eval/exec, hub ids validated.

A public Space passes user-typed model ids to slmviz, so nothing a model folder or an id contains may
run code on the server or reach outside the hub. The source scan is static (ast) over slmviz/ and app/;
the loading tests plant pickle payloads and remote-code files that create a marker file if they ever run.
"""

from __future__ import annotations

import ast
import json
import pickle
import shutil
from pathlib import Path

import pytest

import slmviz
from slmviz import model_api
from slmviz.config import UnsupportedModelError
from slmviz.loading.weights import WeightsError

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("slmviz", "app")
PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
# Keyword arguments that switch a loader into an unsafe mode: (name, the only value allowed if given).
SAFE_KEYWORDS = {"trust_remote_code": False, "allow_pickle": False, "weights_only": True, "use_safetensors": True}


def unsafe_uses(source: str, filename: str = "<source>") -> list[str]:
    """Every unsafe construct in `source`: torch.load (by any alias, called or passed around), any import of a
    pickle-family module, bare or builtins eval/exec/__import__, and unsafe loader keywords (trust_remote_code=
    anything but a literal False, allow_pickle=True, weights_only=False, use_safetensors=False)."""
    tree = ast.parse(source, filename)
    torch_names = set()
    found: list[str] = []

    def flag(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PICKLE_MODULES:
                    flag(node, f"import {alias.name}")
                if alias.name == "torch":
                    torch_names.add(alias.asname or "torch")
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.split(".")[0] in PICKLE_MODULES:
                flag(node, f"from {module} import ...")
            if module in ("torch", "torch.serialization") and any(a.name == "load" for a in node.names):
                flag(node, f"from {module} import load")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in torch_names
                and node.attr in ("load", "serialization")):
            flag(node, f"torch.{node.attr}")
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("eval", "exec", "__import__"):
            flag(node, f"{func.id}(...)")
        if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "builtins"
                and func.attr in ("eval", "exec", "__import__")):
            flag(node, f"builtins.{func.attr}(...)")
        for kw in node.keywords:
            if kw.arg in SAFE_KEYWORDS:
                allowed = SAFE_KEYWORDS[kw.arg]
                if not (isinstance(kw.value, ast.Constant) and kw.value.value is allowed):
                    flag(node, f"{kw.arg}={ast.unparse(kw.value)}")
    return found


def _package_sources() -> list[Path]:
    return sorted(p for d in SCANNED if (ROOT / d).is_dir() for p in (ROOT / d).rglob("*.py"))


def test_the_package_source_has_no_pickle_torch_load_remote_code_or_eval():
    """Static scan of every .py file under slmviz/ and app/ with unsafe_uses.
    Does not cover dependencies (transformers, tokenizers) or code built at run time from strings."""
    files = _package_sources()
    assert ROOT / "slmviz" / "loading" / "weights.py" in files  # the scan really covers the package
    problems = [p for f in files for p in unsafe_uses(f.read_text(encoding="utf-8"), str(f.relative_to(ROOT)))]
    assert problems == []


@pytest.mark.parametrize(
    "snippet",
    [
        "import torch\nsd = torch.load('x.bin')",
        "import torch as t\nsd = t.load(path, weights_only=True)",
        "from torch import load\n",
        "import torch\nloader = torch.load",
        "import torch\ntorch.serialization.load('x')",
        "import pickle\n",
        "import pickle as p\n",
        "from pickle import loads\n",
        "import _pickle\n",
        "import joblib\n",
        "eval('1 + 1')",
        "exec('x = 1')",
        "import builtins\nbuiltins.exec('x = 1')",
        "__import__('pickle')",
        "AutoModel.from_pretrained(p, trust_remote_code=True)",
        "AutoConfig.from_pretrained(p, trust_remote_code=flag)",
        "np.load(p, allow_pickle=True)",
        "m.load_state_dict(sd, weights_only=False)",
        "AutoModel.from_pretrained(p, use_safetensors=False)",
    ],
)
def test_the_scanner_catches_each_forbidden_construct(snippet):
    """The scan can fail: each planted construct is reported."""
    assert unsafe_uses(snippet) != []


@pytest.mark.parametrize(
    "snippet",
    [
        "AutoConfig.from_pretrained(p, trust_remote_code=False)",
        "model.eval()",
        "df.eval('a + b')",
        "import json\njson.loads(s)",
        "from safetensors.torch import load_file\nload_file(p)",
        "import torch\ntorch.tensor([1])",
        "state = loader.load(x)",
    ],
)
def test_the_scanner_allows_safe_lookalikes(snippet):
    """No false alarms on names that only look similar (model.eval(), DataFrame.eval, json.loads, ...)."""
    assert unsafe_uses(snippet) == []


# --- pickle and remote code in a model folder ------------------------------------------------------


class _Payload:
    """Unpickling this creates `marker`: proof that something unpickled the file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _plant_pickle(folder: Path, name: str, marker: Path) -> None:
    payload = pickle.dumps({"model.embed_tokens.weight": _Payload(marker)})
    pickle.loads(payload)  # the payload works: loading it anywhere would leave the marker
    assert marker.exists()
    marker.unlink()
    (folder / name).write_bytes(payload)


@pytest.fixture
def model_copy(tiny_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_dir, folder)
    return folder


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.pth"])
def test_a_folder_with_only_pickle_weights_is_refused_without_unpickling(model_copy, tmp_path, name):
    """Only a pickle checkpoint: WeightsError explaining that slmviz loads safetensors only and how to
    convert; the planted payload never runs."""
    marker = tmp_path / "unpickled"
    (model_copy / "model.safetensors").unlink()
    _plant_pickle(model_copy, name, marker)
    with pytest.raises(WeightsError, match="only pickle weights") as err:
        slmviz.load(model_copy)
    assert "safetensors" in str(err.value) and "safe_serialization=True" in str(err.value)
    assert not marker.exists()


def test_pickle_weights_next_to_safetensors_are_ignored(model_copy, tmp_path, monkeypatch):
    """Both formats present: the safetensors weights load, and neither the payload nor torch.load /
    pickle.load(s) is ever called anywhere in the load path (config, weights, tokenizer)."""
    import torch

    marker = tmp_path / "unpickled"
    _plant_pickle(model_copy, "pytorch_model.bin", marker)

    def refuse(*args, **kwargs):
        raise AssertionError("unpickling was attempted")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    m = slmviz.load(model_copy)
    assert m.trace([1, 2]).logits.shape == (2, 128)
    assert not marker.exists()


@pytest.mark.parametrize("model_type", ["llama", "evil_custom"])
def test_remote_code_named_by_a_model_folder_never_runs(model_copy, tmp_path, model_type):
    """config.json and tokenizer_config.json point auto_map at a .py file in the folder that creates a
    marker on import. With a supported model_type the folder loads with built-in classes; with a custom one
    it is UnsupportedModelError. Either way the file never runs (trust_remote_code stays False)."""
    marker = tmp_path / "remote_code_ran"
    (model_copy / "evil.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).touch()\n"
        "from transformers import LlamaConfig, PreTrainedTokenizerFast\n"
        "class EvilConfig(LlamaConfig):\n    model_type = 'evil_custom'\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    config = json.loads((model_copy / "config.json").read_text())
    config.update(model_type=model_type, auto_map={"AutoConfig": "evil.EvilConfig"})
    (model_copy / "config.json").write_text(json.dumps(config))
    tok_config = json.loads((model_copy / "tokenizer_config.json").read_text())
    tok_config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]}
    (model_copy / "tokenizer_config.json").write_text(json.dumps(tok_config))
    if model_type == "llama":
        assert slmviz.load(model_copy).cfg.model_type == "llama"
    else:
        with pytest.raises(UnsupportedModelError, match="evil_custom"):
            slmviz.load(model_copy)
    assert not marker.exists()


# --- hub ids -------------------------------------------------------------------------------------

BAD_HUB_IDS = [
    "../x", "../../etc/passwd", "a/b/c", "owner/name;rm", "owner/name;rm -rf ~", "owner/..", "../owner",
    "owner/.", "owner/name\n", "owner/name ", " owner/name", "owner/na me", "owner//name", "/owner/name",
    "owner/", "/name", "owner", "owner/-name", "owner/name-", "owner/.name", "owner/a..b", "owner/a--b",
    "ówner/name", "owner/name%2F..", "owner/name$(id)", "owner/name`id`", "owner/name|cat",
    "https://huggingface.co/owner/name", "hf://owner/name", "owner/name@main", "~/owner", "C:\\owner\\name",
    "o/" + "n" * 97,
]


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """Run from an empty folder (so no relative path exists) with the hub client wired to fail the test."""
    import huggingface_hub

    def fail(*args, **kwargs):
        raise AssertionError(f"snapshot_download was called with {args} {kwargs}")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)


@pytest.mark.parametrize("hub_id", BAD_HUB_IDS)
def test_a_malformed_hub_id_is_refused_before_any_network_call(no_network, hub_id):
    """Path-traversal, shell-like, URL-like, too-long or otherwise malformed ids never reach the hub client:
    load() says there is no such folder and it is not a hub id; download_from_hub() says the id is invalid."""
    assert not model_api.HUB_ID_PATTERN.match(hub_id)
    with pytest.raises(FileNotFoundError, match="not a hub id"):
        slmviz.load(hub_id)
    with pytest.raises(ValueError, match="not a valid hub id"):
        model_api.download_from_hub(hub_id)


@pytest.mark.parametrize(
    "hub_id", ["HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen2.5-0.5B", "google/gemma-3-270m", "a/b", "o_/n_1.x"]
)
def test_well_formed_hub_ids_are_accepted(hub_id):
    """Control for the refusals: real ids match the pattern."""
    assert model_api.HUB_ID_PATTERN.match(hub_id)


def test_a_valid_hub_id_downloads_only_safetensors_config_and_tokenizer(tiny_dir, monkeypatch, tmp_path):
    """A valid id reaches snapshot_download exactly once, and its allow/ignore patterns (applied the way
    the hub client applies them) keep config, safetensors and tokenizer files and drop every pickle
    format and every .py file. The downloaded folder (here the tiny checkpoint) loads under the id's name."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(tiny_dir)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    m = slmviz.load("someone/tiny-llama")
    assert m.name == "someone/tiny-llama" and m.cfg.model_type == "llama"
    assert len(calls) == 1 and calls[0][0] == "someone/tiny-llama"
    repo_files = [
        "config.json", "generation_config.json", "model.safetensors", "model-00001-of-00002.safetensors",
        "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
        "special_tokens_map.json", "chat_template.jinja", "pytorch_model.bin", "pytorch_model-00001-of-00002.bin",
        "model.pt", "model.pth", "tokenizer.bin", "tokenizer.pkl", "tokenizer.pickle", "training_args.bin",
        "modeling_evil.py", "tokenizer_evil.py", "optimizer.pt", "rng_state.pth", "model.ckpt",
    ]
    kept = set(filter_repo_objects(
        repo_files, allow_patterns=calls[0][1]["allow_patterns"], ignore_patterns=calls[0][1].get("ignore_patterns"),
    ))
    assert kept == {
        "config.json", "generation_config.json", "model.safetensors", "model-00001-of-00002.safetensors",
        "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
        "special_tokens_map.json", "chat_template.jinja",
    }


def test_an_existing_local_folder_is_preferred_over_the_hub(tiny_dir, no_network, tmp_path):
    """A folder that exists at an owner/name-shaped relative path loads from disk without a download."""
    shutil.copytree(tiny_dir, tmp_path / "someone" / "tiny")
    assert slmviz.load("someone/tiny").cfg.model_type == "llama"
