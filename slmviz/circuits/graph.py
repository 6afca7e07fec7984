"""The component graph (EAP-IG's): which component writes what into the residual stream, and who reads it.

Sources (what writes into the residual stream), in the order the forward pass produces them:
`input` (hook_embed), then for each layer L the heads `a{L}.h{H}` (each head's write, attn.hook_result, see
circuits.engine.head_writes) and the MLP `m{L}` (hook_mlp_out).
Destinations (what reads it), in the same order: for each layer L each head's query input `a{L}.h{H}<q>`, each KV
group's key and value inputs `a{L}.g{G}<k>` / `a{L}.g{G}<v>` (keys and values are per KV group, as the model
computes them: EAP-IG ungroups GQA into one k/v input per query head, which is not what the model runs), the MLP's
input `m{L}`, and `logits` (the last block's hook_resid_post, before the final norm).
An edge goes from every source to every destination later in the forward pass: the layer's own heads feed its
MLP, never its own queries, keys or values. Every destination reads a *prefix* of the source list (everything
written before it), which is what lets the engine store one [n_src, n_dst] matrix per run.

    SmolLM2-135M: 301 sources, 481 destinations, 70,651 edges (123,211 ungrouped)
    Gemma 3 270M: 91 sources, 109 destinations, 5,644 edges (10,342 ungrouped)
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

Edge = tuple[str, str]


class EdgeNameError(KeyError, ValueError):
    """An edge or node name this model's graph does not have. str() is the plain message (see HookNameError)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class ComponentGraph:
    """The graph of one architecture: names, indices and the mask of real edges (source before destination)."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    # GPT-NeoX's parallel residual: layer L's MLP reads the block's input, so no head of layer L feeds it.
    parallel: bool = False
    sources: list[str] = field(init=False, compare=False)
    targets: list[str] = field(init=False, compare=False)
    n_prev: torch.Tensor = field(init=False, compare=False, repr=False)  # [n_dst]: target t reads sources[:n_prev[t]]

    def __post_init__(self) -> None:
        h, g = self.n_heads, self.n_kv_heads
        sources, targets, n_prev = ["input"], [], []
        for layer in range(self.n_layers):
            before = len(sources)
            for kind, count, letter in (("q", h, "h"), ("k", g, "g"), ("v", g, "g")):
                targets += [f"a{layer}.{letter}{i}<{kind}>" for i in range(count)]
                n_prev += [before] * count
            sources += [f"a{layer}.h{i}" for i in range(h)]
            targets.append(f"m{layer}")
            n_prev.append(before if self.parallel else len(sources))
            sources.append(f"m{layer}")
        targets.append("logits")
        n_prev.append(len(sources))
        object.__setattr__(self, "sources", sources)
        object.__setattr__(self, "targets", targets)
        object.__setattr__(self, "n_prev", torch.tensor(n_prev, dtype=torch.long))

    @classmethod
    def of(cls, model_or_cfg: Any) -> ComponentGraph:
        cfg = getattr(model_or_cfg, "cfg", model_or_cfg)
        return cls(cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, bool(getattr(cfg, "parallel_residual", False)))

    # --- sizes and indices --------------------------------------------------------------------------
    @property
    def n_src(self) -> int:
        return len(self.sources)

    @property
    def n_dst(self) -> int:
        return len(self.targets)

    @property
    def n_edges(self) -> int:
        return int(self.n_prev.sum())

    @property
    def per_layer_targets(self) -> int:
        """Destinations per layer: h queries, g keys, g values, one MLP."""
        return self.n_heads + 2 * self.n_kv_heads + 1

    def head_source(self, layer: int, head: int) -> int:
        return 1 + layer * (self.n_heads + 1) + head

    def mlp_source(self, layer: int) -> int:
        return 1 + layer * (self.n_heads + 1) + self.n_heads

    def mlp_prefix(self, layer: int) -> int:
        """Sources the MLP of `layer` reads: through this layer's heads, or only what its attention reads too when
        the residual is parallel (GPT-NeoX)."""
        return self.attn_prefix(layer) if self.parallel else self.mlp_source(layer)

    def attn_prefix(self, layer: int) -> int:
        """Sources the attention of `layer` reads: the input and every earlier layer's heads and MLP."""
        return 1 + layer * (self.n_heads + 1)

    def target_slices(self, layer: int) -> dict[str, slice]:
        """Where layer L's q, k, v and mlp destinations sit in `targets`."""
        h, g = self.n_heads, self.n_kv_heads
        start = layer * self.per_layer_targets
        return {"q": slice(start, start + h), "k": slice(start + h, start + h + g),
                "v": slice(start + h + g, start + h + 2 * g), "mlp": slice(start + h + 2 * g, start + h + 2 * g + 1)}

    @property
    def logits_target(self) -> int:
        return self.n_dst - 1

    def target_layer(self, target: int) -> int:
        """The layer whose block reads destination `target` (n_layers for logits)."""
        return min(target // self.per_layer_targets, self.n_layers)

    def real(self) -> torch.Tensor:
        """Bool [n_src, n_dst]: True where an edge exists (the source comes before the destination)."""
        return torch.arange(self.n_src)[:, None] < self.n_prev[None, :]

    # --- names ----------------------------------------------------------------------------------------
    def edges(self) -> list[Edge]:
        """Every (source, target), destination by destination in forward order, sources in forward order."""
        return [(self.sources[s], t) for t, n in zip(self.targets, self.n_prev.tolist(), strict=True)
                for s in range(n)]

    def edge_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(source index, target index) LongTensors of every edge, in `edges()` order."""
        real = self.real().t()  # [n_dst, n_src]: the edges() order is target-major
        dst, src = real.nonzero(as_tuple=True)
        return src, dst

    def index_of(self, edge: Any) -> tuple[int, int]:
        """(source index, target index) of one edge: a (source, target) pair or a "source->target" string."""
        src_name, dst_name = self.parse(edge)
        s = self._lookup(src_name, self.sources, "source")
        t = self._lookup(dst_name, self.targets, "target")
        if s >= int(self.n_prev[t]):
            raise EdgeNameError(
                f"There is no edge {src_name} -> {dst_name}: a destination reads only sources written before it "
                f"({dst_name} reads {', '.join(self.sources[:3])}, ... up to {self.sources[int(self.n_prev[t]) - 1]})"
            )
        return s, t

    def mask(self, edges: Iterable[Any]) -> torch.Tensor:
        """Bool [n_src, n_dst] with True at each named edge."""
        out = torch.zeros(self.n_src, self.n_dst, dtype=torch.bool)
        for edge in edges:
            out[self.index_of(edge)] = True
        return out

    @staticmethod
    def parse(edge: Any) -> Edge:
        if isinstance(edge, str) and "->" in edge:
            src, dst = (part.strip() for part in edge.split("->", 1))
            return src, dst
        if isinstance(edge, tuple | list) and len(edge) == 2 and all(isinstance(x, str) for x in edge):
            return edge[0], edge[1]
        raise EdgeNameError(
            f"An edge is a (source, target) pair of node names or a 'source->target' string, e.g. ('m5', 'logits') "
            f"or 'a3.h1->a5.h2<q>'; got {edge!r}"
        )

    @staticmethod
    def _lookup(name: str, names: list[str], role: str) -> int:
        try:
            return names.index(name)
        except ValueError:
            pass
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        kinds = ("'input', 'a{L}.h{H}' (a head's write), 'm{L}' (an MLP's write)" if role == "source" else
                 "'a{L}.h{H}<q>', 'a{L}.g{G}<k>' / '<v>' (KV groups), 'm{L}', 'logits'")
        raise EdgeNameError(f"{name!r} is not a {role} node of this model's graph{hint} ({role}s are {kinds}; "
                            f"this model has {names[0]!r} ... {names[-1]!r})")


def graph_edges(model: Any = None) -> list[Edge]:
    """Every (source, target) edge of the model's component graph (see slmviz.circuits.graph), in forward order.

    SmolLM2-135M has 70,651 edges, Gemma 3 270M 5,644: keys and values are per KV group, as the model computes
    them. `model` defaults to the bundled `slmviz.load()`.
    """
    if model is None:
        from ..model_api import load

        model = load()
    return ComponentGraph.of(model).edges()
