"""The worked example of docs/attention.md: why does SmolLM2's name mover, at the end of the IOI prompt, look at the
indirect object, and which heads carry the indirect object's edge to the answer?

1. Build the attribution graph of the prompt over a transcoder set (`--set plt`: SmolLM2's full per-layer set,
   prepared by `slmviz prepare --transcoders plt`; `--set bundled`: the bundled pair transcoder_l6 / transcoder_l9)
   and prune it as the app does (node 0.8, edge 0.98).
2. Find the name mover: the head whose direct logit attribution to logit(answer) - logit(wrong) at the last position
   is largest among the heads that attend from there to the answer's position with a weight of MIN_ATTENTION or more,
   and more than to the wrong name's (a head with a large attribution but next to no attention to the answer moves
   something else).
3. QK attribution of that head at (last position, answer's position) and at (last position, wrong name's first
   position): the top pairs, the top nodes of each side, and each query-side node's part of the difference between
   the two scores (scale · q_i · (k_answer - k_wrong): which nodes make the head prefer the indirect object).
4. Head loadings of the edge from the answer's embedding (and from the strongest node at the answer's position) to
   the answer's logit: which heads carry it, and how much of it goes through two heads or more.

    .venv/bin/python bench/studies/qk_example.py [--set plt|plt-quick|bundled] [--max-feature-nodes 4096]
        [--prompt TEXT --answer " Mary" --wrong " John"]

Writes results/qk_example.json (every number) and results/qk_example.md (the tables docs/attention.md includes),
naming the CPU, the load average and the set.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import torch  # noqa: E402

import slmviz  # noqa: E402
from slmviz.graphs.attribution import attribution_graph  # noqa: E402
from slmviz.graphs.head_loadings import head_loadings  # noqa: E402
from slmviz.graphs.qk import qk_attribution  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
PROMPT = "When Mary and John went to the store, John gave a drink to"
BUNDLED_PAIR = ("transcoder_l6", "transcoder_l9")
MIN_ATTENTION = 0.25  # the name mover's attention weight to the answer's position, at least


def load_set(model, which: str):
    """The transcoder set and, for the prepared set, its feature scan (what the automatic labels read)."""
    if which == "bundled":
        return [slmviz.load_sae(name, model=model) for name in BUNDLED_PAIR], None
    from slmviz.features.prepared_scans import load_set_scan
    from slmviz.replacement.load import load_transcoders

    ts = load_transcoders(which, model=model)
    found = load_set_scan(model, which)
    return ts, (None if found is None else found[0])


def name_mover(model, ids: list[int], tokens: list[str], answer: str, wrong: str, top: int
               ) -> tuple[dict, list[dict], int, int]:
    """(the chosen head, the top heads table, the answer's position, the wrong name's first position)."""
    io, s = tokens.index(answer), tokens.index(wrong)
    t = model.trace(torch.tensor(ids))  # every hook: logit attribution by head reads each layer's
    dla = t.logit_attribution(answer, wrong, by="head")
    heads = dla[dla["kind"] == "head"]
    rows = []
    for layer, head, value in zip(heads["layer"], heads["head"], heads["attribution"], strict=True):
        pattern = t[f"blocks.{int(layer)}.attn.hook_pattern"][int(head), -1]
        rows.append({"layer": int(layer), "head": int(head), "dla": float(value),
                     "to_answer": float(pattern[io]), "to_wrong": float(pattern[s])})
    rows.sort(key=lambda r: -r["dla"])
    chosen = next(r for r in rows if r["to_answer"] >= MIN_ATTENTION and r["to_answer"] > r["to_wrong"])
    return chosen, rows[:top], io, s


def side_rows(frame, n: int) -> list[dict]:
    return [{"node": r.node, "kind": r.kind, "layer": int(r.layer), "position": int(r.position), "label": r.label,
             "contribution": float(r.contribution)} for r in frame.head(n).itertuples(index=False)]


def preference(qk_a, qk_b, n: int) -> tuple[list[dict], float]:
    """Each query-side node's part of score_a - score_b (the same query, two keys): scale · q_i · (k_a - k_b), the
    top n by size, and their sum over every node (which is the difference of the two linear scores)."""
    diff = qk_a.key_vectors.sum(0) - qk_b.key_vectors.sum(0)
    parts = qk_a.scale * (qk_a.query_vectors @ diff)
    order = torch.argsort(parts.abs(), descending=True)[:n]
    nodes = qk_a.nodes
    rows = [{"node": nodes["node_id"].iat[i], "kind": nodes["kind"].iat[i], "layer": int(nodes["layer"].iat[i]),
             "position": int(nodes["position"].iat[i]), "label": nodes["label"].iat[i], "contribution": float(parts[i])}
            for i in order.tolist()]
    return rows, float(parts.sum())


def loadings_record(g, source: str, target: str, n: int) -> dict:
    start = time.perf_counter()
    hl = head_loadings(g, source, target)
    seconds = time.perf_counter() - start
    return {"source": source, "target": target, "seconds": round(seconds, 2),
            **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in hl.attrs.items()},
            "heads": [{"layer": int(r.layer), "head": int(r.head), "weight": float(r.weight),
                       "one_hop": float(r.one_hop)} for r in hl.head(n).itertuples(index=False)]}


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    m = slmviz.load()
    ts, scan = load_set(m, args.set)
    start = time.perf_counter()
    g = attribution_graph(args.prompt, transcoders=ts, model=m, progress=False,
                          max_feature_nodes=args.max_feature_nodes)
    build = time.perf_counter() - start
    if scan is not None:
        g.use_scans({L: scan for L in range(m.cfg.n_layers)})
    p = g.prune(0.8, 0.98)
    chosen, top_heads, io, s = name_mover(m, p.input_ids, p.tokens, args.answer, args.wrong, args.top)
    layer, head = chosen["layer"], chosen["head"]
    start = time.perf_counter()
    qk_io = qk_attribution(p, layer=layer, head=head, query=-1, key=io)
    qk_seconds = time.perf_counter() - start
    qk_s = qk_attribution(p, layer=layer, head=head, query=-1, key=s)
    prefer, prefer_sum = preference(qk_io, qk_s, args.top)
    nodes = p.nodes
    answer_id = m.encode(args.answer, False)[0].item()
    logit = nodes.loc[(nodes["kind"] == "logit") & (nodes["feature"] == answer_id), "node_id"]
    loadings = []
    if len(logit):
        target = logit.iat[0]
        embedding = nodes.loc[(nodes["kind"] == "embedding") & (nodes["position"] == io), "node_id"].iat[0]
        loadings.append(loadings_record(p, embedding, target, args.top))
        links = p.links
        at_io = set(p.kept_nodes.loc[(p.kept_nodes["position"] == io) & (p.kept_nodes["kind"] != "embedding"),
                                     "node_id"])
        into = links[(links["target"] == target) & links["source"].isin(at_io)]
        if len(into):
            loadings.append(loadings_record(p, into["source"].iat[0], target, args.top))
    return {
        "machine": {"cpu": common.cpu_model(), "load_average": common.load_average(),
                    "threads": torch.get_num_threads(), "torch": torch.__version__},
        "model": m.name, "set": args.set, "set_repr": repr(ts) if args.set != "bundled" else ", ".join(BUNDLED_PAIR),
        "prompt": args.prompt, "tokens": p.tokens, "answer": args.answer, "wrong": args.wrong,
        "answer_position": io, "wrong_position": s, "graph": repr(p), "graph_seconds": round(build, 1),
        "name_mover": chosen, "top_heads": top_heads,
        "qk_answer": {**qk_io.to_json(args.top), "seconds": round(qk_seconds, 2), "pairs_sum": float(
            qk_io.pairs["contribution"].sum()), "query_side": side_rows(qk_io.query_side, args.top),
            "key_side": side_rows(qk_io.key_side, args.top), "n_query_nodes": len(qk_io.query_side),
            "n_key_nodes": len(qk_io.key_side)},
        "qk_wrong": {**qk_s.to_json(args.top), "key_side": side_rows(qk_s.key_side, args.top)},
        "preference": {"score_difference": qk_io.score - qk_s.score, "sum_of_parts": prefer_sum, "top": prefer},
        "head_loadings": loadings,
    }


def fmt(x: float) -> str:
    return f"{x:+.3f}"


def node_text(r: dict, tokens: list[str]) -> str:
    where = f" at {r['position']} ({tokens[r['position']]!r})" if r["position"] >= 0 else ""
    label = f": {r['label']}" if r.get("label") and r["kind"] == "feature" else ""
    return f"`{r['node']}` {r['kind']}{where}{label}"


def markdown(res: dict) -> str:
    tok = res["tokens"]
    nm = res["name_mover"]
    qa, qw = res["qk_answer"], res["qk_wrong"]
    out = [f"SmolLM2-135M-Instruct, set `{res['set']}` ({res['set_repr']}), prompt {res['prompt']!r} "
           f"({len(tok)} tokens with the prepended {tok[0]!r}); graph pruned at 0.8 / 0.98: {res['graph']}. "
           f"Measured on {res['machine']['cpu']}, {res['machine']['threads']} threads, load average "
           f"{res['machine']['load_average']} (bench/studies/qk_example.py).", "",
           f"**The name mover.** Heads by direct logit attribution to logit({res['answer']!r}) − "
           f"logit({res['wrong']!r}) at the last position, with their attention from the last position to the "
           f"answer ({res['answer_position']}) and to the wrong name ({res['wrong_position']}):", "",
           common.markdown_table(["head", "attribution", f"pattern → {res['answer']!r}", f"pattern → {res['wrong']!r}"],
                                 [[f"L{r['layer']}H{r['head']}", fmt(r["dla"]), f"{r['to_answer']:.3f}",
                                   f"{r['to_wrong']:.3f}"] for r in res["top_heads"]]), "",
           f"Chosen: **L{nm['layer']}H{nm['head']}**, the largest attribution among the heads that give the answer's "
           f"position a weight of {MIN_ATTENTION} or more, and more than the wrong name's.", "",
           f"**Why it looks at {res['answer']!r}.** Score {qa['score']:.4f} (pattern {qa['pattern']:.3f}); the "
           f"pairs sum to {qa['pairs_sum']:.4f} (the graph's linear model; {qa['n_query_nodes']} query-side x "
           f"{qa['n_key_nodes']} key-side nodes, computed in {qa['seconds']} s). The largest pairs:", "",
           common.markdown_table(["query node", "key node", "contribution"],
                                 [[p["query_node"] + (f" ({p['query_label']})" if p["query_label"] else ""),
                                   p["key_node"] + (f" ({p['key_label']})" if p["key_label"] else ""),
                                   fmt(p["contribution"])] for p in qa["pairs"]]), "",
           "The largest query-side nodes (each summed over the key side) and key-side nodes:", "",
           common.markdown_table(["query side", "contribution", "key side", "contribution"],
                                 [[node_text(a, tok), fmt(a["contribution"]), node_text(b, tok),
                                   fmt(b["contribution"])] for a, b in zip(qa["query_side"], qa["key_side"],
                                                                           strict=False)]), "",
           f"**{res['answer']!r} rather than {res['wrong']!r}.** The score at the wrong name's position is "
           f"{qw['score']:.4f} (pattern {qw['pattern']:.3f}); the difference "
           f"{res['preference']['score_difference']:.4f} splits over the query-side nodes as scale · q_i · "
           f"(k_answer − k_wrong) (sum {res['preference']['sum_of_parts']:.4f}):", "",
           common.markdown_table(["query-side node", "part of the difference"],
                                 [[node_text(r, tok), fmt(r["contribution"])] for r in res["preference"]["top"]]),
           ""]
    for hl in res["head_loadings"]:
        out += [f"**Head loadings of `{hl['source']}` → `{hl['target']}`** (edge {hl['edge']:+.4f}; through "
                f"heads in sum {hl['through_heads']:+.4f}; one-hop part {hl['one_hop']:+.4f}; through two heads or "
                f"more {hl['multi_head']:+.4f}, a share of {hl['multi_head_share']:.2f}; {hl['seconds']} s):", "",
                common.markdown_table(["head", "loading", "of it one-hop"],
                                      [[f"L{r['layer']}H{r['head']}", fmt(r["weight"]), fmt(r["one_hop"])]
                                       for r in hl["heads"]]), ""]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--set", default="plt", help="plt (the prepared full set), clt, or bundled (the pair)")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--answer", default=" Mary")
    parser.add_argument("--wrong", default=" John")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--max-feature-nodes", type=int, default=None,
                        help="keep the graph's most influential features (the app keeps 4,096)")
    parser.add_argument("--out", default=str(RESULTS / "qk_example"), help="path without suffix: .json and .md")
    args = parser.parse_args()
    res = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2, default=str))
    out.with_suffix(".md").write_text(markdown(res) + "\n")
    print(markdown(res))


if __name__ == "__main__":
    main()
