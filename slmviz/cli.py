"""`slmviz check | trace | prepare | app | scan | train-sae | train-transcoders | evaluate-sae`."""

from __future__ import annotations

import argparse
import sys

CHECK_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who every morning",
]
LOGIT_TOL = 1e-4
RESID_TOL = 1e-5
PATTERN_TOL = 1e-5
GENERATE_TOKENS = 16  # greedy tokens compared with transformers' generate (fp32)
# Names people type for checkpoints the hub keeps under an owner now (a folder of that name wins).
HUB_ALIASES = {"gpt2": "openai-community/gpt2", "gpt2-medium": "openai-community/gpt2-medium"}
# In bf16 the tolerances are measured, not fixed: transformers' own eager-vs-sdpa difference on the same prompt.
# Patterns have no sdpa counterpart (sdpa returns none); theirs is one bf16 step of a probability in [0.5, 1).
PATTERN_TOL_BF16 = 2.0**-8


def check(model_path: str | None, prompts: list[str], out=None, dtype: str = "float32") -> bool:
    """Run slmviz and transformers side by side; print per-layer max differences; True if all match.

    What it checks, per prompt: every block's output (hook_resid_post against transformers' hidden states,
    relative error), every attention pattern (max |Δ|), the logits (max |Δ| and identical argmax); in float32 also
    that cached greedy decoding gives transformers' `generate` tokens (GENERATE_TOKENS of them). `model_path` is a
    folder, a hub id, or a bare name in HUB_ALIASES ("gpt2").

    `dtype`: both run in it. In float32 the tolerances are the fixed ones above. In bfloat16 / float16 each
    prompt's tolerance is what transformers' own two attention implementations (eager, sdpa) differ by on that
    prompt in that dtype: the logits' and the largest residual's relative error, and the share of positions
    where their argmax agrees; slmviz must be at least that close to transformers' eager run.
    `out` defaults to sys.stdout as it is when called (a default bound at import would keep printing to
    whatever stdout was then, e.g. a test's closed capture)."""
    out = out or sys.stdout
    from pathlib import Path

    import torch

    import slmviz

    from .hooks import layer_hook_name
    from .loading.reference import load_reference, reference_generate, relative_error, run_reference

    if model_path in HUB_ALIASES and not Path(model_path).exists():
        model_path = HUB_ALIASES[model_path]
    model = slmviz.load(model_path, dtype=dtype)
    exact = model.dtype == torch.float32
    hf = load_reference(model.path, dtype=model.dtype, device=model.device)
    sdpa = None if exact else load_reference(model.path, "sdpa", dtype=model.dtype, device=model.device)
    dtype_name = str(model.dtype).removeprefix("torch.")
    ok = True
    print(f"slmviz check: {model!r}\nreference: transformers {_version()} eager attention, {dtype_name}", file=out)
    if not exact:
        print("tolerance: transformers' own eager-vs-sdpa difference in the same dtype, measured per prompt", file=out)
    print(file=out)
    for prompt in prompts:
        ids = model.encode(prompt)
        ours = model.trace(ids, names=lambda n: n.endswith(("hook_resid_post", "hook_pattern")))
        ref = run_reference(hf, ids)
        if exact:
            resid_tol, pattern_tol, logit_tol, agree_tol = RESID_TOL, PATTERN_TOL, None, 1.0
        else:
            other = run_reference(sdpa, ids, attentions=False)
            resid_tol = max(relative_error(a, b) for a, b in zip(ref.resid_post, other.resid_post, strict=True))
            logit_tol = relative_error(ref.logits, other.logits)
            agree_tol = float((ref.logits.argmax(-1) == other.logits.argmax(-1)).float().mean())
            pattern_tol = PATTERN_TOL_BF16
        print(f"prompt ({ids.numel()} tokens): {prompt[:60]!r}", file=out)
        print(f"  {'layer':>5}  {'resid rel err':>13}  {'pattern max |Δ|':>15}", file=out)
        for layer in range(model.cfg.n_layers):
            r = relative_error(ref.resid_post[layer], ours[layer_hook_name(layer, "hook_resid_post")])
            pattern = ours[layer_hook_name(layer, "attn.hook_pattern")].to(ref.patterns[layer].device)
            p = float((ref.patterns[layer].float() - pattern.float()).abs().max())
            flag = "" if (r <= resid_tol and p <= pattern_tol) else "  MISMATCH"
            ok &= not flag
            print(f"  {layer:>5}  {r:>13.2e}  {p:>15.2e}{flag}", file=out)
        ours_logits = ours.logits.to(ref.logits.device)
        agree = float((ref.logits.argmax(-1) == ours_logits.argmax(-1)).float().mean())
        if exact:
            dlogit = float((ref.logits - ours_logits).abs().max())
            good = dlogit <= LOGIT_TOL and agree == 1.0
            print(f"  logits: max |Δ| = {dlogit:.2e} (tol {LOGIT_TOL:g}), argmax identical at every position: "
                  f"{agree == 1.0}{'' if good else '  MISMATCH'}", file=out)
            theirs = reference_generate(hf, ids, GENERATE_TOKENS)
            mine = model.generate_ids(ids, len(theirs), stop_at_eos=False)
            same = mine == theirs
            good &= same
            print(f"  cached greedy decoding, {len(theirs)} tokens: equal to transformers' generate: {same}"
                  f"{'' if same else '  MISMATCH'}\n", file=out)
        else:
            rel = relative_error(ref.logits, ours_logits)
            good = rel <= logit_tol and agree >= agree_tol
            print(f"  residual tolerance (eager vs sdpa, largest layer): {resid_tol:.2e}", file=out)
            print(f"  logits: rel err {rel:.2e} (eager vs sdpa: {logit_tol:.2e}), argmax agreement {agree:.0%} "
                  f"(eager vs sdpa: {agree_tol:.0%}){'' if good else '  MISMATCH'}\n", file=out)
        ok &= good
    print("OK: slmviz matches transformers" if ok else "FAILED: slmviz differs from transformers", file=out)
    return ok


