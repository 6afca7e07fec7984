"""Files slmviz 0.2.0 saved (tests/data/v0_2, written by its make_fixtures.py with 0.2.0's code) load with the same
tensors, features and attribution graphs, and saving what was loaded writes the same bytes.

Checked against the files themselves: tensors read with safetensors alone (not through slmviz), features by SAELens's
formula written out here from those tensors, and the graph JSONs 0.2.0 saved (nodes, activations, influences, links,
pins, supernodes, labels). Not covered here: the training checkpoints (cut_*/, */checkpoint.safetensors: the training
tests resume them), the saved Trace and Scan (their own tests), peers reading the files (bench/).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import slmviz
from slmviz.replacement.load import load_transcoders

DATA = Path(__file__).parent / "data" / "v0_2"
PROMPT = [1, 7, 12, 3, 44, 9, 101, 23]  # make_fixtures.PROMPT: the graphs' prompt


@pytest.fixture(scope="module")
def tiny():
    return slmviz.load(DATA / "tiny_llama")


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def saelens_features(x: torch.Tensor, raw: dict[str, torch.Tensor], cfg: dict) -> torch.Tensor:
    """SAELens 6's encode, from a cfg.json and its tensors: relu(topk) or JumpReLU, b_dec subtracted if asked."""
    if cfg["apply_b_dec_to_input"]:
        x = x - raw["b_dec"]
    h = x @ raw["W_enc"] + raw["b_enc"]
    if cfg["architecture"] == "topk":
        values, idx = h.topk(cfg["k"], dim=-1)
        return torch.zeros_like(h).scatter(-1, idx, values.relu())
    return h.relu() * (h > raw["threshold"])


@pytest.mark.parametrize("name", ["sae", "transcoder"])
def test_an_sae_folder_loads_its_tensors_and_computes_saelens_features(tiny, name):
    folder = DATA / name
    raw = load_file(str(folder / "sae_weights.safetensors"))
    cfg = json.loads((folder / "cfg.json").read_text())
    sae = slmviz.load_sae(folder, model=tiny)
    assert_same(sae.tensors(), raw)
    assert (sae.hook_name, sae.hook_name_out) == (cfg["metadata"]["hook_name"], cfg["metadata"]["hook_name_out"])
    t = tiny.trace(PROMPT, saes=[sae])
    f = t[f"{sae.hook_name_out}.hook_sae_acts_post"]
    torch.testing.assert_close(f, saelens_features(t[sae.hook_name], raw, cfg), rtol=0, atol=1e-6)
    assert (f > 0).any()


def test_the_plt_loads_alike_from_slmviz_and_circuit_tracer_layouts(tiny):
    ours, theirs = load_transcoders(DATA / "plt", model=tiny), load_transcoders(DATA / "plt_circuit_tracer", model=tiny)
    assert ours.kind == theirs.kind == "plt" and ours.layers == theirs.layers == [0, 1]
    for L in ours.layers:
        assert_same(ours.coder(L).tensors(), load_file(str(DATA / "plt" / f"layer_{L}" / "sae_weights.safetensors")))
        raw = load_file(str(DATA / "plt_circuit_tracer" / f"layer_{L}.safetensors"))
        renamed = {"W_enc": raw["W_enc"].T, "W_dec": raw["W_dec"], "b_enc": raw["b_enc"], "b_dec": raw["b_dec"],
                   "threshold": raw["activation_function.threshold"], "W_skip": raw["W_skip"]}
        assert_same(theirs.coder(L).tensors(), renamed)
        assert_same(theirs.coder(L).tensors(), ours.coder(L).tensors())


def test_the_clts_load_their_tensors_from_both_layouts(tiny):
    gs = load_transcoders(DATA / "clt", model=tiny)
    n = tiny.cfg.n_layers
    raw = [load_file(str(DATA / "clt" / f"params_layer_{L}.safetensors")) for L in range(n)]
    assert gs.kind == "clt" and gs.input_hook == "mlp.hook_in" and gs.W_skip is not None
    assert_same(gs.tensors(), {
        "W_enc": torch.stack([r["w_enc"] for r in raw]), "b_enc": torch.stack([r["b_enc"] for r in raw]),
        "b_dec": torch.stack([r["b_dec"] for r in raw]), "threshold": torch.stack([r["threshold"] for r in raw]),
        "W_skip": torch.stack([r["affine_skip_connection"].T for r in raw]),
        **{f"W_dec_{L}": raw[L]["w_dec"][:, L:] for L in range(n)}})
    plain, ct = load_transcoders(DATA / "clt_plain", model=tiny), load_transcoders(DATA / "clt_circuit_tracer",
                                                                                    model=tiny)
    enc = [load_file(str(DATA / "clt_plain" / f"W_enc_{L}.safetensors")) for L in range(n)]
    assert_same(plain.tensors(), {
        "W_enc": torch.stack([e[f"W_enc_{L}"].T for L, e in enumerate(enc)]),
        "b_enc": torch.stack([e[f"b_enc_{L}"] for L, e in enumerate(enc)]),
        "b_dec": torch.stack([e[f"b_dec_{L}"] for L, e in enumerate(enc)]),
        "threshold": torch.stack([e[f"threshold_{L}"] for L, e in enumerate(enc)]),
        **{f"W_dec_{L}": load_file(str(DATA / "clt_plain" / f"W_dec_{L}.safetensors"))[f"W_dec_{L}"]
           for L in range(n)}})
    assert_same(ct.tensors(), plain.tensors())
    assert (plain.name, plain.W_skip, plain.input_hook) == ("tiny_llama-clt", None, "mlp.hook_in")


