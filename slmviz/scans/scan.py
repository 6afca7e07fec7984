"""`slmviz.scan`: what a neuron or head responds to across a corpus, and the `Scan` it returns.

    s = slmviz.scan("docs.jsonl", hooks=["blocks.6.mlp.hook_post"], top_k=20, model=m)
    s.top_examples("blocks.6.mlp.hook_post", 123)     # rank, doc, position, token, activation, context
    s.mean("blocks.6.mlp.hook_post")                  # [d_mlp] mean over every token of the corpus
    s.save("scan/"); slmviz.Scan.load("scan/")

A scan is a map over shards of documents (shards.run_shard: each shard's padded batches through
batches.run_batch, reduced in order) and an in-order reduce of the shards (reduce.py): memory holds
one batch's activations and the running statistics, never the corpus's. `engine="local"` runs the shards
in this process; `engine="ray"` on a Ray Data actor pool (ray_engine.py) whose actors read their own shards,
with the same code and the same reduce, so the two give identical results.
What each hook's features are (a neuron, a head's norm, a head's strongest look back) is in units.py.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from ..corpora.reading import Corpus, count_documents, iter_documents, shard_sources
from ..hooks import checked_saes
from ..progress import ProgressLike, as_progress
from ..variants import VariantLike, resolve_variant
from .batches import ScanSpec, row_rules
from .reduce import EDGES, EMPTY_KEY, POSITION_BITS, DamageTotals, HookPartial, key_doc, key_position
from .shards import SHARD_DOCS, Shard, ShardResult, empty_partials, iter_shards, run_shard
from .units import feature_of

if TYPE_CHECKING:
    from ..model_api import Model

ENGINES = ("local", "ray")
DEFAULT_WINDOW = 256
DEFAULT_BATCH_TOKENS = 1024  # padded tokens per forward: this CPU's peak tokens/s is at 512-1024 (bench/perf/scan.py)
# With variants every batch also holds two [tokens, vocab] fp32 logits (faithful and variant): 2 x 512 x 49152
# x 4 bytes = 0.2 GB on SmolLM2, where 2048 tokens would need 0.8 GB.
DAMAGE_BATCH_TOKENS = 512
FORMAT_VERSION = 1


class ScanFormatError(ValueError):
    """A folder that is not a saved Scan (or one of another format version)."""


def scan(
    corpus: Corpus,
    hooks: str | Sequence[str],
    top_k: int = 20,
    model: Model | None = None,
    engine: str = "local",
    variants: Sequence[VariantLike] | str | None = None,
    window: int = DEFAULT_WINDOW,
    batch_tokens: int | None = None,
    limit: int | None = None,
    workers: int = 1,
    progress: ProgressLike = True,
    context: tuple[int, int] = (12, 4),
    saes: Sequence[Any] | None = None,
) -> Scan:
    """Scan `corpus` (list of str, or a .txt / .jsonl / .parquet path) for the features of `hooks`.

    top_k: contexts kept per feature. variants: presets (or Variants) whose damage (KL from faithful,
    top-1 agreement) is measured per document. window: documents longer than this many tokens are cut
    into windows. batch_tokens: padded tokens per forward (default DEFAULT_BATCH_TOKENS, or
    DAMAGE_BATCH_TOKENS with variants: their logits are big). limit: read at most this many documents.
    workers: Ray actors (engine="ray"). progress: slmviz.progress's contract, counted in documents: a tqdm bar
    (True), none (False/None), fn(ProgressUpdate), or a Progress part of a caller's job (a pass of several: "scan 2/4").
    context: tokens kept before and after each top example.
    saes: SAEs spliced into every forward (slmviz.load_sae); scan their features with
    hooks=[f"{sae.hook_name_out}.hook_sae_acts_post"]. Those features are 0 on the rows the SAE's `shown_rows`
    drops (each window's first position and massive rows: the rule training and evaluate_sae use), so a feature's
    top contexts and density are not the attention sink's; info["sae_rows"] lists the hooks it applied to.
    """
    from ..model_api import load

    model = model or load()
    hook_list = [hooks] if isinstance(hooks, str) else list(hooks)
    if not hook_list:
        raise ValueError("scan() needs at least one hook name, e.g. hooks=['blocks.0.mlp.hook_post']")
    sae_list = tuple(checked_saes(saes, model.hook_names))
    features = {h: feature_of(h, model.hook_names, model.cfg, sae_list) for h in dict.fromkeys(hook_list)}
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    names, resolved = _variants(variants)
    if batch_tokens is None:
        batch_tokens = DAMAGE_BATCH_TOKENS if resolved else DEFAULT_BATCH_TOKENS
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    if engine == "ray":
        from .ray_engine import import_ray, run_on_ray

        import_ray()  # a missing extra fails before any work, with the install line
    if window < 1:
        raise ValueError(f"window must be >= 1 token, got {window}")
    window = min(window, model.cfg.context_length)  # a window is one forward: never past the context
    spec = ScanSpec(tuple(features), top_k, resolved, names, context_before=context[0], context_after=context[1],
                    window=window, batch_tokens=batch_tokens, saes=sae_list)
    total = count_documents(corpus, limit)
    acc = empty_partials(model, spec, features)
    damage = DamageTotals(len(resolved))
    tally = {"documents": 0, "windows": 0, "tokens": 0, "batches": 0}

    start = time.perf_counter()
    bar = as_progress(progress, f"scan ({engine})")

    def report(n: int) -> None:
        bar.update(n, total, unit="doc")

    def absorb(result: ShardResult) -> None:
        """Merge one shard's result (called in shard order by both engines)."""
        for h, part in result.hooks.items():
            acc[h] = acc[h].merge(part)
        if result.damage is not None:
            damage.add(result.damage)
        for k, v in (("documents", result.n_docs), ("windows", result.windows), ("tokens", result.tokens),
                     ("batches", result.batches)):
            tally[k] += v
        report(tally["documents"])

    if engine == "local":
        for shard in iter_shards(iter_documents(corpus, limit), SHARD_DOCS):
            def batch_done(fraction: float, shard: Shard = shard) -> None:  # progress within a shard
                report(shard.first_doc + int(fraction * len(shard.texts)))

            absorb(run_shard(model, shard, spec, features, batch_done))
    else:
        run_on_ray(model, shard_sources(corpus, limit, SHARD_DOCS), spec, absorb, workers)
    seconds = time.perf_counter() - start

    used = torch.unique(torch.cat([p.top_ids.flatten() for p in acc.values()]))
    used = used[used >= 0].tolist()
    tokens = dict(zip(used, model.to_strings(used), strict=True))
    info = {
        "model": model.name, "engine": engine, "documents": tally["documents"], "windows": tally["windows"],
        "tokens": tally["tokens"], "batches": tally["batches"], "seconds": seconds,
        "tokens_per_s": tally["tokens"] / seconds if seconds > 0 else 0.0, "window": window,
        "batch_tokens": batch_tokens, "top_k": top_k, "context_before": context[0], "context_after": context[1],
        "variants": list(names), "saes": [repr(sae) for sae in sae_list],
        "sae_rows": list(row_rules(spec)),  # SAE feature hooks zeroed on the rows their SAE drops (batches.row_rules)
    }
    features_info = {h: {"axis": f.axis, "n": f.n, "what": f.what} for h, f in features.items()}
    frame = pd.DataFrame(damage.rows(list(names)), columns=DAMAGE_COLUMNS)
    return Scan(info, features_info, acc, tokens, frame)


DAMAGE_COLUMNS = ["doc", "variant", "tokens", "kl_mean", "top1_agree"]
EXAMPLE_COLUMNS = ["rank", "doc", "position", "token", "activation", "context"]


@dataclass
class Scan:
    """The result of `slmviz.scan`. Per hook: feature statistics, a histogram and the top-k contexts.

    Feature statistics (`mean`, `var`, `min`, `max`) are over every token of the corpus, [n_features].
    `value_mean(hook)` is the mean of the hook's value itself, shaped like one position ([h, d_head] for
    z), which is what mean-ablation subtracts. `damage` has one row per (document, variant).
    """

    info: dict[str, Any]
    features: dict[str, dict[str, Any]]  # hook -> axis, n, what
    stats: dict[str, HookPartial]
    tokens: dict[int, str]  # display string of every token id that appears in a kept context
    damage: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=DAMAGE_COLUMNS))

    @property
    def hooks(self) -> list[str]:
        return list(self.stats)

    @property
    def n_tokens(self) -> int:
        """The tokens the scan read (info["tokens"]): a set's deep scan reads at least a million."""
        return int(self.info.get("tokens", 0))

    def __repr__(self) -> str:
        i = self.info
        hooks = ", ".join(f"{h} ({f['n']} × {f['axis']})" for h, f in self.features.items())
        return (f"Scan({i['model']}: {i['documents']} documents, {i['tokens']} tokens, top {i['top_k']}; "
                f"{hooks}; {i['engine']} engine, {i['tokens_per_s']:.0f} tokens/s)")

    def _stats(self, hook: str) -> HookPartial:
        if hook not in self.stats:
            raise KeyError(f"{hook!r} was not scanned; this scan has {self.hooks}")
        return self.stats[hook]

    def _feature(self, hook: str, index: int) -> int:
        n = self.features[hook]["n"] if hook in self.features else self._stats(hook).mean.numel()
        if not isinstance(index, int) or not 0 <= index < n:
            raise IndexError(f"feature index {index!r} out of range: {hook} has {n} features "
                             f"({self.features[hook]['what']})")
        return index

    # --- statistics ---------------------------------------------------------------------------------
    def mean(self, hook: str) -> torch.Tensor:
        """[n_features] float64: each feature's mean over every token."""
        return self._stats(hook).mean

    def var(self, hook: str) -> torch.Tensor:
        """[n_features] float64: population variance over every token."""
        s = self._stats(hook)
        return s.m2 / s.n.clamp_min(1).double()

    def max(self, hook: str) -> torch.Tensor:
        return self._stats(hook).max

    def min(self, hook: str) -> torch.Tensor:
        return self._stats(hook).min

    def value_mean(self, hook: str) -> torch.Tensor | None:
        """The hook's value averaged over every token, shaped like one position (None for patterns)."""
        v = self._stats(hook).value_mean
        return v if v.numel() else None

    def summary(self, hook: str) -> pd.DataFrame:
        """feature, mean, std, min, max: one row per feature."""
        s = self._stats(hook)
        return pd.DataFrame({"feature": range(s.mean.numel()), "mean": s.mean.numpy(),
                             "std": self.var(hook).sqrt().numpy(), "min": s.min.numpy(), "max": s.max.numpy()})

    def histogram(self, hook: str, index: int) -> pd.DataFrame:
        """left, right, count of every non-empty bin (log-spaced edges; see slmviz.scans.reduce.EDGES)."""
        counts = self._stats(hook).hist[self._feature(hook, index)]
        edges = torch.cat([torch.tensor([float("-inf")]), EDGES, torch.tensor([float("inf")])])
        nz = counts.nonzero().flatten()
        return pd.DataFrame({"left": edges[nz].numpy(), "right": edges[nz + 1].numpy(), "count": counts[nz].numpy()})

    def damage_summary(self) -> pd.DataFrame:
        """Per variant: documents, tokens, token-weighted mean KL and top-1 agreement."""
        d = self.damage
        if d.empty:
            return pd.DataFrame(columns=["variant", "documents", "tokens", "kl_mean", "top1_agree"])
        d = d.assign(kl=d.kl_mean * d.tokens, agree=d.top1_agree * d.tokens)
        g = d.groupby("variant", sort=False).agg(documents=("doc", "size"), tokens=("tokens", "sum"),
                                                  kl=("kl", "sum"), agree=("agree", "sum")).reset_index()
        return g.assign(kl_mean=g.kl / g.tokens, top1_agree=g.agree / g.tokens)[
            ["variant", "documents", "tokens", "kl_mean", "top1_agree"]]

    # --- top examples -------------------------------------------------------------------------------
    def top_examples(self, hook: str, index: int) -> pd.DataFrame:
        """The top-k (document, position) pairs of one feature: rank, doc, position, token, activation, context.
        `context` is the text around the token with the token itself in [[ ]]."""
        s, f = self._stats(hook), self._feature(hook, index)
        rows = []
        for rank in range(s.top_val.shape[1]):
            key = s.top_key[f, rank]
            if int(key) == EMPTY_KEY:  # fewer tokens than k
                break
            strip = self.context(hook, index, rank)
            text = "".join(f"[[{t}]]" if here else t for t, _, here in strip)
            token = next(t for t, _, here in strip if here)
            rows.append((rank, int(key_doc(key)), int(key_position(key)), token, float(s.top_val[f, rank]), text))
        return pd.DataFrame(rows, columns=EXAMPLE_COLUMNS)

    def context(self, hook: str, index: int, rank: int) -> list[tuple[str, float, bool]]:
        """(token, activation of this feature, is the example token) for each context token of one example."""
        s, f = self._stats(hook), self._feature(hook, index)
        before = self.info["context_before"]
        ids, acts = s.top_ids[f, rank].tolist(), s.top_acts[f, rank].tolist()
        return [(self.tokens.get(i, f"<{i}>"), a, c == before) for c, (i, a) in enumerate(zip(ids, acts, strict=True))
                if i >= 0]

    # --- figures (slmviz.plots.scan; the app's Corpus tab draws the same) -----------------------------
    def plot_histogram(self, hook: str, index: int):
        """plotly Figure: the feature's activation density over every token of the corpus."""
        from ..plots.scan import histogram

        return histogram(self, hook, index)

    def examples_html(self, hook: str, index: int) -> str:
        """HTML strips of the top examples, coloured by activation (display with IPython.display.HTML)."""
        from ..plots.scan import examples_html

        return examples_html(self, hook, index)

    # --- files --------------------------------------------------------------------------------------
    def save(self, folder: str | os.PathLike) -> Path:
        """Write scan.safetensors (every statistic, exact), tokens.parquet, damage.parquet and a readable
        top_examples.parquet (every feature's top-k as rows; `load` does not need it)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for h, part in self.stats.items():
            tensors.update(part.to_tensors(h))
        meta = {"format": str(FORMAT_VERSION), "info": json.dumps(self.info), "features": json.dumps(self.features)}
        save_file(tensors, str(folder / "scan.safetensors"), metadata=meta)
        pd.DataFrame({"id": list(self.tokens), "token": list(self.tokens.values())}).to_parquet(
            folder / "tokens.parquet", index=False)
        self.damage.to_parquet(folder / "damage.parquet", index=False)
        self.all_top_examples().to_parquet(folder / "top_examples.parquet", index=False)
        return folder

    def all_top_examples(self) -> pd.DataFrame:
        """Every feature's top_examples in one frame (with hook and feature columns), built with array lookups:
        thousands of per-feature DataFrames, or a Python loop over every context token, would take longer than the
        scan of a small corpus."""
        import numpy as np

        before = self.info["context_before"]
        frames = []
        for hook, s in self.stats.items():
            filled = (s.top_key != EMPTY_KEY).numpy()  # unused slots sort last: a feature's used ones come first
            feature, rank = np.nonzero(filled)
            keys = s.top_key.numpy()[filled]
            ids = s.top_ids.numpy()[filled]  # [M, C]
            uniq, inverse = np.unique(ids, return_inverse=True)
            names = np.array([self.tokens.get(int(i), f"<{i}>") if i >= 0 else "" for i in uniq.tolist()],
                             dtype=object)
            strings = names[inverse.reshape(ids.shape)]  # [M, C]
            token = strings[:, before].copy() if len(strings) else np.zeros(0, dtype=object)
            if len(strings):
                strings[:, before] = "[[" + token + "]]"
            frames.append(pd.DataFrame({
                "hook": hook, "feature": feature, "rank": rank, "doc": keys >> POSITION_BITS,
                "position": keys & ((1 << POSITION_BITS) - 1), "token": token,
                "activation": s.top_val.numpy()[filled].astype(np.float64),
                "context": ["".join(row) for row in strings.tolist()]}))
        out = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
        return out.reindex(columns=["hook", "feature", *EXAMPLE_COLUMNS])

    @classmethod
    def load(cls, folder: str | os.PathLike) -> Scan:
        from safetensors import safe_open
        from safetensors.torch import load_file

        folder = Path(folder)
        path = folder / "scan.safetensors"
        if not path.is_file():
            raise FileNotFoundError(
                f"No saved scan in {str(folder)!r} (expected {path.name}; write one with Scan.save)")
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        if meta.get("format") != str(FORMAT_VERSION):
            raise ScanFormatError(
                f"{path} is not a slmviz scan of format {FORMAT_VERSION} (metadata {meta.get('format')!r})")
        tensors = load_file(str(path))
        features = json.loads(meta["features"])
        tokens = pd.read_parquet(folder / "tokens.parquet")
        damage = pd.read_parquet(folder / "damage.parquet")
        return cls(json.loads(meta["info"]), features, {h: HookPartial.from_tensors(tensors, h) for h in features},
                   dict(zip(tokens["id"].tolist(), tokens["token"].tolist(), strict=True)), damage)


# --- helpers --------------------------------------------------------------------------------------
def _variants(variants: Sequence[VariantLike] | str | None) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    if variants is None:
        return (), ()
    items = [v.strip() for v in variants.split(",") if v.strip()] if isinstance(variants, str) else list(variants)
    resolved = tuple(resolve_variant(v) for v in items)
    names = tuple(v if isinstance(v, str) else r.label() for v, r in zip(items, resolved, strict=True))
    return names, resolved
