"""The bulk work in bf16: corpus scans, patching sweeps, edge scores and SAE activations on a model loaded with
dtype="bfloat16" stay within stated tolerances of the same work in fp32.

Tolerances (each measured, see the numbers in the constants' comments):

- Scans: δ_f, feature f's bf16 error over the examples either scan ranks in its top k (the values a top-examples
  table shows), is at most SCAN_TOL of its top fp32 activation for the median feature. bf16's top k may differ
  from fp32's only by that rounding: every example bf16 ranks in its top k has an fp32 activation within 2δ_f of
  fp32's k-th best (an example outside fp32's top k can pass one inside it only if bf16 lifted the one by at most
  δ_f and lowered the other by at most δ_f); where fp32's k-th and (k+1)-th best are more than 2δ_f apart, bf16
  keeps exactly fp32's top-k examples. Means move by at most the largest bf16 error over all tokens.
  Measured on SmolLM2 (24 verses, top 5): δ_f ÷ top activation, median / 99th percentile / max: layer 29 MLP
  neurons (the last layer, the worst) 3.3 % / ~13 % / ~50 %, layer 15 MLP ~2 % / ~9 % / ~16 %, layer 15 head
  norms ~1.4 % / 2 % / 2 %; the top-5 examples are the same set for ~71 % of layer 29's neurons, ~75 % of layer
  15's, 8 of 9 heads.
- Patching: the normalized heatmap ((value - corrupted) / (clean - corrupted)) is within PATCH_TOL of fp32's in
  every cell, on every site and both engines.

- Circuits: EAP and EAP-IG edge scores within EAP_TOL of fp32's largest |score|, top edges equal up to near-ties.
- SAEs spliced into a bf16 model: outputs exactly the bf16 model's (error term), pre-activations within SAE_TOL.

Runs on the tiny random llama, and (slow) on SmolLM2. Not covered: the Ray engine in bf16 (it runs the same
shard code), attribution patching in bf16, speed (bench/perf/dtype.py).
"""

from __future__ import annotations

import random

import pytest
import torch

import slmviz
from slmviz.corpora.verses import bundled_corpus_path, iter_documents
from slmviz.interventions.sites import SITES
from slmviz.model import params
from slmviz.scans.reduce import token_key
from slmviz.scans.units import feature_of

SCAN_TOL = 2.0**-4  # 6.25 % (median feature); measured: ≤ 1.8 % every feature of the tiny llama, 3.3 % SmolLM2 (above)
PATCH_TOL = 0.05  # of the clean - corrupted span; measured: ≤ 0.007 (tiny llama), ≤ 0.025 (SmolLM2's IOI pair)
TOP_K = 5
MLP, Z, PATTERN = "blocks.1.mlp.hook_post", "blocks.0.attn.hook_z", "blocks.1.attn.hook_pattern"
CLEAN = [3, 10, 11, 12, 13, 14, 15, 16]
CORRUPTED = [3, 10, 11, 12, 40, 14, 15, 16]  # differs at position 4 only


@pytest.fixture(autouse=True)
def fast_bf16(monkeypatch):
    """Skip the timing (tests/test_dtype.py tests the warning). On the test worker's one thread: these tests once ran
    on two, as their tolerances were first measured, and beside `make test`'s other worker on a 2-core machine the
    two threads waited on each other at every op (the tiny model's per-cell sweeps: 1.4 s of CPU on one thread, 21 s
    on two). The tolerances hold on one thread as well (the tiny llama's heatmaps: 0.0073 of PATCH_TOL's 0.05)."""
    monkeypatch.setattr(params, "_bf16_slowdown", 0.5)


@pytest.fixture(scope="module")
def pair(tiny_dir) -> dict[str, slmviz.Model]:
    return {"float32": slmviz.load(tiny_dir), "bfloat16": slmviz.load(tiny_dir, dtype="bfloat16")}


def per_token_features(model: slmviz.Model, docs: list[str], hooks: list[str]) -> tuple[torch.Tensor, dict]:
    """(token keys [N], {hook: features [N, F] in fp32}) of every token of every document, one trace each, with
    the scan's own feature functions (slmviz.scans.units)."""
    keys, feats = [], {h: [] for h in hooks}
    for i, doc in enumerate(docs):
        t = model.trace(doc, names=hooks)
        n = len(t.tokens)
        keys.append(token_key(torch.full((n,), i), torch.arange(n)))
        for h in hooks:
            feats[h].append(feature_of(h, model.hook_names, model.cfg).fn(t[h][None])[0].float())
    return torch.cat(keys), {h: torch.cat(v) for h, v in feats.items()}


