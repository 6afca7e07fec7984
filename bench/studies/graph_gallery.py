"""The Graph tab's gallery of example prompts: which candidate prompts each bundled model answers right, and the
probability of its answer, measured as the Graph tab's graph sees the prompt (with the special token that
attribution_graph puts in front: slmviz.graphs.attribution.prepend_special).

For every model in MODELS and every candidate (prompt, the answer a person expects) it records the model's top
next token and its probability, and the expected answer's probability and rank. The prompts a model answers
right (its top token is the expected one) go into app/graph_gallery.json, which the tab offers, with the measured
probability; the whole table goes to bench/results/graph_gallery.md, the misses included (a miss says what the
model says instead).

Run: .venv/bin/python bench/studies/graph_gallery.py [--models SmolLM2-135M-Instruct gemma-3-270m]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402,F401  (this checkout first on sys.path)
import torch  # noqa: E402

import slmviz  # noqa: E402
from slmviz.graphs.attribution import prepend_special  # noqa: E402

MODELS = ["SmolLM2-135M-Instruct", "gemma-3-270m"]
CANDIDATES = [
    ("The capital of France is", " Paris"),
    ("The capital of Japan is", " Tokyo"),
    ("The Eiffel Tower is in the city of", " Paris"),
    ("The capital of the state containing Dallas is", " Austin"),
    ("The opposite of hot is", " cold"),
    ("The opposite of up is", " down"),
    ("One, two, three, four,", " five"),
    ("Monday, Tuesday, Wednesday,", " Thursday"),
    ("January, February, March,", " April"),
    ("A, B, C, D,", " E"),
    ("Roses are red, violets are", " blue"),
    ("The first president of the United States was George", " Washington"),
    ("The sun rises in the", " east"),
    ("The chemical symbol for gold is", " Au"),
    ("When Mary and John went to the store, John gave a drink to", " Mary"),
    ("The cat sat on the mat. The dog slept on the rug. The cat sat on the", " mat"),
    ("Water is made of hydrogen and", " oxygen"),
    ("The largest planet in our solar system is", " Jupiter"),
]
GALLERY = common.REPO / "app" / "graph_gallery.json"
TABLE = common.RESULTS / "graph_gallery.md"


def measure(model, prompt: str, expected: str) -> dict:
    ids = prepend_special(model.tokenizer, model.encode(prompt))
    with torch.no_grad():
        probs = torch.softmax(model.logits(ids)[-1].float(), dim=-1)
    top = int(probs.argmax())
    want = model.tokenizer(expected, add_special_tokens=False)["input_ids"]
    first = int(want[0])
    return {"prompt": prompt, "expected": expected, "top": model.to_strings([top])[0],
            "p_top": round(float(probs[top]), 4), "p_expected": round(float(probs[first]), 4),
            "rank_expected": int((probs > probs[first]).sum()), "right": top == first and len(want) == 1}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=MODELS)
    args = ap.parse_args()
    gallery, lines = {}, ["| model | prompt | expected | top token | p(top) | p(expected) | right |",
                          "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in args.models:
        model = slmviz.load(name)
        rows = [measure(model, p, e) for p, e in CANDIDATES]
        gallery[model.name] = [{"prompt": r["prompt"], "answer": r["expected"], "p": r["p_top"]}
                               for r in rows if r["right"]]
        for r in rows:
            lines.append(f"| {model.name} | {r['prompt']} | {r['expected']!r} | {r['top']!r} | {r['p_top']:.3f} | "
                         f"{r['p_expected']:.3f} (rank {r['rank_expected']}) | {'yes' if r['right'] else 'no'} |")
        print(f"{model.name}: {len(gallery[model.name])} of {len(rows)} answered right")
    GALLERY.write_text(json.dumps(gallery, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    TABLE.write_text("# The Graph tab's gallery: the bundled models' answers\n\n"
                     "`bench/studies/graph_gallery.py`: each candidate prompt with the special token the graph puts "
                     "in front; a prompt is in the gallery (app/graph_gallery.json) when the model's top token is "
                     f"the expected answer. Machine: {common.cpu_model()}.\n\n"
                     + "\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