def prepare(names: list[str] | None, force: bool = False, out=None) -> int:
    """Prepare each bundled model (all by default), one progress line per step, so a first `make model`
    says what its minute of dequantizing is spent on.

    Several models are prepared at once, one process each, when they print to the real stdout: each conversion
    runs on one core most of the time (GGUF dequantization, the tokenizer's conversion, the safetensors write),
    so on a 2-core machine SmolLM2's runs inside Gemma's instead of before it."""
    out = out or sys.stdout
    from .loading.bundled import bundled_models, is_prepared, model_dir

    names = names or bundled_models()
    todo = []
    for i, name in enumerate(names, 1):
        if name not in bundled_models():
            raise KeyError(f"{name!r} is not a bundled model; bundled models are: {', '.join(bundled_models())}")
        if is_prepared(model_dir(name)) and not force:
            print(f"[{i}/{len(names)}] {name}: ready at {model_dir(name)}", file=out, flush=True)
            continue
        print(f"[{i}/{len(names)}] {name}: preparing (once)", file=out, flush=True)
        todo.append(name)
    if len(todo) > 1 and out is sys.stdout:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # spawn: a forked child would inherit this process's torch thread pool and its locks
        with ProcessPoolExecutor(len(todo), mp_context=multiprocessing.get_context("spawn")) as pool:
            for done in [pool.submit(_prepare_one, name, force) for name in todo]:
                done.result()  # re-raises a child's error here
    else:
        for name in todo:
            _prepare_one(name, force, out)
    return 0


def _prepare_one(name: str, force: bool, out=None) -> None:
    """loading.bundled.prepare(name), its log lines printed to `out` (stdout) under the model's name."""
    from .loading.bundled import prepare as prepare_bundled

    out = out or sys.stdout
    prepare_bundled(name, force=force, log=lambda line: print(f"    {name}: {line}", file=out, flush=True))


def _version() -> str:
    import transformers

    return transformers.__version__


