"""graphs.summary: a pruned graph's features grouped, the group edges, and each group checked by turning it off.

Checked against references that share no code with the summary: the graph's own `links` frame summed with pandas
(group edges), graphs.intervene's constrained and free runs, themselves pinned against the graph's linear model
and a hand-written hook in tests/test_workbench.py (checks), and a distance matrix with blocks known in advance
(clustering). Tiny random models of two families (llama with GQA, gemma3)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

import slmviz
from slmviz.features.sae import SAE
from slmviz.graphs.attribution import attribution_graph
from slmviz.graphs.intervene import intervene
from slmviz.graphs.summary import COVER, METHODS, SummaryError, cluster, clustered_features, removal_effects

PROMPT = "w3 w5 w7 w9 w11 w4"
FAMILIES = ["llama_gqa", "gemma3"]


def transcoder(model, layer: int, seed: int = 0) -> SAE:
    d = model.cfg.d_model
    return SAE.random(d, d, seed=seed, architecture="relu", scale=0.1,
                      hook_name=f"blocks.{layer}.mlp.hook_in", hook_name_out=f"blocks.{layer}.hook_mlp_out")


@pytest.fixture(scope="module")
def graphs(tiny_dirs):
    out = {}
    for arch in FAMILIES:
        m = slmviz.load(tiny_dirs[arch])
        tcs = [transcoder(m, L, seed=L) for L in range(m.cfg.n_layers)]
        g = attribution_graph(PROMPT, transcoders=tcs, model=m, batch_size=64, progress=False)
        out[arch] = g.prune(0.9, 0.98)
    return out


def fresh(g):
    g.clear_pins()
    g.workbench.dismissed.clear()
    g.workbench.summary = None
    return g


@pytest.mark.parametrize("arch", FAMILIES)
def test_groups_partition_the_clustered_features_and_hold_their_influence(graphs, arch):
    g = fresh(graphs[arch])
    s = g.summarize(max_groups=3, apply=False)
    feats = s.groups[s.groups.kind == "features"]
    assert 1 <= len(feats) <= 3
    members = [m for ms in feats.members for m in ms]
    assert len(members) == len(set(members))
    kept = g.kept_nodes
    kept_features = set(kept.loc[kept.kind == "feature", "node_id"])
    assert set(members) <= kept_features
    # every kind's group holds nodes of that kind only (by row: ids collide), and every kept node not a feature is
    # in one
    want = {"features": "feature", "embedding": "embedding", "error": "error", "logit": "logit"}
    rows = s.groups.attrs["rows"]
    for r, at in zip(s.groups.itertuples(), rows, strict=True):
        assert set(g.nodes.kind.to_numpy()[at]) == {want[r.kind]}
        assert list(g.nodes.node_id.to_numpy()[at]) == list(r.members)
        assert r.layers == sorted({int(x) for x in g.nodes.layer.to_numpy()[at]})
        assert g.node_mask.numpy()[at].all()
    others = sorted(int(i) for r, at in zip(s.groups.itertuples(), rows, strict=True) if r.kind != "features"
                    for i in at)
    assert others == np.nonzero(g.node_mask.numpy() & (g.nodes.kind.to_numpy() != "feature"))[0].tolist()
    # coverage: the grouped features' share of the kept features' influence, as node_influence gives it
    from slmviz.graphs.derived import node_influence

    infl = node_influence(g).double().numpy()
    grouped = [int(i) for r, at in zip(s.groups.itertuples(), rows, strict=True) if r.kind == "features" for i in at]
    features = np.nonzero(g.node_mask.numpy() & (g.nodes.kind.to_numpy() == "feature"))[0]
    share = infl[grouped].sum() / infl[features].sum()
    assert s.coverage == pytest.approx(share, rel=1e-9)
    assert s.coverage >= COVER - 1e-9 or len(members) == len(kept_features)
    assert len(set(s.groups.name)) == len(s.groups)


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("method", METHODS)
def test_group_edges_are_the_sums_of_their_member_edges(graphs, arch, method):
    g = fresh(graphs[arch])
    s = g.summarize(max_groups=4, method=method, apply=False)
    # the reference: every kept edge, one at a time, from the adjacency and the prune masks (rows, as ids collide)
    group_of = {int(i): r.name for r, at in zip(s.groups.itertuples(), s.groups.attrs["rows"], strict=True)
                for i in at}
    keep = g.edge_mask & g.node_mask[:, None] & g.node_mask[None, :]
    sums: dict[tuple[str, str], float] = {}
    for t, src in torch.nonzero(keep).tolist():
        if src in group_of and t in group_of and group_of[src] != group_of[t]:
            key = (group_of[src], group_of[t])
            sums[key] = sums.get(key, 0.0) + float(g.adjacency[t, src])
    got = {(r.source, r.target): r.weight for r in s.edges.itertuples()}
    assert set(got) == {k for k, v in sums.items() if v != 0}
    for k, v in sums.items():
        assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("arch", FAMILIES)
def test_predicted_is_a_constrained_intervention_and_measured_a_free_run(graphs, arch):
    g = fresh(graphs[arch])
    s = g.summarize(max_groups=3, apply=False)
    checks = s.check()
    t = checks.attrs["target"]
    model = g.model
    assert t == int(model.logits(torch.tensor(g.input_ids))[-1].argmax())
    assert checks.attrs["target_token"] == model.to_strings([t])[0]
    feats = s.groups[s.groups.kind == "features"]
    assert list(checks.name) == list(feats.name)
    for r, c in zip(feats.itertuples(), checks.itertuples(), strict=True):
        values = {m: 0.0 for m in r.members}
        con = intervene(g, values, constrained=True)
        free = intervene(g, values, constrained=False)
        for r_, got in ((con, c.predicted), (free, c.measured)):  # the demeaned logit: the graph's target
            delta = (r_.logits - r_.original).double()
            assert got == pytest.approx(float(delta[t] - delta.mean()), abs=1e-5)
        p_new, p_old = (torch.softmax(x.double(), -1)[t] for x in (free.logits, free.original))
        assert c.measured_prob == pytest.approx(float(p_new - p_old), abs=1e-6)
        assert c.agree == (np.sign(c.predicted) == np.sign(c.measured))
    # a named target: an id, or the same token as a string
    other = int(g.nodes.loc[g.nodes.kind == "logit", "feature"].iloc[-1])
    assert s.check(target=other).attrs["target"] == other


@pytest.mark.parametrize("arch", FAMILIES)
def test_removal_effects_are_the_constrained_intervention_of_one_feature(graphs, arch):
    # the signed method keeps features that help the target apart from those that hurt it, by this linear model:
    # it must be what the graph predicts, a constrained run with the feature at 0 (while nothing crosses a threshold)
    g = fresh(graphs[arch]).prune(1.0, 1.0)  # every edge kept: the constrained run has every path
    effects = removal_effects(g)
    nodes = g.nodes
    t = int(nodes.loc[nodes.kind == "logit", "feature"].iloc[0])
    rows = np.nonzero((nodes.kind == "feature").to_numpy() & g.node_mask.numpy())[0]
    compared = 0
    for row in rows[np.argsort(-np.abs(effects[rows]))][:12]:
        with warnings.catch_warnings():  # ThresholdCrossed: such a feature is skipped below
            warnings.simplefilter("ignore")
            r = intervene(g, {nodes.node_id.iat[row]: 0.0}, constrained=True)
        if r.crossed:
            continue
        delta = (r.logits - r.original).double()
        assert effects[row] == pytest.approx(float(delta[t] - delta.mean()), rel=1e-4, abs=1e-5)
        compared += 1
    assert compared >= 3
    assert np.all(effects[(nodes.kind == "logit").to_numpy()][1:] == 0)  # nothing is downstream of a logit


def test_bad_input_gets_a_clear_error(graphs):
    g = fresh(graphs["llama_gqa"])
    for bad in (0, -1, 2.5, True):
        with pytest.raises(SummaryError, match="max_groups"):
            g.summarize(max_groups=bad)
    s = g.summarize(max_groups=2, apply=False)
    vocab = g.model.decoder.params.unembed.shape[0]
    for bad in (vocab, -1, "w3 w5"):
        with pytest.raises(SummaryError, match="token"):
            s.check(target=bad)


def test_a_graph_that_keeps_no_feature_says_so_and_still_summarizes(graphs):
    g = graphs["gemma3"]
    empty = g.prune(0.9, 0.98)
    kinds = empty.nodes.kind.to_numpy()
    empty.node_mask = empty.node_mask & torch.as_tensor(kinds != "feature")
    s = empty.summarize(apply=False)
    assert (s.groups.kind != "features").all() and len(s.groups)
    assert "keeps no feature" in s.note and s.coverage == 0.0


def test_clusters_recover_blocks_known_in_advance():
    rng = np.random.default_rng(0)
    truth = [0, 0, 1, 2, 1, 0, 2, 2, 1]
    n = len(truth)
    d = np.array([[0.1 if truth[i] == truth[j] else 0.9 for j in range(n)] for i in range(n)])
    d += rng.uniform(0, 0.05, size=(n, n))
    d = (d + d.T) / 2
    np.fill_diagonal(d, 0)
    got = cluster(d, 3)
    assert sorted(map(list, got)) == sorted([[i for i in range(n) if truth[i] == c] for c in range(3)])
    assert len(cluster(d, 20)) == n  # never more clusters than points
    assert clustered_features(np.array([4, 5, 6]), np.array([0, 0, 0, 0, 5.0, 3.0, 2.0]), cover=0.7).tolist() == [4, 5]


def test_groups_become_supernodes_a_persons_edits_win_and_json_keeps_both(graphs, tmp_path):
    g = fresh(graphs["llama_gqa"])
    s = g.summarize(max_groups=3)  # applied
    feats = s.groups[s.groups.kind == "features"]
    assert [sn[0] for sn in g.supernodes] == list(feats.name)
    assert g.workbench.auto == list(feats.name)
    # a person takes one member into a supernode of their own, and removes another automatic group
    first, second = feats.iloc[0], feats.iloc[-1]
    taken = first.members[0]
    g.supernode("mine", [taken])
    if len(feats) > 1:
        from slmviz.graphs.workbench import remove_supernode

        remove_supernode(g, second["name"])
    s.apply()  # applied again: the person's supernode keeps its member, the removed group stays out
    names = [sn[0] for sn in g.supernodes]
    assert "mine" in names and ["mine", taken] in g.supernodes
    assert all(taken not in sn[1:] for sn in g.supernodes if sn[0] != "mine")
    if len(feats) > 1:
        assert second["name"] not in names
    path = g.save_json(tmp_path / "g.json")
    data = json.loads(path.read_text())
    assert data["qParams"]["supernodes"] == [list(sn) for sn in g.supernodes]
    before = ([list(sn) for sn in g.supernodes], list(g.workbench.auto), list(g.workbench.dismissed))
    g.clear_pins()
    g.workbench.dismissed.clear()
    g.load_json(path)
    assert ([list(sn) for sn in g.supernodes], list(g.workbench.auto), list(g.workbench.dismissed)) == before
    assert g.workbench.summary["groups"][0]["name"] == first["name"]
    json.dumps(s.to_dict())  # JSON-able
    fresh(g)


def test_a_summary_pins_apart_from_the_person_and_takes_only_its_own_pins_back(graphs, tmp_path):
    g = fresh(graphs["gemma3"])
    s = g.summarize(max_groups=2, apply=False)
    feats = s.groups[s.groups.kind == "features"]
    mine = feats.iloc[0].members[0]
    g.pin([mine])  # the person's pin, before any summary
    s.apply()
    wb = g.workbench
    members = {m for ms in feats.members for m in ms}
    assert members <= set(g.pinned) and mine not in wb.auto_pinned
    assert set(wb.auto_pinned) == members - {mine}
    kept = wb.auto_pinned[-1]
    g.pin([kept])  # pinned by the person after the summary: theirs now
    path = g.save_json(tmp_path / "g.json")
    g.clear_pins()
    g.load_json(path)  # the JSON keeps which pins are the summary's
    assert set(wb.auto_pinned) == members - {mine, kept}
    for name in list(wb.auto):
        g.workbench.ungroup(name)  # each automatic group removed: its pins go, the person's stay
    assert g.pinned == [mine, kept] and wb.auto_pinned == []
    s.apply()  # both groups were dismissed: nothing comes back, the person's pins are untouched
    assert g.pinned == [mine, kept]
    wb.dismissed.clear()
    s.apply()
    s.apply()  # applied twice: the same pins, no duplicates, nothing of the person's lost
    assert sorted(g.pinned) == sorted(members | {kept}) and mine in g.pinned
    fresh(g)


def test_summary_reports_progress_to_the_end(graphs):
    seen = []
    g = fresh(graphs["gemma3"])
    s = g.summarize(max_groups=2, apply=False, progress=seen.append)
    s.check(progress=seen.append)
    assert seen and seen[-1].fraction == pytest.approx(1.0)
    assert all(b.fraction >= a.fraction for a, b in zip(seen, seen[1:], strict=False) if a.job == b.job)
