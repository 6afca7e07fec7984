"""Ablation hooks: what each kind writes, that a head goes through z (its write leaves hook_attn_out exactly),
and that the same dict works in trace, generate and stream.

Runs on a tiny random GQA model. Does not cover: which ablation is the right baseline for a question (zero vs
mean vs resample is a modelling choice), nor means from a real corpus scan (a stand-in object is used).
"""

from __future__ import annotations

import pytest
import torch

from slmviz.interventions.ablation import ablation

PROMPT = [3, 10, 11, 12, 13, 14]
REFERENCE = [[3, 20, 21, 22], [3, 30, 31, 32, 33]]


@pytest.fixture(scope="module")
def m(tiny_model):
    return tiny_model


def test_zero_ablating_a_head_zeroes_its_z_and_removes_exactly_its_result_from_attn_out(m):
    layer, head = 1, 2
    before = m.trace(PROMPT)
    after = m.trace(PROMPT, hooks=ablation(heads=[(layer, head)], model=m))
    z = after[f"blocks.{layer}.attn.hook_z"]
    assert torch.equal(z[:, head], torch.zeros_like(z[:, head]))
    others = [h for h in range(m.cfg.n_heads) if h != head]
    assert torch.equal(z[:, others], before[f"blocks.{layer}.attn.hook_z"][:, others])
    change = after[f"blocks.{layer}.hook_attn_out"] - before[f"blocks.{layer}.hook_attn_out"]
    result = before[f"blocks.{layer}.attn.hook_result"][:, head]  # [pos, d_model]
    torch.testing.assert_close(change, -result, rtol=0, atol=1e-6)  # o_proj's rounding only


def test_zero_ablating_a_neuron_zeroes_only_that_neuron(m):
    before = m.trace(PROMPT)
    after = m.trace(PROMPT, hooks=ablation(neurons=[(0, 7), (0, 9)], model=m))
    post, post0 = after["blocks.0.mlp.hook_post"], before["blocks.0.mlp.hook_post"]
    assert (post[:, [7, 9]] == 0).all()
    keep = [n for n in range(m.cfg.d_mlp) if n not in (7, 9)]
    assert torch.equal(post[:, keep], post0[:, keep])


def test_layers_ablate_a_whole_sublayer_write(m):
    after = m.trace(PROMPT, hooks=ablation(layers=[(1, "mlp"), 0], model=m))
    for name in ("blocks.1.hook_mlp_out", "blocks.0.hook_mlp_out", "blocks.0.hook_attn_out"):
        assert (after[name] == 0).all()
    assert (after["blocks.1.hook_attn_out"] != 0).any()


def test_mean_ablation_writes_the_mean_over_the_reference_prompts(m):
    name = "blocks.1.attn.hook_z"
    ref = torch.cat([m.trace(p, names=[name])[name] for p in REFERENCE])  # [n_ref, h, d_head]
    after = m.trace(PROMPT, hooks=ablation(heads=[(1, 0)], kind="mean", reference=REFERENCE, model=m))
    expected = ref.mean(0)[0].expand(len(PROMPT), -1)
    torch.testing.assert_close(after[name][:, 0], expected, rtol=0, atol=1e-7)


def test_mean_ablation_reads_a_corpus_scan_mean(m):
    class FakeScan:  # the part of slmviz.Scan that ablation reads
        def mean(self, name):
            return torch.full((m.cfg.d_mlp,), 0.5)

    after = m.trace(PROMPT, hooks=ablation(neurons=[(1, 3)], kind="mean", reference=FakeScan(), model=m))
    assert (after["blocks.1.mlp.hook_post"][:, 3] == 0.5).all()


def test_resample_ablation_writes_real_reference_activations(m):
    name = "blocks.0.mlp.hook_post"
    ref = torch.cat([m.trace(p, names=[name])[name] for p in REFERENCE])  # [n_ref, d_mlp]
    after = m.trace(PROMPT, hooks=ablation(neurons=[(0, 5)], kind="resample", reference=REFERENCE, model=m))
    for value in after[name][:, 5]:
        assert (ref[:, 5] == value).any()


def test_the_hooks_work_in_generate_and_stream(m):
    hooks = ablation(heads=[(0, 1), (1, 3)], neurons=[(1, 2)], model=m)
    first = int(m.trace(PROMPT, hooks=hooks, names=[]).logits[-1].argmax())
    ids = m.generate_ids(PROMPT, 4, hooks=hooks, stop_at_eos=False)
    assert ids[0] == first
    assert [s.token_id for s in m.stream(PROMPT, 4, hooks=hooks, stop_at_eos=False)] == ids


def test_the_hooks_work_on_batched_values(m):
    fn = ablation(heads=[(0, 1)], model=m)["blocks.0.attn.hook_z"]
    x = torch.randn(3, 5, m.cfg.n_heads, m.cfg.d_head)  # [b, pos, h, d_head]
    out = fn(x, "blocks.0.attn.hook_z")
    assert (out[:, :, 1] == 0).all() and torch.equal(out[:, :, 0], x[:, :, 0])


def test_bad_input_is_a_clear_error(m):
    with pytest.raises(ValueError, match=r"head \(0, 9\): head 9 is out of range 0..3"):
        ablation(heads=[(0, 9)], model=m)
    with pytest.raises(ValueError, match="layer 5 is out of range"):
        ablation(neurons=[(5, 1)], model=m)
    with pytest.raises(ValueError, match="pairs of integers"):
        ablation(heads=[3], model=m)
    with pytest.raises(ValueError, match="kind must be one of"):
        ablation(heads=[(0, 0)], kind="noise", model=m)
    with pytest.raises(ValueError, match="needs reference="):
        ablation(heads=[(0, 0)], kind="mean", model=m)
    with pytest.raises(ValueError, match="Nothing to ablate"):
        ablation(model=m)
    with pytest.raises(ValueError, match="'attn' | 'mlp'"):
        ablation(layers=[(0, "ffn")], model=m)


def test_mean_ablation_reads_a_real_corpus_scan(m):
    import slmviz

    corpus = ["w3 w20 w21 w22", "w3 w30 w31 w32 w33"]
    names = ["blocks.1.mlp.hook_post", "blocks.1.attn.hook_z"]
    s = slmviz.scan(corpus, hooks=names, model=m)
    hooks = ablation(heads=[(1, 2)], neurons=[(1, 4)], kind="mean", reference=s, model=m)
    after = m.trace(PROMPT, hooks=hooks)
    by_prompts = ablation(heads=[(1, 2)], neurons=[(1, 4)], kind="mean", reference=corpus, model=m)
    expected = m.trace(PROMPT, hooks=by_prompts)
    for name in names:  # a scan's mean over every token is the prompts' mean
        torch.testing.assert_close(after[name], expected[name], rtol=0, atol=1e-6)
