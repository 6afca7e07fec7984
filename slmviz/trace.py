"""Trace: the result of one traced forward pass — tokens, logits and every captured hook tensor."""

from __future__ import annotations

import json
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .analysis.diff import trace_diff
from .analysis.lens import logit_lens
from .analysis.logit_attribution import logit_attribution
from .config import ArchConfig
from .hooks import RESIDUAL_STAGES, check_names, hook_names, layer_hook_name, layer_of
from .variants import BASE, Variant

FORMAT_VERSION = 1
_UNSCANNED = object()  # Trace._first_nonfinite before the first scan (None means "all finite")
__all__ = ["RESIDUAL_STAGES", "Trace", "TraceFormatError"]


class TraceFormatError(ValueError):
    """A saved trace is from another format version or is not a slmviz trace."""


@dataclass
class Trace:
    """One prompt through one model under one variant. No batch dimension anywhere.

    `t[name]` is the tensor a hook saw (see slmviz.hooks for names and shapes); `t.names` lists what
    was captured. Plots and the notebook display read a Trace; they never run the model.
    """

    tokens: list[str]
    input_ids: torch.Tensor  # [pos]
    logits: torch.Tensor  # [pos, vocab]
    cache: dict[str, torch.Tensor]
    config: ArchConfig
    variant: Variant = BASE
    model_name: str = ""
    # token id -> string for top-token tables; filled by the model, saved with the trace.
    vocab_strings: dict[int, str] = field(default_factory=dict, repr=False)
    _model: Any = field(default=None, repr=False, compare=False)
    _first_nonfinite: Any = field(default=_UNSCANNED, repr=False, compare=False)
    # Hooks computed when first read: name → the captured name it derives from (attn.hook_result from
    # attn.hook_z; see hooks.DERIVED_HOOKS). `_sources` holds sources that were not requested themselves.
    derived: dict[str, str] = field(default_factory=dict, repr=False)
    _sources: dict[str, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    # --- access -----------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.cache and name in self.derived:
            self.cache[name] = self._derive(name)
        if name not in self.cache:
            check_names([name], hook_names(self.config))
            raise KeyError(f"Hook {name!r} was not captured in this trace; trace again with names=[{name!r}, ...]")
        return self.cache[name]

    def _derive(self, name: str) -> torch.Tensor:
        """attn.hook_result [pos, h, d_model] from the layer's hook_z and o_proj's weight."""
        from .model.block import per_head_result

        if self._model is None:
            raise RuntimeError(f"{name} is derived from hook_z and the model's weights, and this trace has no model")
        source = self.derived[name]
        z = self.cache[source] if source in self.cache else self._sources[source]
        layer = layer_of(name)
        w_o = self._model.decoder.params.layers[layer].w_o
        with torch.inference_mode():
            return per_head_result(z, w_o, self.config)

    def __contains__(self, name: str) -> bool:
        return name in self.cache or name in self.derived

    @property
    def names(self) -> list[str]:
        """Every hook this trace holds or derives on demand, in the order the forward pass reached them
        (a derived value right after the value it derives from)."""
        by_source: dict[str, list[str]] = {}
        for name, source in self.derived.items():
            by_source.setdefault(source, []).append(name)
        order: list[str] = []
        for name in [*self.cache, *self._sources]:
            if name in self.cache and name not in order:
                order.append(name)
            order += [d for d in by_source.get(name, []) if d not in order]
        return order

    @property
    def n_layers(self) -> int:
        return self.config.n_layers

    # --- numerical health -------------------------------------------------------------------------
    def first_nonfinite(self) -> str | None:
        """The first hook (in execution order) holding NaN or ±inf, then 'logits'; None if all finite.

        Masked attention scores are -inf by contract and do not count. Scanned once per trace (it reads
        every captured tensor) and remembered: traces are not modified.
        """
        if self._first_nonfinite is _UNSCANNED:
            self._first_nonfinite = self._scan_nonfinite()
        return self._first_nonfinite

    def _scan_nonfinite(self) -> str | None:
        for name in hook_names(self.config):
            if name in self.cache and not _finite(name, self.cache[name]):
                return name
        return None if torch.isfinite(self.logits).all() else "logits"

    @property
    def is_finite(self) -> bool:
        return bool(torch.isfinite(self.logits).all())

    # --- pandas views -----------------------------------------------------------------------------
    def residual_norms(self) -> pd.DataFrame:
        """L2 norm of the residual stream: columns layer, stage (pre|mid|post), position, token, norm."""
        rows = []
        for layer in range(self.n_layers):
            for stage, local in RESIDUAL_STAGES.items():
                name = layer_hook_name(layer, local)
                if name not in self.cache:
                    continue
                norms = self.cache[name].float().norm(dim=-1)
                rows += [(layer, stage, pos, self.tokens[pos], float(n)) for pos, n in enumerate(norms)]
        if not rows:
            raise KeyError("No residual hooks were captured; trace with names=None or lambda n: 'resid' in n")
        return pd.DataFrame(rows, columns=["layer", "stage", "position", "token", "norm"])

    def probs(self, position: int = -1) -> torch.Tensor:
        return torch.softmax(self.logits[position].float(), dim=-1)

    def top_tokens(self, k: int = 5, position: int = -1) -> pd.DataFrame:
        """Next-token prediction at `position`: columns rank, token, token_id, prob, logit."""
        logits = self.logits[position].float()
        if not torch.isfinite(logits).all():
            bad = self.first_nonfinite()
            raise FloatingPointError(f"Logits are not finite (values first stopped being finite at {bad})")
        probs = torch.softmax(logits, dim=-1)
        top = probs.topk(k)
        return pd.DataFrame({
            "rank": range(1, k + 1),
            "token": [self.token_string(int(i)) for i in top.indices],
            "token_id": [int(i) for i in top.indices],
            "prob": [float(p) for p in top.values],
            "logit": [float(logits[i]) for i in top.indices],
        })

    def token_string(self, token_id: int) -> str:
        if token_id not in self.vocab_strings and self._model is not None:
            self.vocab_strings[token_id] = self._model.to_strings([token_id])[0]
        return self.vocab_strings.get(token_id, f"<{token_id}>")

    def logit_lens(self, k: int = 5, start: int = 0) -> pd.DataFrame:
        """Top-k tokens read from each layer's resid_post through the final norm and unembedding
        (positions `start` onwards); see slmviz.analysis.lens.logit_lens for the columns."""
        return logit_lens(self, k, start)

    def diff(self, other: Trace) -> pd.DataFrame:
        """Per-layer, per-position divergence of `other` from this trace (see slmviz.analysis.diff.trace_diff)."""
        return trace_diff(self, other)

    # --- plots (same figures as the app) ----------------------------------------------------------
    def plot_attention(self, layer: int, head: int | None = None):
        from .plots import trace as plots

        return plots.attention(self, layer, head)

    def plot_residual_norms(self, **kwargs):
        from .plots import trace as plots

        return plots.residual_norms(self, **kwargs)

    def plot_logit_lens(self, **kwargs):
        from .plots import trace as plots

        return plots.logit_lens(self, **kwargs)

    def _repr_html_(self) -> str:
        from .plots import trace as plots

        return plots.trace_html(self)

    def __repr__(self) -> str:
        return (f"Trace({self.model_name or 'model'}, {len(self.tokens)} tokens, variant={self.variant.label()!r}, "
                f"{len(self.cache)} hooks)")

    # --- persistence ------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write one .safetensors file (tensors + JSON metadata), atomically: temp file, then rename.

        A failure part-way (disk full, interrupt) leaves any earlier file at `path` untouched and no
        temporary file behind.
        """
        path = Path(path)
        held = {name: self[name] for name in self.names}  # derived values are written out, not re-derived on load
        tensors = _unshared({
            **{f"hook/{k}": v for k, v in held.items()}, "input_ids": self.input_ids, "logits": self.logits,
        })
        meta = {
            "slmviz_format": str(FORMAT_VERSION),
            "tokens": json.dumps(self.tokens),
            "config": json.dumps(self.config.to_dict()),
            "variant": json.dumps(self.variant.__dict__),
            "model_name": self.model_name,
            "vocab_strings": json.dumps({str(k): v for k, v in self.vocab_strings.items()}),
            "hook_order": json.dumps(list(held)),
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        # The temp file sits next to the target (os.replace is atomic only within one file system). It is
        # created like any new file (0o666 minus the umask) and given that mode back after writing, because
        # safetensors (like mkstemp) leaves files owner-only, which a downloadable trace should not be.
        tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        try:
            mode = stat.S_IMODE(os.stat(tmp).st_mode)
            save_file(tensors, str(tmp), metadata=meta)
            os.chmod(tmp, mode)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Trace:
        """Read a file written by `save`. A missing file is a FileNotFoundError; anything that is not a
        trace of this format version (garbage, another safetensors file, an older or newer slmviz) is a
        TraceFormatError saying which."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"No saved trace at {path}")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
            tensors = load_file(str(path))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise TraceFormatError(f"{path} is not a readable .safetensors trace: {e}") from e
        version = meta.get("slmviz_format")
        if version is None:
            raise TraceFormatError(f"{path} is a safetensors file but not a slmviz trace (no slmviz_format)")
        if version != str(FORMAT_VERSION):
            newer = version.isdigit() and int(version) > FORMAT_VERSION
            fix = "upgrade slmviz to read it" if newer else "re-run the trace with this version"
            raise TraceFormatError(
                f"{path} was written by trace format {version}; this slmviz reads format {FORMAT_VERSION}: {fix}."
            )
        try:
            order = json.loads(meta["hook_order"])
            return cls(
                tokens=json.loads(meta["tokens"]),
                input_ids=tensors["input_ids"],
                logits=tensors["logits"],
                cache={k: tensors[f"hook/{k}"] for k in order},
                config=ArchConfig.from_dict(json.loads(meta["config"])),
                variant=Variant(**json.loads(meta["variant"])),
                model_name=meta.get("model_name", ""),
                vocab_strings={int(k): v for k, v in json.loads(meta.get("vocab_strings", "{}")).items()},
            )
        except (KeyError, TypeError, ValueError) as e:  # missing entries, bad JSON, fields of another version
            raise TraceFormatError(f"{path} is a damaged slmviz trace ({type(e).__name__}: {e})") from e

    # --- interventions ----------------------------------------------------------------------------
    def logit_attribution(self, answer: str | int, wrong: str | int | None = None, by: str = "layer",
                          position: int = -1) -> pd.DataFrame:
        """Direct logit attribution: each component's share of logit(answer) - logit(wrong); the rows sum to
        it (see slmviz.analysis.logit_attribution)."""
        return logit_attribution(self, answer, wrong, by, position)


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors that share no memory, as safetensors requires.

    A trace holds the same tensor under several names (hook_embed is blocks.0.hook_resid_pre, and
    resid_pre[L+1] is resid_post[L]); those, and views into one buffer, are copied once each.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        t = t.contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
        seen.add(ptr)
        out[name] = t
    return out


def _finite(name: str, t: torch.Tensor) -> bool:
    if name.endswith("hook_attn_scores"):
        return not bool((torch.isnan(t) | torch.isposinf(t)).any())
    return bool(torch.isfinite(t).all())

