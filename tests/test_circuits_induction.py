"""Known structure is found: a 2-layer model trained here on repeated random sequences forms an induction circuit (a
previous-token head in layer 0, an induction head in layer 1 whose keys read it), and EAP-IG and EAP rank that
K-composition edge among the top edges.

The model is a LLaMA with q/k biases (a constant part in every query and key lets RoPE make a purely positional
previous-token head; without it, the 2-layer models tried here found other algorithms in this budget), a tiny MLP,
and sequences of random length (a fixed period lets it attend a fixed distance back instead of matching content).
Training takes ~10-25 s on one CPU thread. Not covered: how the ranking depends on the training seed (one seed;
with another budget, 1000 steps, EAP ranked the edge 18th while EAP-IG and exact patching still ranked it 3rd).
"""

from __future__ import annotations

import random

import pytest
import torch

import slmviz
from slmviz.circuits.circuit import circuit

VOCAB, HEADS, STEPS = 48, 2, 700


@pytest.fixture(scope="module")
def induction_model(tmp_path_factory):
    import transformers
    from conftest import _write_tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small matmuls: one thread is faster on a shared 2-core machine, and deterministic
    try:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=16, num_hidden_layers=2, num_attention_heads=HEADS,
            num_key_value_heads=HEADS, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
            attention_bias=True)
        model = transformers.LlamaForCausalLM(config)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        for _ in range(STEPS):
            length = int(torch.randint(4, 13, ()))
            a = torch.randint(2, VOCAB, (32, length))
            x = torch.cat([torch.ones(32, 1, dtype=torch.long), a, a], 1)  # BOS, A, A
            logits = model(x).logits
            loss = torch.nn.functional.cross_entropy(logits[:, length + 1:-1].reshape(-1, VOCAB),
                                                     x[:, length + 2:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    folder = tmp_path_factory.mktemp("induction")
    model.save_pretrained(folder)
    _write_tokenizer(folder, VOCAB)
    return slmviz.load(folder), float(loss.detach())


def pairs(n: int = 4, length: int = 10, seed: int = 1):
    """Clean [BOS] + A + A[:k] -> A[k]. Corrupted: the same, except that the token before A[k]'s first occurrence
    (A[k-1]) is another token, so no earlier position says "the token before me was A[k-1]": it breaks the match the
    induction head's key makes, and nothing else (the values it would copy are unchanged). Wrong: a token not in A."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        *a, other, wrong = rng.sample(range(2, VOCAB), length + 2)
        k = length // 2 + i % 3
        b = list(a)
        b[k - 1] = other
        out.append(([1, *a, *a[:k]], [1, *b, *a[:k]], a[k], wrong, length, k))
    return out


def test_eap_ranks_the_k_composition_edge_of_an_induction_circuit(induction_model):
    """EAP-IG and exact patching put the previous-token head -> induction head key edge among the top 3 of 46 (the
    textbook circuit: the token into the previous-token head's value, its write into the induction head's key,
    the induction head into the logits). EAP, whose gradient is taken on the clean run where the induction head's
    attention is saturated (softmax ~0.94), ranks it lower: among the top 10."""
    m, loss = induction_model
    assert loss < 0.1, f"the model did not learn the task (loss {loss:.3f})"
    data = pairs()
    prev, induction = torch.zeros(HEADS), torch.zeros(HEADS)
    for clean, _, _, _, length, k in data:
        t = m.trace(clean)
        p0, p1 = t["blocks.0.attn.hook_pattern"], t["blocks.1.attn.hook_pattern"]  # [h, q, k]
        prev += torch.stack([p0[:, i, i - 1] for i in range(2, len(clean))], 1).mean(1)
        induction += torch.stack([p1[:, length + 1 + j, 2 + j] for j in range(k)], 1).mean(1)
    prev, induction = prev / len(data), induction / len(data)
    p, q = int(prev.argmax()), int(induction.argmax())
    assert prev[p] > 0.5 and induction[q] > 0.8, (prev, induction)  # the structure formed
    edge = (f"a0.h{p}", f"a1.g{q}<k>")  # MHA: head q reads KV group q
    cleans, corrupteds, answers, wrongs = (list(x) for x in zip(*[d[:4] for d in data], strict=True))
    ranks = {}
    for method in ("eap", "eap-ig", "exact"):
        c = circuit(cleans, corrupteds, answer=answers, wrong=wrongs, model=m, method=method)
        ranks[method] = list(zip(c.edges.source, c.edges.target, strict=True)).index(edge)
    assert ranks["eap-ig"] < 3 and ranks["exact"] < 3 and ranks["eap"] < 10, ranks
