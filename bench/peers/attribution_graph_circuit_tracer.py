"""Agreement of slmviz.attribution_graph with circuit-tracer itself, on one tiny LLaMA and the same transcoders.

circuit-tracer (PyPI `circuit-tracer`, 0.5.0 when this was written) pulls in TransformerLens, nnsight, wandb and
more, so it never enters the project's venv: it lives in a side venv, and this script runs in both.

    python3.11 -m venv /tmp/ct-venv
    /tmp/ct-venv/bin/pip install /opt/wheels/torch-*.whl      # CPU torch first, so pip never pulls a CUDA build
    /tmp/ct-venv/bin/pip install circuit-tracer
    .venv/bin/python bench/peers/attribution_graph_circuit_tracer.py [--ct-python /tmp/ct-venv/bin/python] [--out FILE]

The project side builds a random 2-layer LLaMA (GQA, non-unit norm weights) with transformers, random per-layer
transcoders (relu; with and without W_skip, since circuit-tracer needs one transcoder per layer), and slmviz's graph
of one prompt that starts with the tokenizer's special token; it saves all of it to a folder. The side venv loads
the same checkpoint into TransformerLens (convert_llama_weights, no weight folding), wraps it in circuit-tracer's
TransformerLensReplacementModel with the same transcoders, runs `circuit_tracer.attribute` on the same token ids,
and writes the graph JSON with `create_graph_files`. The project side then compares node lists, the adjacency, and
the two JSON files. Prints the figures and writes them to bench/results/attribution_graph_agreement.md (docs include
it); nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

# common is imported by the slmviz half alone: the circuit-tracer half runs in its side venv.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first

WORK = Path("/tmp/slmviz_ct_agreement")
PROMPT_IDS = [1, 7, 12, 3, 44, 9, 101, 23, 5, 60]  # starts with id 1, the tiny tokenizer's special (EOS) token
LABELS = {"plain": "ReLU", "skip": "ReLU with W_skip", "jumprelu": "JumpReLU with W_skip"}
CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)


def build(folder: Path) -> None:
    """The tiny LLaMA (as tests/conftest.py builds it) and its tokenizer."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
    model.save_pretrained(folder)
    vocab = {f"w{i}": i for i in range(CONFIG["vocab_size"] - 1)}
    vocab["<unk>"] = CONFIG["vocab_size"] - 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="w1")
    fast.save_pretrained(folder)


def slmviz_side(ct_python: str, out_path: Path | None = None) -> None:
    from common import RESULTS

    import slmviz
    from slmviz import SAE

    WORK.mkdir(parents=True, exist_ok=True)
    build(WORK / "model")
    m = slmviz.load(WORK / "model")
    d = m.cfg.d_model
    report = {}
    for tag, arch, skip in (("plain", "relu", False), ("skip", "relu", True), ("jumprelu", "jumprelu", True)):
        tcs = [SAE.random(d, 2 * d, seed=10 + L, architecture=arch, skip=skip, hook_name=f"blocks.{L}.mlp.hook_in",
                          hook_name_out=f"blocks.{L}.hook_mlp_out") for L in range(m.cfg.n_layers)]
        # The set goes to circuit-tracer as files slmviz wrote (its transcoder_set layout), read by its own loader.
        slmviz.TranscoderSet(tcs, name="tiny").save(WORK / f"set_{tag}", format="circuit-tracer")
        g = slmviz.attribution_graph(PROMPT_IDS, transcoders=tcs, model=m, batch_size=32)
        torch.save({f"{L}.{k}": v.detach() for L, tc in enumerate(tcs) for k, v in tc.tensors().items()},
                   WORK / f"transcoders_{tag}.pt")
        g.prune(0.8, 0.98).save_json(WORK / f"slmviz_{tag}.json", slug=tag, scan="tiny")
        torch.save({"adjacency": g.adjacency, "node_ids": list(g.nodes["node_id"]), "input_ids": g.input_ids,
                    "scores": g.scores()}, WORK / f"slmviz_{tag}.pt")
        out = subprocess.run([ct_python, __file__, "--side", "circuit-tracer", "--tag", tag, "--skip", str(int(skip))],
                             capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stdout[-3000:], out.stderr[-6000:])
            raise SystemExit(f"circuit-tracer side failed ({tag})")
        report[tag] = compare(tag)
    print(json.dumps(report, indent=2))
    out_path = out_path or RESULTS / "attribution_graph_agreement.md"
    out_path.write_text(agreement_markdown(report, ct_python))
    print(f"wrote {out_path}")