def _app_launcher():
    """The app's `launch`: from the installed package `slmviz_app` (the wheel ships app/ under that name), or from
    a checkout's `app/` folder when slmviz runs from source without being installed."""
    try:
        from slmviz_app.main import launch
    except ModuleNotFoundError as e:
        if e.name != "slmviz_app":
            raise
        from app.main import launch
    return launch


def main(argv: list[str] | None = None) -> int:
    from . import __version__

    parser = argparse.ArgumentParser(prog="slmviz", description="Look inside a small language model.")
    parser.add_argument("--version", action="version", version=f"slmviz {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p_check = sub.add_parser("check", help="compare slmviz with transformers on the same weights")
    p_check.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                         help="model folder or hub id, e.g. gpt2, EleutherAI/pythia-160m, google/gemma-2-2b")
    p_check.add_argument("--model", default=None, help="model folder or hub id (default: bundled SmolLM2-135M)")
    p_check.add_argument("--prompt", action="append", help="prompt to check (repeatable)")
    p_check.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                         help="run both in this dtype (default float32; float16 on CUDA only)")

    p_trace = sub.add_parser("trace", help="trace a prompt and print the next-token prediction")
    p_trace.add_argument("prompt")
    p_trace.add_argument("--model", default=None)
    p_trace.add_argument("--variant", default=None, help="preset name, e.g. post_norm")
    p_trace.add_argument("--save", default=None, help="write the trace to this .safetensors file")

    from .replacement.prepared import PREPARED

    p_prepare = sub.add_parser("prepare", help="dequantize the bundled models into the cache (once each)")
    p_prepare.add_argument("--model", action="append", help="only this bundled model (repeatable; default: all)")
    p_prepare.add_argument("--force", action="store_true", help="dequantize again even if the folder is ready")
    p_prepare.add_argument("--transcoders", default=None, choices=list(PREPARED),
                           help="also train this bundled model's prepared transcoder set into the cache: plt (the "
                                "full set), plt-quick (minutes), clt (resumable; docs/features.md says how long each "
                                "takes)")

    p_app = sub.add_parser("app", help="start the Gradio app")
    p_app.add_argument("--port", type=int, default=None, help="default: $GRADIO_SERVER_PORT or 7860")
    p_app.add_argument("--host", default="127.0.0.1")
    p_app.add_argument("--model", default=None, help="hub id (or a local folder with --allow-local-models)")
    p_app.add_argument("--allow-local-models", action="store_true", help="let the app load local folders")

    from .scans import cli as scan_cli

    scan_cli.add_parser(sub)
    from .training import cli as training_cli

    training_cli.add_parsers(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "scan":
            return scan_cli.run(args)
        if args.command in ("train-sae", "evaluate-sae", "train-transcoders"):
            return training_cli.run(args, argv)
        if args.command == "check":
            model = args.model_arg or args.model
            return 0 if check(model, args.prompt or CHECK_PROMPTS, dtype=args.dtype) else 1
        if args.command == "trace":
            import slmviz

            t = slmviz.load(args.model).trace(args.prompt, variant=args.variant)
            print(t)
            print(t.top_tokens().to_string(index=False))
            if args.save:
                print(f"saved {t.save(args.save)}")
            return 0
        if args.command == "prepare":
            if args.transcoders:  # only the models the sets are for (Gemma's minute of dequantizing is not SmolLM2's)
                import slmviz

                from .training.prepare import prepare_transcoders

                names = args.model or [slmviz.bundled_models()[0]]
                code = prepare(names, args.force)
                for name in names:
                    ts = prepare_transcoders(slmviz.load(name), args.transcoders)
                    print(f"{name}: {ts!r} ready (slmviz.load_transcoders({args.transcoders!r}, model=m))")
                return code
            return prepare(args.model, args.force)
        if args.command == "app":
            launch = _app_launcher()
            launch(port=args.port, host=args.host, allow_local_models=args.allow_local_models, model=args.model,
                   exit_on_interrupt=True)
            return 0
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"slmviz {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
