"""One prompt's attribution, as one object: what attribution_graph threads through its phases.

`AttributionContext` holds the prompt's frozen run (frozen.PromptState), the transcoder set, the active features
(their layer, position, index, activation, encoder row and writes), the error vectors and token embeddings (the
other sources), the targets (targets.TargetSet) and the node layout (where each kind's block starts in the
adjacency, circuit-tracer's order: features, errors, embeddings, logits). Its methods are the phases: the backward
passes over every target (`attribute_all`) or over the most influential features (`attribute_capped`), then the
targets' values, constants and node table. circuit-tracer's AttributionContext is the anchor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from .backward import attribute_rows
from .frozen import PromptState, Writes, active_features, prompt_state
from .nodes import _pre_softcap, node_table, replacement_constant
from .selection import attribute_most_influential
from .targets import TargetSet


@dataclass
class AttributionContext:
    """See the module docstring. Built by `build`; `select_features` narrows it to a capped graph's features."""

    model: Any
    ts: Any
    ids: torch.Tensor
    state: PromptState
    targets: TargetSet
    f_layer: torch.Tensor
    f_pos: torch.Tensor
    f_idx: torch.Tensor
    f_act: torch.Tensor
    f_enc: torch.Tensor
    writes: Writes
    errors: torch.Tensor
    token_vecs: torch.Tensor
    batch_size: int
    vmap: bool = True

    @classmethod
    def build(cls, model: Any, ts: Any, ids: torch.Tensor, targets: Any, zero_bos: bool, batch_size: int,
              vmap: bool) -> AttributionContext:
        """The prompt's frozen run, its active features and the targets `targets.select` chooses."""
        state = prompt_state(model, ids, ts)
        f_layer, f_pos, f_idx, f_act, f_enc, writes, errors = active_features(ts, state, model.cfg.n_layers, zero_bos)
        chosen = targets.select(model, state)
        return cls(model, ts, ids, state, chosen, f_layer, f_pos, f_idx, f_act, f_enc, writes, errors,
                   state.embed.float(), batch_size, vmap)

    # --- the node layout ----------------------------------------------------------------------------------------
    @property
    def n_pos(self) -> int:
        return len(self.ids)

    @property
    def n_layers(self) -> int:
        return self.model.cfg.n_layers

    @property
    def n_features(self) -> int:
        return len(self.f_layer)

    @property
    def n_targets(self) -> int:
        return len(self.targets)

    @property
    def err_off(self) -> int:
        return self.n_features

    @property
    def tok_off(self) -> int:
        return self.err_off + self.n_layers * self.n_pos

    @property
    def logit_off(self) -> int:
        return self.tok_off + self.n_pos

    @property
    def n_nodes(self) -> int:
        return self.logit_off + self.n_targets

    def _args(self) -> tuple:
        """attribute_rows' arguments after its adjacency (the sources: feature writes, errors, embeddings)."""
        return (self.batch_size, self.f_pos, self.writes, self.errors, self.token_vecs, self.err_off, self.tok_off,
                self.logit_off)

    def logit_rows(self) -> list[tuple]:
        """The targets as attribute_rows' (layer read, position, read vector, node row): the last position, after
        the final norm (layer n_layers)."""
        vecs = self.targets.vectors
        return [(self.n_layers, self.n_pos - 1, vecs[i], self.logit_off + i) for i in range(self.n_targets)]

    # --- the phases -------------------------------------------------------------------------------------------
    def attribute_all(self, report: Callable[[int], None]) -> torch.Tensor:
        """The dense adjacency [n_nodes, n_nodes]: the targets' rows (every layer), then every feature's (up to the
        last transcoder's layer); `report(rows done)` after each backward."""
        adjacency = torch.zeros(self.n_nodes, self.n_nodes)
        feature_rows = [(int(self.f_layer[i]), int(self.f_pos[i]), self.f_enc[i], i) for i in range(self.n_features)]
        for base, rows in ((0, self.logit_rows()), (self.n_targets, feature_rows)):
            if rows:
                attribute_rows(self.model, self.state, self.ts, rows, adjacency, *self._args(), vmap=self.vmap,
                               report=lambda n, base=base: report(base + n))
        return adjacency

    def attribute_capped(self, cap: int, update_interval: int, report: Callable[[int], None]) -> torch.Tensor:
        """The adjacency over the `cap` most influential features (selection.attribute_most_influential) and every
        other node; the context is narrowed to those features (select_features)."""
        selected, adjacency = attribute_most_influential(
            self.model, self.state, self.ts, self.logit_rows(), self.targets.probabilities, self.f_layer, self.f_pos,
            self.f_enc, cap, self.n_nodes, self._args(), self.vmap, report, update_interval)
        self.select_features(selected)
        return adjacency

    def select_features(self, selected: torch.Tensor) -> None:
        """Keep the features at `selected` (indices, ascending): the node layout shifts with them."""
        self.f_layer, self.f_pos, self.f_idx, self.f_act, self.f_enc = (
            t[selected] for t in (self.f_layer, self.f_pos, self.f_idx, self.f_act, self.f_enc))
        self.writes = self.writes.select(selected)

    def target_values(self) -> torch.Tensor:
        """[n_nodes] what each target's row sums to with its constant: a feature's pre-activation minus b_enc (read
        off the prompt's own run), a target's demeaned logit (before a final softcap); 0 for the other nodes."""
        cfg, state = self.model.cfg, self.state
        values = torch.zeros(self.n_nodes)
        if self.n_features:
            rows = torch.stack([state.mlp_in[int(L)][int(p)].float()
                                for L, p in zip(self.f_layer, self.f_pos, strict=True)])
            values[:self.n_features] = (rows * self.f_enc).sum(-1)
        last = state.logits[-1].float() if cfg.final_logit_softcap is None else _pre_softcap(self.model, state)
        values[self.logit_off:] = last[self.targets.ids] - last.mean()
        return values

    def constant(self) -> torch.Tensor:
        """[n_nodes] each target's value with every node removed (nodes.replacement_constant)."""
        return replacement_constant(self.model, self.state, self.ts, self.f_layer, self.f_pos, self.writes,
                                    self.errors, self.f_enc, self.targets.vectors, self.n_nodes, self.logit_off)

    def node_table(self) -> pd.DataFrame:
        feat_hook = [self.ts.write_hook(L) for L in self.f_layer.tolist()]
        return node_table(self.model, self.ids, self.f_layer, self.f_pos, self.f_idx, self.f_act, feat_hook,
                          self.n_layers, self.targets.ids, self.targets.probabilities)


__all__ = ["AttributionContext"]