def check_scans_agree(scans: dict, pair: dict, docs: list[str], hooks: list[str]) -> int:
    """Assert the module docstring's scan tolerances; return how many features kept exactly fp32's top k."""
    keys, x32 = per_token_features(pair["float32"], docs, hooks)
    _, x16 = per_token_features(pair["bfloat16"], docs, hooks)
    row = {int(k): i for i, k in enumerate(keys)}
    same = 0
    for h in hooks:
        error = (x16[h] - x32[h]).abs()  # [N, F]
        torch.testing.assert_close(scans["bfloat16"].mean(h), scans["float32"].mean(h), rtol=0,
                                   atol=float(error.max()) + 1e-6)
        relative = []
        for f in range(x32[h].shape[1]):
            best = torch.sort(x32[h][:, f], descending=True, stable=True).values  # fp32 ranking
            kth, gap = best[TOP_K - 1], best[TOP_K - 1] - best[TOP_K]
            picked = scans["bfloat16"].stats[h].top_key[f].tolist()
            kept = scans["float32"].stats[h].top_key[f].tolist()
            delta = error[[row[k] for k in picked + kept], f].max()  # δ_f over both top-k lists
            relative.append(float(delta / best[0].abs().clamp_min(1e-12)))
            fp32_of_picked = x32[h][[row[k] for k in picked], f]
            assert bool((fp32_of_picked >= kth - 2 * delta).all()), (h, f)  # an explained swap, if any
            if gap > 2 * delta:
                assert set(picked) == set(kept), (h, f)
                same += 1
        assert float(torch.tensor(relative).median()) <= SCAN_TOL, (h, sorted(relative)[len(relative) // 2])
    return same


def test_a_bf16_scan_stays_within_bf16_rounding_of_the_fp32_scan(pair):
    rng = random.Random(0)
    docs = [" ".join(f"w{rng.randrange(2, 100)}" for _ in range(rng.randrange(1, 60))) for _ in range(30)]
    hooks = [MLP, Z, PATTERN]
    scans = {dt: slmviz.scan(docs, hooks=hooks, top_k=TOP_K, model=m, batch_tokens=200, progress=False)
             for dt, m in pair.items()}
    assert scans["bfloat16"].info["tokens"] == scans["float32"].info["tokens"]
    assert check_scans_agree(scans, pair, docs, hooks) >= 40  # of 104 features, the cut is wider than 2δ


def _strongest_pair(m: slmviz.Model) -> tuple[int, int]:
    """The answer / wrong tokens whose fp32 logits the corruption moves most in each direction: a random tiny
    model's usual logit difference moves by less than bf16's rounding of its logits, a real one's does not."""
    delta = m.logits(CLEAN)[-1] - m.logits(CORRUPTED)[-1]
    return int(delta.argmax()), int(delta.argmin())


@pytest.mark.parametrize("engine", ["batched", "per_cell"])
def test_a_bf16_patching_heatmap_is_within_its_tolerance_of_fp32s(pair, engine):
    answer, wrong = _strongest_pair(pair["float32"])
    for site in SITES:
        r32, r16 = (slmviz.patch(CLEAN, CORRUPTED, answer=answer, wrong=wrong, site=site, model=m, engine=engine)
                    for m in pair.values())
        assert r16.values.shape == r32.values.shape and r16.complete
        assert abs(r32.clean - r32.corrupted) > 0.3  # a span well above bf16's rounding of the logits
        assert float((r16.normalized - r32.normalized).abs().max()) <= PATCH_TOL, site


def test_the_bf16_batched_sweep_equals_one_forward_per_cell_in_bf16(pair):
    """The batched engine's shortcuts hold in bf16 too: equal to one bf16 forward per cell to bf16 rounding of
    the metric (a batch of patched rows may run other GEMM shapes than one row)."""
    answer, wrong = _strongest_pair(pair["float32"])
    for site in ("resid_pre", "z", "pattern"):
        fast, slow = (slmviz.patch(CLEAN, CORRUPTED, answer=answer, wrong=wrong, site=site, model=pair["bfloat16"],
                                   engine=engine) for engine in ("batched", "per_cell"))
        scale = max(abs(slow.clean), abs(slow.corrupted))
        assert float((fast.values - slow.values).abs().max()) <= 2.0**-7 * scale, site


@pytest.fixture(scope="module")
def smollm2_bf16() -> slmviz.Model:
    """The real default model in bf16, once for both of its tests (a load dequantizes nothing, but converts 135M
    weights)."""
    return slmviz.load(dtype="bfloat16")


@pytest.mark.slow
def test_smollm2_bf16_patching_heatmap_is_within_its_tolerance_of_fp32s(model, smollm2_bf16):
    bf16 = smollm2_bf16
    clean, corrupted = ("When Mary and John went out, John gave a drink to",
                        "When Mary and John went out, Mary gave a drink to")
    for site in ("resid_pre", "attn_out"):
        r32, r16 = (slmviz.patch(clean, corrupted, answer=" Mary", wrong=" John", site=site, model=m)
                    for m in (model, bf16))
        assert float((r16.normalized - r32.normalized).abs().max()) <= PATCH_TOL, site


@pytest.mark.slow
def test_smollm2_bf16_scan_stays_within_bf16_rounding_of_the_fp32_scan(model, smollm2_bf16):
    docs = list(iter_documents(bundled_corpus_path(), limit=24))
    hooks = ["blocks.29.mlp.hook_post", "blocks.15.attn.hook_z", "blocks.15.attn.hook_pattern"]
    pair = {"float32": model, "bfloat16": smollm2_bf16}
    scans = {dt: slmviz.scan(docs, hooks=hooks, top_k=TOP_K, model=m, progress=False) for dt, m in pair.items()}
    check_scans_agree(scans, pair, docs, hooks)


EAP_TOL = 0.05  # of the largest |score|; measured on the tiny llama: 1.0 % (EAP), 1.1 % (EAP-IG)
SAE_TOL = 0.05  # of the largest activation; measured on the tiny llama's random SAEs: 0.1 %, 0.6 %, 2.0 %


@pytest.mark.parametrize("method", ["eap", "eap-ig"])
def test_bf16_edge_scores_stay_within_their_tolerance_of_fp32s(pair, method):
    """EAP / EAP-IG on a bf16 model: every edge's score within EAP_TOL of fp32's, the same top edges up to
    near-ties, and the bf16 circuit's own faithfulness endpoints still exact."""
    runs = {dt: slmviz.circuit(torch.tensor(CLEAN), torch.tensor(CORRUPTED), answer=20, wrong=21, model=m,
                               method=method) for dt, m in pair.items()}
    s32 = runs["float32"].edges.set_index(["source", "target"]).score
    s16 = runs["bfloat16"].edges.set_index(["source", "target"]).score.reindex(s32.index)
    assert not s16.isna().any()  # the same graph
    span = float(s32.abs().max())
    assert float((s16 - s32).abs().max()) <= EAP_TOL * span
    assert not s16.equals(s32)  # it really ran in bf16
    top32, top16 = set(s32.abs().nlargest(10).index), set(s16.abs().nlargest(10).index)
    for edge in top32 ^ top16:  # a swap at the top-10 cut must be a near-tie
        assert abs(abs(s32[edge]) - float(s32.abs().nlargest(10).iloc[-1])) <= 2 * EAP_TOL * span
    c = runs["bfloat16"]
    curve = c.faithfulness([0, c.graph.n_edges])
    assert curve.metric.tolist() == pytest.approx([c.corrupted, c.clean], abs=1e-6)


def test_saes_splice_into_a_bf16_model_exactly_and_read_its_activations_within_tolerance(pair):
    """SAE activations on a bf16 model: the SAE runs in its own (fp32) weights on the bf16 activation, the error
    term keeps every output exactly the bf16 model's, and each SAE's pre-activations stay within SAE_TOL of fp32's.
    Post-activations agree within SAE_TOL wherever a feature is active in both: a TopK or JumpReLU feature at its
    cut may switch on or off (the same near-tie as a scan's top-k)."""
    from test_sae_splice import saes_for

    saes = saes_for(pair["float32"])
    traces = {dt: m.trace(CLEAN, saes=saes) for dt, m in pair.items()}
    assert torch.equal(traces["bfloat16"].logits, pair["bfloat16"].trace(CLEAN).logits)
    for sae in saes:
        pre, post = (f"{sae.hook_name_out}.hook_sae_acts_{x}" for x in ("pre", "post"))
        p32, p16 = traces["float32"][pre], traces["bfloat16"][pre].float()
        assert float((p16 - p32).abs().max()) <= SAE_TOL * float(p32.abs().max()), pre
        a32, a16 = traces["float32"][post], traces["bfloat16"][post].float()
        both = (a32 != 0) & (a16 != 0)
        assert float((a16 - a32)[both].abs().max()) <= SAE_TOL * float(a32.abs().max()), post
        assert float(((a32 != 0) ^ (a16 != 0)).float().sum()) <= 0.05 * float((a32 != 0).sum()), post