def agreement_markdown(report: dict, ct_python: str) -> str:
    """The table docs/attribution-graphs.md includes."""
    version = subprocess.run([ct_python, "-c", "import importlib.metadata as m; print(m.version('circuit-tracer'), "
                              "m.version('transformer-lens'))"], capture_output=True, text=True).stdout.split()
    lines = [
        f"Measured by `bench/peers/attribution_graph_circuit_tracer.py` against circuit-tracer {version[0]} "
        f"(TransformerLens {version[1]}, its TransformerLens backend) in a side venv, on one random 2-layer LLaMA "
        f"(d_model {CONFIG['hidden_size']}, 4 heads / 2 KV heads, non-unit norm weights) with random ReLU and JumpReLU "
        f"transcoders (d_sae {2 * CONFIG['hidden_size']}) at both layers, {report['plain']['tokens']} tokens "
        "starting with the tokenizer's special token; both sides pruned at 0.8 / 0.98 for the JSON.",
        "",
        r"| transcoders | nodes (slmviz / circuit-tracer) | same node list | nonzero edges | max \|Δ adjacency\| "
        r"(largest \|edge\|) | pruned JSON: nodes, links | same node ids and links | max \|Δ link weight\| | "
        "influence, activation, token_prob: max relative Δ |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for tag, r in report.items():
        lines.append(
            f"| {LABELS[tag]} | {r['nodes']} / {r['circuit_tracer_nodes']} | "
            f"{'yes' if r['same_node_list'] else 'no'} | {r.get('nonzero_edges', '—'):,} | "
            f"{r.get('adjacency_max_abs_diff', float('nan')):.2g} ({r.get('adjacency_max_abs', float('nan')):.1f}) | "
            f"{r['json_pruned_nodes'][0]}, {r['json_links'][0]} (circuit-tracer {r['json_pruned_nodes'][1]}, "
            f"{r['json_links'][1]}) | {'yes' if r['json_same_node_ids'] and r['json_same_links'] else 'no'} | "
            f"{r['json_link_weight_max_abs_diff']:.2g} | {r['json_influence_max_rel_diff']:.1g}, "
            f"{r['json_activation_max_rel_diff']:.1g}, {r['json_token_prob_max_rel_diff']:.1g} |")
    fields = "none" if not any(r["json_node_fields_differing"] for r in report.values()) else \
        ", ".join(sorted({f for r in report.values() for f in r["json_node_fields_differing"]}))
    keys_equal = all(r["json_top_keys_equal"] and r["json_metadata_keys_equal"] and r["json_node_keys_equal"]
                     for r in report.values())
    tl_hf = max(r["tl_vs_hf_logits_max_abs"] for r in report.values())
    scores = "; ".join(
        f"{LABELS[tag]}: replacement {r['scores']['replacement']:.6f} "
        f"(circuit-tracer {r['circuit_tracer_scores']['replacement']:.6f}), completeness "
        f"{r['scores']['completeness']:.6f} ({r['circuit_tracer_scores']['completeness']:.6f})"
        for tag, r in report.items())
    loaded = max(r["circuit_tracer_loaded_set_max_abs_diff"] for r in report.values())
    lines += ["", "Each set reached circuit-tracer as files: slmviz saved it in circuit-tracer's transcoder_set "
              "layout (`TranscoderSet.save(folder, format=\"circuit-tracer\")`) and circuit-tracer's own "
              "`load_transcoder_set` read them back; its tensors against slmviz's in memory: max \\|Δ\\| "
              f"{loaded:.1g}.", "JSON keys (top level, metadata, every node's fields in order) equal: "
              f"{'yes' if keys_equal else 'no'}; "
              f"non-numeric node fields that differ: {fields}. TransformerLens's logits of the checkpoint vs "
              rf"transformers': max \|Δ\| {tl_hf:.1g}.", "",
              f"Graph scores (`AttributionGraph.scores()` vs circuit-tracer's `compute_graph_scores`): {scores}.", ""]
    return "\n".join(lines)


def compare(tag: str) -> dict:
    ours, theirs = torch.load(WORK / f"slmviz_{tag}.pt"), torch.load(WORK / f"ct_{tag}.pt")
    same_nodes = ours["node_ids"] == theirs["node_ids"]
    a, b = ours["adjacency"], theirs["adjacency"]
    row = {"tokens": len(ours["input_ids"]), "same_ids": ours["input_ids"] == theirs["input_ids"],
           "nodes": len(ours["node_ids"]), "circuit_tracer_nodes": len(theirs["node_ids"]),
           "same_node_list": same_nodes,
           "tl_vs_hf_logits_max_abs": theirs["tl_vs_hf"],
           "circuit_tracer_loaded_set_max_abs_diff": theirs.get("loaded_max_abs_diff"),
           "scores": ours["scores"], "circuit_tracer_scores": theirs["scores"]}
    if same_nodes:
        diff = (a - b).abs()
        row |= {"adjacency_max_abs_diff": float(diff.max()), "adjacency_max_abs": float(b.abs().max()),
                "relative": float(diff.max() / b.abs().max()), "nonzero_edges": int((b != 0).sum()),
                "edges_nonzero_in_one_only": int(((a != 0) ^ (b != 0)).sum())}
    ja, jb = json.loads((WORK / f"slmviz_{tag}.json").read_text()), json.loads((WORK / f"ct_{tag}.json").read_text())
    ka, kb = {n["node_id"]: n for n in ja["nodes"]}, {n["node_id"]: n for n in jb["nodes"]}
    la = {(x["source"], x["target"]): x["weight"] for x in ja["links"]}
    lb = {(x["source"], x["target"]): x["weight"] for x in jb["links"]}
    common = set(la) & set(lb)
    row |= {
        "json_top_keys_equal": list(ja) == list(jb),
        "json_metadata_keys_equal": list(ja["metadata"]) == list(jb["metadata"]),
        "json_node_keys_equal": all(list(n) == list(jb["nodes"][0]) for n in ja["nodes"]),
        "json_pruned_nodes": [len(ka), len(kb)], "json_same_node_ids": set(ka) == set(kb),
        "json_links": [len(la), len(lb)], "json_same_links": set(la) == set(lb),
        "json_link_weight_max_abs_diff": max((abs(la[k] - lb[k]) for k in common), default=None),
        "json_node_fields_differing": sorted({f for i in set(ka) & set(kb) for f in ka[i]
                                              if not isinstance(ka[i][f], float) and ka[i][f] != kb[i][f]}),
        **{f"json_{f}_max_rel_diff": max((abs(ka[i][f] - kb[i][f]) / max(abs(kb[i][f]), 1e-12)
                                          for i in set(ka) & set(kb) if isinstance(ka[i][f], float)), default=None)
           for f in ("influence", "activation", "token_prob")},
    }
    return row


def tl_replacement_model(hf, tokenizer, tokenizer_name: Path, tset, model_name: str):
    """circuit-tracer's TransformerLensReplacementModel of a transformers LLaMA `hf` (its weights converted by
    TransformerLens's convert_llama_weights, nothing folded) with transcoder set `tset` (circuit-tracer's object);
    the side venv's half, shared with bench/peers/graph_full_set.py."""
    from circuit_tracer.replacement_model.replacement_model_transformerlens import TransformerLensReplacementModel
    from transformer_lens import HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_llama_weights

    c = hf.config
    head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    cfg = HookedTransformerConfig(
        d_model=c.hidden_size, d_head=head, n_heads=c.num_attention_heads,
        n_key_value_heads=c.num_key_value_heads, d_mlp=c.intermediate_size, n_layers=c.num_hidden_layers,
        n_ctx=min(c.max_position_embeddings, 4096), d_vocab=c.vocab_size, act_fn="silu", normalization_type="RMS",
        positional_embedding_type="rotary", rotary_adjacent_pairs=False, rotary_dim=head,
        rotary_base=int(rope_theta(c)), gated_mlp=True, final_rms=True,
        eps=c.rms_norm_eps, original_architecture="LlamaForCausalLM", tokenizer_name=str(tokenizer_name),
        model_name=model_name, dtype=torch.float32, device="cpu", default_prepend_bos=False,
    )
    model = TransformerLensReplacementModel(cfg, tokenizer=tokenizer)
    model.load_and_process_state_dict(convert_llama_weights(hf, cfg), fold_ln=False, center_writing_weights=False,
                                      center_unembed=False, fold_value_biases=False)
    model._configure_replacement_model(tset)
    return model


def rope_theta(config) -> float:
    """The RoPE base of a config.json that transformers 5 wrote (`rope_parameters: {rope_theta: ...}`), which the
    side venv's transformers 4 does not read: it keeps the key as a plain attribute and defaults `rope_theta` to
    10000 (SmolLM2's is 100000, so TransformerLens would run another model)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(config, "rope_theta", 10000))


def circuit_tracer_side(tag: str, skip: bool) -> None:
    import transformers
    from circuit_tracer import attribute
    from circuit_tracer.graph import compute_graph_scores
    from circuit_tracer.utils.create_graph_files import create_graph_files

    hf = transformers.AutoModelForCausalLM.from_pretrained(WORK / "model", dtype=torch.float32)
    c = hf.config
    # The project's transformers (5.x) saves a tokenizer class 4.x does not know: re-save the same tokenizer.json.
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(WORK / "model" / "tokenizer.json"),
                                                     unk_token="<unk>", eos_token="w1")
    tokenizer.save_pretrained(WORK / "ct_tokenizer")
    import yaml
    from circuit_tracer.transcoder.single_layer_transcoder import load_transcoder_set

    # circuit-tracer's own loader on the folder slmviz saved (config.yaml + layer_{L}.safetensors)
    folder = WORK / f"set_{tag}"
    config = yaml.safe_load((folder / "config.yaml").read_text())
    assert config["model_kind"] == "transcoder_set"
    paths = {i: str(folder / f) for i, f in enumerate(config["transcoders"])}
    tset = load_transcoder_set(paths, scan=config["scan"], feature_input_hook=config["feature_input_hook"],
                               feature_output_hook=config["feature_output_hook"], device=torch.device("cpu"),
                               dtype=torch.float32, lazy_encoder=False, lazy_decoder=False)
    state = torch.load(WORK / f"transcoders_{tag}.pt")
    loaded_diff = 0.0
    for L in range(c.num_hidden_layers):  # what circuit-tracer read against the tensors slmviz had in memory
        t = tset.transcoders[L]
        pairs = [(t.W_enc, state[f"{L}.W_enc"].T), (t.W_dec, state[f"{L}.W_dec"]), (t.b_enc, state[f"{L}.b_enc"]),
                 (t.b_dec, state[f"{L}.b_dec"])]
        if skip:
            pairs.append((t.W_skip, state[f"{L}.W_skip"]))
        if f"{L}.threshold" in state:
            pairs.append((t.activation_function.threshold, state[f"{L}.threshold"]))
        loaded_diff = max(loaded_diff, *(float((a.detach() - b).abs().max()) for a, b in pairs))
    # As from_pretrained_and_transcoders does: load the weights into the plain model first (the replacement model
    # renames mlp -> mlp.old_mlp), then configure the replacement around them.
    model = tl_replacement_model(hf, tokenizer, WORK / "ct_tokenizer", tset, "tiny-llama")
    ids = torch.tensor(torch.load(WORK / f"slmviz_{tag}.pt")["input_ids"])
    with torch.no_grad():
        tl_vs_hf = float((model(ids[None])[0] - hf(ids[None]).logits[0]).abs().max())
    graph = attribute(ids, model, batch_size=32, max_n_logits=10, desired_logit_prob=0.95)
    n_pos = len(graph.input_tokens)
    ids_out = [int(i) for i in graph.input_tokens]
    node_ids = [f"{layer}_{feat}_{pos}" for layer, pos, feat in graph.active_features[graph.selected_features].tolist()]
    node_ids += [f"0_{L}_{p}" for L in range(c.num_hidden_layers) for p in range(n_pos)]
    node_ids += [f"E_{ids_out[p]}_{p}" for p in range(n_pos)]
    node_ids += [f"{c.num_hidden_layers + 1}_{t.vocab_idx}_{n_pos - 1}" for t in graph.logit_targets]
    replacement, completeness = compute_graph_scores(graph)
    torch.save({"adjacency": graph.adjacency_matrix.float().cpu(), "node_ids": node_ids, "input_ids": ids_out,
                "tl_vs_hf": tl_vs_hf, "loaded_max_abs_diff": loaded_diff,
                "scores": {"replacement": replacement, "completeness": completeness}},
               WORK / f"ct_{tag}.pt")
    create_graph_files(graph, slug=tag, output_path=str(WORK / f"ct_{tag}_files"), scan="tiny",
                       node_threshold=0.8, edge_threshold=0.98)
    (WORK / f"ct_{tag}.json").write_text((WORK / f"ct_{tag}_files" / f"{tag}.json").read_text())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", default="slmviz", choices=["slmviz", "circuit-tracer"])
    parser.add_argument("--ct-python", default="/tmp/ct-venv/bin/python")
    parser.add_argument("--tag", default="plain")
    parser.add_argument("--skip", default="0")
    parser.add_argument("--out", type=Path, default=None,
                        help="the Markdown table docs/attribution-graphs.md includes (default: in bench/results/)")
    args = parser.parse_args()
    if args.side == "slmviz":
        slmviz_side(args.ct_python, args.out)
    else:
        circuit_tracer_side(args.tag, args.skip == "1")
