"""`slmviz train-sae ...` and `slmviz evaluate-sae ...` (slmviz/cli.py adds these subcommands)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any

# chat / mixed / balanced: the model's own text (corpora.generated), written once per model and cached
CORPORA = {"broad": "the broad corpus's training split (corpora.broad.broad_corpus)",
           "chat": "the model's own chat and prose", "mixed": "broad and chat interleaved",
           "broad-heldout": "broad's held-out split", "chat-heldout": "chat's held-out split",
           "balanced": "half broad (thinned), half chat", "mixed-heldout": "mixed's held-out split",
           "balanced-heldout": "balanced's held-out split", "bible": "the bundled King James Bible"}


def add_parsers(sub: Any) -> None:
    t = sub.add_parser("train-sae", help="train an SAE or transcoder on a model's activations (resumable)")
    t.add_argument("--model", default=None, help="bundled model name, folder or hub id (default: SmolLM2-135M)")
    t.add_argument("--hook", required=True, help="the hook it reads, e.g. blocks.15.hook_resid_post")
    t.add_argument("--hook-out", default=None, help="a transcoder's target, e.g. blocks.3.hook_mlp_out")
    t.add_argument("--corpus", required=True, help=f"a .txt/.jsonl/.parquet path, or one of {', '.join(CORPORA)}")
    t.add_argument("--d-sae", type=int, required=True)
    t.add_argument("--k", type=int, required=True, help="active features per token (TopK) or on average (BatchTopK)")
    t.add_argument("--tokens", type=int, required=True, help="tokens (activation rows) to train on")
    t.add_argument("--out", required=True, help="folder: checkpoints while training, the SAE at the end")
    t.add_argument("--architecture", default="topk", choices=["topk", "batchtopk"])
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--batch-tokens", type=int, default=4096)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default=None, help="where the SAE trains (default: the model's device)")
    t.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: measured (bf16 if faster)")
    t.add_argument("--window", type=int, default=128)
    t.add_argument("--forward-tokens", type=int, default=1024)
    t.add_argument("--buffer-tokens", type=int, default=65_536)
    t.add_argument("--dead-window", type=int, default=500_000)
    t.add_argument("--lr-decay", type=float, default=0.2)
    t.add_argument("--checkpoint-every", type=float, default=120.0, help="seconds between checkpoints")
    t.add_argument("--skip", action="store_true", help="a skip transcoder: + a learned linear map of the input")
    t.add_argument("--no-progress", action="store_true")

    s = sub.add_parser("train-transcoders", help="train a transcoder at every layer from one forward per batch "
                       "(resumable)")
    s.add_argument("--model", default=None, help="bundled model name, folder or hub id (default: SmolLM2-135M)")
    s.add_argument("--layers", default="all", help="'all' or comma-separated layer indices")
    s.add_argument("--corpus", required=True, help=f"a .txt/.jsonl/.parquet path, or one of {', '.join(CORPORA)}")
    s.add_argument("--d-sae", type=int, required=True)
    s.add_argument("--k", type=int, required=True)
    s.add_argument("--tokens", type=int, required=True, help="tokens (activation rows) per layer")
    s.add_argument("--out", required=True, help="folder: checkpoints while training, the set at the end")
    s.add_argument("--kind", default="plt", choices=["plt", "clt"],
                   help="plt: a transcoder per layer; clt: one cross-layer transcoder over every layer")
    s.add_argument("--architecture", default="batchtopk", choices=["topk", "batchtopk"])
    s.add_argument("--no-skip", action="store_true", help="plain transcoders (default: skip transcoders)")
    s.add_argument("--lr", type=float, default=1e-3)
    s.add_argument("--batch-tokens", type=int, default=512)
    s.add_argument("--buffer-tokens", type=int, default=16_384)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: measured (bf16 if faster)")
    s.add_argument("--format", default="slmviz", choices=["slmviz", "circuit-tracer"],
                   help="also write the finished set in this layout, into OUT/circuit-tracer when not slmviz")
    s.add_argument("--no-progress", action="store_true")

    e = sub.add_parser("evaluate-sae", help="SAEBench's core metrics of an SAE on a corpus (prints JSON)")
    e.add_argument("sae", help="SAE folder, or the name of a bundled SAE of --model")
    e.add_argument("--model", default=None)
    e.add_argument("--corpus", required=True, help=f"a .txt/.jsonl/.parquet path, or one of {', '.join(CORPORA)}")
    e.add_argument("--tokens", type=int, default=100_000, help="real tokens to evaluate (0: the whole corpus)")
    e.add_argument("--window", type=int, default=128)
    e.add_argument("--batch-tokens", type=int, default=512)
    e.add_argument("--json", default=None, help="also write the metrics to this file")
    e.add_argument("--no-progress", action="store_true")


def resolve_corpus(name: str, model: Any = None) -> Any:
    """A named corpus (CORPORA) as a path (chat, mixed and balanced are `model`'s own), or the argument itself."""
    from ..corpora.named import NAMES
    from ..corpora.named import resolve_corpus as named

    base, _, split = name.partition("-")
    if base in NAMES and split in ("", "heldout"):
        return str(named(base, model, split or "train"))
    if name == "bible":
        from ..corpora.verses import bundled_corpus_path

        return str(bundled_corpus_path())
    return name


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    import slmviz

    model = slmviz.load(args.model)
    if args.command == "train-transcoders":
        from .train import train_transcoders

        argv = sys.argv[1:] if argv is None else argv
        layers = "all" if args.layers == "all" else [int(x) for x in args.layers.split(",")]
        corpus = resolve_corpus(args.corpus, model)
        ts = train_transcoders(
            model, layers=layers, corpus=corpus, d_sae=args.d_sae, k=args.k, tokens=args.tokens, out=args.out,
            kind=args.kind, skip=not args.no_skip, architecture=args.architecture, lr=args.lr,
            batch_tokens=args.batch_tokens, buffer_tokens=args.buffer_tokens, seed=args.seed, dtype=args.dtype,
            progress=not args.no_progress,
            metadata={"training_command": "slmviz " + shlex.join(argv), "corpus_name": args.corpus})
        if args.format != "slmviz":
            ts.save(f"{args.out}/{args.format}", format=args.format)
        print(f"saved {ts!r} to {args.out}")
        return 0
    if args.command == "train-sae":
        from .train import train_sae

        argv = sys.argv[1:] if argv is None else argv
        sae = train_sae(
            model, hook=args.hook, corpus=resolve_corpus(args.corpus, model), d_sae=args.d_sae, k=args.k,
            tokens=args.tokens, out=args.out, hook_out=args.hook_out, architecture=args.architecture, lr=args.lr,
            batch_tokens=args.batch_tokens, seed=args.seed, device=args.device, dtype=args.dtype,
            progress=not args.no_progress, window=args.window, forward_tokens=args.forward_tokens,
            buffer_tokens=args.buffer_tokens, dead_window=args.dead_window, lr_decay=args.lr_decay,
            checkpoint_every=args.checkpoint_every, skip=args.skip,
            metadata={"training_command": "slmviz " + shlex.join(argv), "corpus_name": args.corpus},
        )
        print(f"saved {sae!r} to {args.out}")
        return 0
    from ..features.bundled import bundled_sae_folder
    from ..features.evaluate import evaluate_sae
    from ..features.load import load_sae

    sae = load_sae(bundled_sae_folder(args.sae, model) or args.sae, model=model)
    metrics = evaluate_sae(sae, resolve_corpus(args.corpus, model), model=model, tokens=args.tokens or None,
                           window=args.window, batch_tokens=args.batch_tokens, progress=not args.no_progress)
    text = json.dumps(metrics, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0