def test_a_gemma_scope_clt_keeps_its_name(tiny, tmp_path):
    """A CLT saved in Gemma Scope 2's layout loads under its own name (config.json's slmviz_name), with no checkpoint
    beside it; a folder that names nothing (another writer's, a checkpoint unfinished or absent) takes its folder's."""
    clt = load_transcoders(DATA / "clt", model=tiny)
    clt.name = "renamed"
    clt.save(tmp_path / "copy", format="gemma-scope-2")
    assert load_transcoders(tmp_path / "copy", model=tiny).name == "renamed"
    config = json.loads((tmp_path / "copy" / "config.json").read_text())
    del config["slmviz_name"]
    (tmp_path / "copy" / "config.json").write_text(json.dumps(config))
    assert load_transcoders(tmp_path / "copy", model=tiny).name == "copy"


@pytest.mark.parametrize("folder,graph", [("plt", "graph.json"), ("clt", "graph_clt.json")])
def test_the_saved_sets_give_the_saved_graphs_and_their_workbench_state(tiny, folder, graph):
    """The attribution graph of make_fixtures' prompt over each saved set: the nodes (ids, activations, influence)
    and links 0.2.0 saved, to fp32 rounding; load_json takes back its pins, supernodes and hand-written label.

    The sets load under the names the graphs record, which load_json checks: 0.2.0's Gemma Scope 2 layout (clt/)
    keeps no name in its config.json, and the CLT takes it from the finished run's checkpoint beside it
    (gemma_scope.clt_name)."""
    ts = load_transcoders(DATA / folder, model=tiny)
    saved = json.loads((DATA / graph).read_text())
    if folder == "clt":
        assert saved["metadata"]["transcoder_list"] == [ts.name] == ["tiny_llama-clt"]
    g = slmviz.attribution_graph(PROMPT, transcoders=ts, model=tiny, progress=False)
    new = g.to_json(slug=Path(graph).stem)
    assert new["metadata"] == saved["metadata"]
    nodes = {n["node_id"]: n for n in new["nodes"]}
    assert list(nodes) == [n["node_id"] for n in saved["nodes"]]
    for old in saved["nodes"]:
        n = nodes[old["node_id"]]
        assert {k: v for k, v in n.items() if k not in ("activation", "influence", "clerp")} == {
            k: v for k, v in old.items() if k not in ("activation", "influence", "clerp")}
        for k in ("activation", "influence"):  # None where a node has none (an error node's activation)
            assert n[k] == (old[k] if old[k] is None else pytest.approx(old[k], rel=1e-5, abs=1e-7)), (n, k)
    assert [(x["source"], x["target"]) for x in new["links"]] == [(x["source"], x["target"]) for x in saved["links"]]
    for x, old in zip(new["links"], saved["links"], strict=True):
        assert x["weight"] == pytest.approx(old["weight"], rel=1e-5, abs=1e-7), (old["source"], old["target"])
    g.load_json(DATA / graph)
    again, pins = g.to_json()["qParams"], saved["qParams"]["pinnedIds"]
    assert again["pinnedIds"] == pins and len(pins) == 4
    assert again["supernodes"] == saved["qParams"]["supernodes"] == [["pair", *pins[:2]]]
    labels = {n["node_id"]: n["clerp"] for n in saved["nodes"] if n["clerp"] == "a hand-written label"}
    assert len(labels) == 1 and all(g.label(node) == text for node, text in labels.items())


@pytest.mark.parametrize("folder,same", [
    ("sae", ["cfg.json", "sae_weights.safetensors"]),
    ("transcoder", ["cfg.json", "sae_weights.safetensors"]),
    ("plt", [f"layer_{L}/{f}" for L in (0, 1) for f in ("cfg.json", "sae_weights.safetensors")]),
    ("plt_circuit_tracer", ["config.yaml", "layer_0.safetensors", "layer_1.safetensors"]),
    ("clt", ["config.json", "params_layer_0.safetensors", "params_layer_1.safetensors"]),
    ("clt_circuit_tracer", [f"W_{w}_{L}.safetensors" for w in ("enc", "dec") for L in (0, 1)]),
])
def test_saving_what_was_loaded_writes_the_same_bytes(tiny, tmp_path, folder, same):
    """Each object saved again in the layout it came from: its weight files and the configs that record no provenance
    are byte for byte 0.2.0's. (A loaded set's transcoder_set.json and a CLT's config.yaml also record the folder it
    was read from.)"""
    path = DATA / folder
    if folder in ("sae", "transcoder"):
        slmviz.load_sae(path).save(tmp_path)
    else:
        fmt = {"plt": "slmviz", "plt_circuit_tracer": "circuit-tracer", "clt": "gemma-scope-2",
               "clt_circuit_tracer": "circuit-tracer"}[folder]
        load_transcoders(path, model=tiny).save(tmp_path, format=fmt)
    for name in same:
        if folder == "clt" and name == "config.json":  # 0.2.0's, plus the name it kept only in its checkpoint
            assert json.loads((tmp_path / name).read_text()) == {**json.loads((path / name).read_text()),
                                                                  "slmviz_name": "tiny_llama-clt"}
            continue
        assert (tmp_path / name).read_bytes() == (path / name).read_bytes(), name
