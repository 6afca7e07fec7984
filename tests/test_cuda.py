"""The replacement models on a GPU: a PLT set and a CLT trained with device="cuda", their checkpoints, splicing,
attribution graphs and feature patching, each against the same computation on the CPU. Skipped without CUDA (CI
has none; bench/gpu_transcoders.py runs this file on a GPU machine and records the result).

Independent references: the CPU run of the same seed (the coders' init and the batches' order come from CPU
generators, so the two runs start equal and differ by float rounding only), the graph's linear model (edges +
constant = targets), and a checkpoint resumed on the other device.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_model

import slmviz
from slmviz.circuits.attribution import attribution_graph
from slmviz.features.clt_io import load_clt
from slmviz.features.train_set import train_transcoders
from slmviz.features.transcoder_io import load_transcoders

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")

SMALL = dict(d_sae=48, k=4, batch_tokens=128, window=16, forward_tokens=128, buffer_tokens=512, progress=False,
             dtype="float32", checkpoint_every=0)
PROMPT = [1, 7, 12, 3, 44, 9, 101, 23]
CLEAN = [3, 10, 11, 12, 13, 14, 15, 16]
CORRUPTED = [3, 10, 11, 12, 40, 14, 15, 16]


@pytest.fixture(scope="module", autouse=True)
def exact_fp32():
    """fp32 products in fp32 on the GPU (no TF32), as on the CPU: the comparisons below are of rounding only."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama_gqa")


@pytest.fixture(scope="module")
def cpu(folder):
    return slmviz.load(folder)


@pytest.fixture(scope="module")
def gpu(folder):
    return slmviz.load(folder, device="cuda")


@pytest.fixture(scope="module")
def corpus():
    return [" ".join(f"w{(i * 7 + j * 3) % 120}" for j in range(20 + i % 13)) for i in range(60)]


def tensors_of(s) -> dict[str, torch.Tensor]:
    """A CLT's tensors, or a PLT set's, each coder's named by its layer."""
    if hasattr(s, "tensors"):
        return s.tensors()
    return {f"{L}.{k}": v for L in s.layers for k, v in s.coder(L).tensors().items()}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_exact_graph(g) -> None:
    target = torch.tensor(g.nodes["kind"].isin(["feature", "logit"]).to_numpy())
    got = (g.adjacency.sum(1) + g.constant)[target].cpu()
    want = g.target_values[target].cpu()
    assert torch.allclose(got, want, atol=1e-4 * float(want.abs().max()), rtol=0), float((got - want).abs().max())


@pytest.mark.parametrize("kind", ["plt", "clt"])
def test_a_set_trained_on_cuda_is_the_cpu_runs_up_to_rounding(cpu, gpu, corpus, tmp_path, kind):
    args = dict(kind=kind, corpus=corpus, tokens=1200, architecture="batchtopk", skip=True, **SMALL)
    on_cpu = train_transcoders(cpu, out=tmp_path / "cpu", **args)
    on_gpu = train_transcoders(gpu, out=tmp_path / "gpu", device="cuda", **args)
    back = load_transcoders(tmp_path / "gpu", model=cpu)  # the files the GPU run wrote, read on the CPU
    ours, theirs = tensors_of(on_cpu), tensors_of(back)
    assert set(ours) == set(theirs)
    for name, t in ours.items():
        # ~10 steps of Adam from the same init and batches; BatchTopK can flip a near-tie, so a bound, not equality
        assert relative(theirs[name], t) < 0.05, (name, relative(theirs[name], t))
    for name, t in tensors_of(on_gpu).items():
        assert t.device.type == "cuda", name
        assert torch.equal(t.cpu(), theirs[name]), name  # what it returned is what it saved


@pytest.mark.parametrize("kind", ["plt", "clt"])
def test_on_cuda_splicing_is_exact_and_graphs_are_the_cpus(cpu, gpu, corpus, tmp_path, kind):
    train_transcoders(cpu, out=tmp_path / "set", kind=kind, corpus=corpus, tokens=1200, architecture="batchtopk",
                      skip=True, **SMALL)
    on_cpu = load_transcoders(tmp_path / "set", model=cpu)
    on_gpu = load_transcoders(tmp_path / "set", model=gpu)
    spliced = gpu.trace(PROMPT, saes=on_gpu)
    assert torch.equal(spliced.logits, gpu.trace(PROMPT).logits)  # error terms on: nothing changes
    name = "blocks.1.hook_mlp_out.hook_sae_acts_post"
    acts = {d: m.trace(PROMPT, saes=s, names=[name])[name] for d, m, s in (("cpu", cpu, on_cpu), ("gpu", gpu, on_gpu))}
    assert relative(acts["gpu"], acts["cpu"]) < 1e-4
    g_cpu = attribution_graph(PROMPT, transcoders=on_cpu, model=cpu, progress=False)
    g_gpu = attribution_graph(PROMPT, transcoders=on_gpu, model=gpu, progress=False)
    assert_exact_graph(g_gpu)
    assert g_gpu.n_features == g_cpu.n_features and g_gpu.nodes["node_id"].equals(g_cpu.nodes["node_id"])
    for column in ("activation", "probability"):
        a, b = (torch.tensor(g.nodes[column].to_numpy()).nan_to_num() for g in (g_gpu, g_cpu))
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), column
    assert relative(g_gpu.constant, g_cpu.constant) < 1e-4
    assert relative(g_gpu.target_values, g_cpu.target_values) < 1e-4
    assert relative(g_gpu.adjacency, g_cpu.adjacency) < 1e-4


def test_feature_patching_over_a_clt_on_cuda_is_the_cpus(cpu, gpu, corpus, tmp_path):
    train_transcoders(cpu, out=tmp_path / "clt", kind="clt", corpus=corpus, tokens=1200, architecture="batchtopk",
                      skip=True, **SMALL)
    frames = {}
    for device, m in (("cpu", cpu), ("gpu", gpu)):
        clt = load_clt(tmp_path / "clt", model=m)
        frames[device] = slmviz.patch(CLEAN, CORRUPTED, answer=20, wrong=21, site="sae", saes=clt, model=m,
                                      top=10).frame()
    keys = ["layer", "position", "feature"]
    a, b = (frames[d].sort_values(keys).reset_index(drop=True) for d in ("cpu", "gpu"))
    assert a[keys].equals(b[keys])
    assert torch.allclose(torch.tensor(b["effect"].to_numpy()), torch.tensor(a["effect"].to_numpy()),
                          rtol=1e-3, atol=1e-5)


def test_a_clt_checkpoint_written_on_cuda_resumes_on_the_cpu(cpu, gpu, corpus, tmp_path):
    """Train on a GPU box, finish on a laptop: the checkpoint (weights, Adam moments, dead-feature counters,
    BatchTopK threshold) holds no CUDA tensors that the CPU run cannot take."""
    calls = []

    def stop(stats):
        calls.append(stats["tokens"])
        if len(calls) == 5:
            raise KeyboardInterrupt

    args = dict(kind="clt", corpus=corpus, tokens=1200, out=tmp_path / "cut", architecture="batchtopk", skip=True)
    with pytest.raises(KeyboardInterrupt):
        train_transcoders(gpu, device="cuda", **args, **{**SMALL, "progress": stop, "checkpoint_every": 0})
    resumed = train_transcoders(cpu, **args, **SMALL)
    whole = train_transcoders(cpu, **{**args, "out": tmp_path / "whole"}, **SMALL)
    for name, t in whole.tensors().items():
        assert relative(resumed.tensors()[name], t) < 0.05, name
