"""The per-batch work of a corpus scan: documents → windows → padded batches → one `BatchResult` each.

Both engines call `run_batch` on the same batches (`plan_batches` is a pure function of a shard's documents
and the settings; shards.py), so they compute identical partial results; only where the call runs differs.

Windows: a document longer than `window` tokens is cut into consecutive, non-overlapping windows, each
run on its own (a token late in a window sees the earlier tokens of its window only). Positions in the
results are positions in the whole document (window offset + position in the window).

Batches: windows are padded on the RIGHT to the longest in the batch. With the causal mask a real token
never attends to a later (pad) position and RoPE positions start at 0 in every row, so real tokens'
activations equal an unpadded run (tests/test_scan.py::test_padding_changes_nothing). Only a variant
without the causal mask would see the pads: its damage is computed one window at a time, unpadded.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..analysis.diff import kl_per_position
from ..hooks import SAE_HOOKS, HookError, build_context, hook_dims
from ..variants import resolve_variant
from .reduce import DamagePartial, Fired, HookPartial, positive_entries, token_key
from .units import Feature, identity

PAD_ID = 0  # any valid id: causal attention keeps real positions from seeing it
SORT_BUFFER = 1024  # windows sorted by length together, so a batch holds windows of similar length
MAX_PAD_FRACTION = 0.1  # a batch ends before a window this much shorter than its longest (see plan_batches)
MIN_BATCH_TOKENS = 256  # ... unless it holds fewer real tokens than this: small batches run slower per token
BATCHED_DECODER = "batched" in inspect.signature(build_context).parameters


Tap = Callable[[str, torch.Tensor, torch.Tensor, "Fired | None"], None]  # run_batch's: (hook, x, ids, fired)


@dataclass(frozen=True)
class Window:
    doc: int
    offset: int  # position of ids[0] in the document
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Batch:
    index: int
    windows: tuple[Window, ...]

    @property
    def n_tokens(self) -> int:
        return sum(len(w.ids) for w in self.windows)


@dataclass(frozen=True)
class ScanSpec:
    """Everything a worker needs besides the model (sent to every Ray actor)."""

    hooks: tuple[str, ...]
    top_k: int
    variants: tuple[Any, ...] = ()  # resolved Variants, in the order of `variant_names`
    variant_names: tuple[str, ...] = ()
    context_before: int = 12
    context_after: int = 4
    window: int = 256  # tokens: longer documents are cut into windows of this many
    batch_tokens: int = 1024  # padded tokens per forward at most
    threads: int = field(default_factory=torch.get_num_threads)
    saes: tuple[Any, ...] = ()  # SAEs spliced into every forward (their hooks may be scanned)

    @property
    def context(self) -> int:
        return self.context_before + 1 + self.context_after


@dataclass
class BatchResult:
    index: int
    hooks: dict[str, HookPartial]
    damage: DamagePartial | None


def iter_windows(tokenizer: Any, docs: Iterable[str], window: int, chunk: int = 256,
                 first_doc: int = 0) -> Iterator[Window]:
    """Tokenize documents (in chunks: the fast tokenizer's batch call) and cut them into windows, numbering
    documents from `first_doc`. Documents with no tokens (empty lines) produce no window but keep their number."""
    if window < 1:
        raise ValueError(f"window must be >= 1 token, got {window}")
    doc = first_doc
    buffer: list[str] = []
    for text in _with_end(docs):
        if text is not None:
            buffer.append(text)
        if buffer and (text is None or len(buffer) == chunk):
            for ids in tokenizer(buffer)["input_ids"]:
                for offset in range(0, len(ids), window):
                    yield Window(doc, offset, tuple(ids[offset:offset + window]))
                doc += 1
            buffer = []


def _with_end(items: Iterable[str]) -> Iterator[str | None]:
    yield from items
    yield None


def plan_batches(windows: Iterable[Window], batch_tokens: int) -> Iterator[Batch]:
    """Group windows into batches of at most `batch_tokens` padded tokens (at least one window each).

    Windows are sorted by length within a buffer of SORT_BUFFER and cut into batches longest first. A batch
    also ends where the next window is more than MAX_PAD_FRACTION shorter than its longest, once it holds
    MIN_BATCH_TOKENS real tokens: on a corpus of mixed lengths (verses of 11 to 66 tokens) filling every
    batch to the budget padded a quarter of what ran, while batches of ≥ 256 tokens already run near this
    CPU's peak tokens/s (bench/perf/scan.py measures both).
    """
    index = 0
    buffer: list[Window] = []

    def flush() -> Iterator[Batch]:
        nonlocal index
        ordered = sorted(buffer, key=lambda w: -len(w.ids))  # stable: equal lengths keep corpus order
        current: list[Window] = []
        real = 0
        for w in ordered:
            if current:
                longest = len(current[0].ids)
                full = (len(current) + 1) * longest > batch_tokens
                ragged = len(w.ids) < (1 - MAX_PAD_FRACTION) * longest and real >= MIN_BATCH_TOKENS
                if full or ragged:
                    yield Batch(index, tuple(current))
                    index += 1
                    current, real = [], 0
            current.append(w)
            real += len(w.ids)
        if current:
            yield Batch(index, tuple(current))
            index += 1

    for w in windows:
        buffer.append(w)
        if len(buffer) == SORT_BUFFER:
            yield from flush()
            buffer = []
    if buffer:
        yield from flush()


class _Stop(Exception):
    """Raised by the last scanned hook when no logits are needed: the rest of the forward is skipped."""


def run_batch(model: Any, batch: Batch, spec: ScanSpec, features: dict[str, Feature],
              tap: Tap | None = None) -> BatchResult:
    """Run one batch through the faithful model (and the variants, for damage) and reduce it. `tap(hook, x [N, F],
    ids [N], fired)`, if given, sees each hook's features of the batch's real tokens as they are reduced (the deep
    scan's token tables, features.deep_scan: a reduction of its own, without a second forward), in (document,
    position) order, with x's entries above 0 (reduce.Fired; None where x has entries below 0)."""
    windows = batch.windows
    lengths = torch.tensor([len(w.ids) for w in windows])  # [b]
    longest = int(lengths.max())
    ids = torch.full((len(windows), longest), PAD_ID, dtype=torch.long)  # [b, L], padded on the right
    for i, w in enumerate(windows):
        ids[i, : len(w.ids)] = torch.tensor(w.ids)
    ids = ids.to(model.decoder.params.embed.device)
    need_logits = bool(spec.variants)
    rules = row_rules(spec)
    extra = [h for _, x_name, y_name in rules.values() for h in (x_name, y_name) if h and h not in spec.hooks]
    values, logits = _forward(model, ids, lengths, [*spec.hooks, *dict.fromkeys(extra)], need_logits, spec.saes)

    real = torch.arange(longest)[None, :] < lengths[:, None]  # [b, L]
    _apply_row_rules(values, rules, real)
    docs = torch.tensor([w.doc for w in windows])[:, None].expand(-1, longest)
    positions = torch.tensor([w.offset for w in windows])[:, None] + torch.arange(longest)[None, :]
    keys = token_key(docs[real], positions[real])  # [N], row-major: window by window
    order = torch.sort(keys).indices  # rows in (document, position) order: ties resolve the same everywhere
    keys = keys[order]
    row_of = torch.full((len(windows), longest), -1, dtype=torch.long)  # [b, L] -> row in the sorted table
    row_of[real] = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    ctx_rows = _context_rows(row_of, real, spec)[order]  # [N, C]
    flat = real.flatten().nonzero().flatten()[order]  # [N] index into [b * L] of each row of the table
    flat_ids = ids.cpu().flatten()[flat]  # [N]

    hooks = {}
    for name in spec.hooks:
        feat = features[name]
        value = values[name]
        x = _rows(feat.fn(value).cpu(), flat)  # [b, L, F] -> [N, F]
        raw = (x if feat.fn is identity else _rows(value.cpu(), flat)) if feat.per_position_value else None
        fired = positive_entries(x)  # a sparse coder's: found once for the reduction and the tap
        hooks[name] = HookPartial.of_tokens(x, keys, ctx_rows, flat_ids, raw, spec.top_k, fired)
        if tap is not None:
            tap(name, x, flat_ids, fired)
    damage = _damage(model, ids, lengths, windows, logits, spec) if spec.variants else None
    return BatchResult(batch.index, hooks, damage)


def row_rules(spec: ScanSpec) -> dict[str, tuple[Any, str, str | None]]:
    """Scanned SAE feature hooks the SAE's row rule applies to: {f"{out}.hook_sae_acts_post": (sae.shown_rows,
    the SAE's input hook, its target hook or None)}, for every spliced SAE that has `shown_rows` (duck-typed:
    scans sit below slmviz.features, whose SAE.shown_rows is activations.sae_rows).

    On the rows the rule drops (each window's first position, rows whose norm is massive against the batch's
    median) the SAE's features are zeroed: a feature scan then counts the tokens training and evaluate_sae
    count. Without it the attention sink's massive first rows top every feature's contexts and pad its density.
    Only hook_sae_acts_post is ruled; the other hook_sae_* values, and ordinary hooks, are scanned as they are."""
    rules = {}
    for sae in spec.saes:
        rule = getattr(sae, "shown_rows", None)
        name = f"{sae.hook_name_out}.hook_sae_acts_post"
        if callable(rule) and name in spec.hooks:
            target = sae.hook_name_out if getattr(sae, "is_transcoder", False) else None
            rules[name] = (rule, f"{sae.hook_name_out}.hook_sae_input", target)
    return rules


def _apply_row_rules(values: dict[str, torch.Tensor], rules: dict[str, tuple[Any, str, str | None]],
                     real: torch.Tensor) -> None:
    """Zero each ruled hook's values [b, L, d_sae] on the real rows its SAE's rule drops (`row_rules`)."""
    if not rules:
        return
    first = torch.zeros_like(real)
    first[:, 0] = True  # every row of a batch is one window
    for name, (rule, x_name, y_name) in rules.items():
        on = values[name].device
        x = values[x_name].reshape(*real.shape, -1)[real.to(on)]  # [N, d_in]
        others = () if y_name is None else (values[y_name].reshape(*real.shape, -1)[real.to(on)],)
        keep = torch.zeros_like(real)
        keep[real] = rule(x, first[real].to(on), *others).cpu()
        values[name] = values[name].masked_fill(~keep.to(on)[..., None], 0)


def _rows(t: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """[b, L, *V] -> [N, *V]: the rows `flat` of the batch's (window, position) grid, in one gather."""
    return t.reshape(-1, *t.shape[2:]).index_select(0, flat)


def _context_rows(row_of: torch.Tensor, real: torch.Tensor, spec: ScanSpec) -> torch.Tensor:
    """[N, C] row of each context token of every real token (window-major order), -1 outside its window."""
    b, longest = row_of.shape
    shifts = torch.arange(-spec.context_before, spec.context_after + 1)  # [C]
    pos = torch.arange(longest)[:, None] + shifts[None, :]  # [L, C]
    inside = (pos >= 0) & (pos < longest)
    rows = row_of[:, pos.clamp(0, longest - 1)]  # [b, L, C]
    rows = torch.where(inside[None], rows, -1)
    return rows[real]  # [N, C]; pads already hold -1 in row_of


def _forward(model: Any, ids: torch.Tensor, lengths: torch.Tensor, hooks: Sequence[str],
             need_logits: bool, saes: Sequence[Any] = ()) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Values of `hooks` as [b, *shape] (padded to ids' length) and, if needed, logits [b, L, vocab].

    Without logits the forward stops right after the last scanned hook (execution order), so scanning
    layer 3 of 30 costs 4 layers. Uses the decoder's batch dimension when it has one, else one window at
    a time (padded afterwards, so both give the same shapes).
    """
    faithful = resolve_variant(None)
    plan = _encoder_plan(hooks, saes) if BATCHED_DECODER and not need_logits else None
    if plan is not None:
        return _forward_encoders(model, ids, hooks, plan), None
    last = max(hooks, key=lambda h: execution_order(h, model.hook_names))
    if BATCHED_DECODER:
        store, fns = _collector(hooks, last, need_logits)
        ctx = build_context(model.hook_names, [], fns, batched=True, saes=saes)
        logits = _run(model, ids, ctx, faithful)
        return store, logits
    values: dict[str, list[torch.Tensor]] = {h: [] for h in hooks}
    rows = []
    for i in range(ids.shape[0]):
        store, fns = _collector(hooks, last, need_logits)
        ctx = build_context(model.hook_names, [], fns, saes=saes)
        out = _run(model, ids[i, : int(lengths[i])], ctx, faithful)
        for h in hooks:
            values[h].append(_pad(store[h], h, ids.shape[1]))
        if out is not None:
            rows.append(_pad_dim(out, 0, ids.shape[1]))
    logits = torch.stack(rows) if rows else None
    return {h: torch.stack(v) for h, v in values.items()}, logits


# The SAE hooks a scan can compute from the SAE's input alone: its encoder, not its decoder.
ENCODER_HOOKS = ("hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post")


def _encoder_plan(hooks: Sequence[str], saes: Sequence[Any]) -> dict[str, Any] | None:
    """{SAE hook name: its SAE} when the scanned SAE hooks can come from a plain forward plus each SAE's encoder, else
    None (the spliced forward runs).

    Why: with the error term on and nothing edited, a spliced SAE hands the model its own value back (features.splice:
    recons + error == x_out bit for bit), so the model's forward is the plain one, and the SAE's decoder (its
    reconstruction and error, as costly as its encoder, a third of a 30-layer set's forward) feeds nothing a scan
    reads. So: every spliced SAE has the error term on, a scanned SAE hook is one of ENCODER_HOOKS, and the SAE
    has the encoder methods the splice calls (encode_pre, activate). The values are the splice's, computed by the
    same calls on the same input (tests/test_scan.py pins them equal)."""
    plan: dict[str, Any] = {}
    for sae in saes:
        if not getattr(sae, "use_error_term", False):
            return None  # without it the SAE's reconstruction flows on: the forward is not the plain one
        for h in hooks:
            parent, _, short = h.rpartition(".")
            if parent != sae.hook_name_out or short not in SAE_HOOKS:
                continue
            if short not in ENCODER_HOOKS or not all(callable(getattr(sae, f, None)) for f in ("encode_pre",
                                                                                                "activate")):
                return None
            plan[h] = sae
    return plan


def _forward_encoders(model: Any, ids: torch.Tensor, hooks: Sequence[str], plan: dict[str, Any]
                      ) -> dict[str, torch.Tensor]:
    """A plain forward (stopped after the last hook needed) with each planned SAE's encoder run on its input hook:
    the values a spliced forward gives `hooks` (_encoder_plan), without the decoders."""
    saes = list(dict.fromkeys(plan.values()))  # in splice order
    model_hooks = [h for h in hooks if h not in plan]
    reads = [sae.hook_name for sae in saes]
    needed = list(dict.fromkeys([*model_hooks, *reads]))
    last = max(needed, key=lambda h: execution_order(h, model.hook_names))
    store: dict[str, torch.Tensor] = {}

    def keep(x: torch.Tensor, name: str) -> None:
        store[name] = x
        if name == last:
            raise _Stop

    ctx = build_context(model.hook_names, [], {h: keep for h in needed}, batched=True)
    _run(model, ids, ctx, resolve_variant(None))
    values = {h: store[h] for h in model_hooks}
    with torch.inference_mode():  # as inside the forward, where the splice runs: no autograd graph of the encoders
        for sae in saes:
            sae_in = _flat_input(store[sae.hook_name], sae.d_in).to(sae.dtype)  # the splice's clean_in
            pre = sae.encode_pre(sae_in)
            acts = sae.activate(pre)
            for name, value in (("hook_sae_input", sae_in), ("hook_sae_acts_pre", pre),
                                ("hook_sae_acts_post", acts)):
                full = f"{sae.hook_name_out}.{name}"
                if full in plan:
                    values[full] = value
    return values


def _flat_input(x: torch.Tensor, width: int) -> torch.Tensor:
    """The SAE's input as the splice reads it (features.splice._flat; scans may not import features): [..., width],
    a per-head value [..., h, d_head] flattened."""
    if x.shape[-1] == width:
        return x
    if x.dim() >= 2 and x.shape[-2] * x.shape[-1] == width:
        return x.flatten(-2)
    raise ValueError(f"an SAE reads {width} values per token, its input hook holds {tuple(x.shape)}")


def execution_order(name: str, model_names: list[str]) -> tuple[int, int]:
    """Sort key of a hook in the forward pass: an SAE's hooks fire inside the hook it writes, after that hook's fns."""
    parent, _, short = name.rpartition(".")
    if short in SAE_HOOKS and parent in model_names:
        return model_names.index(parent), 1 + SAE_HOOKS.index(short)
    return model_names.index(name), 0


def _collector(hooks: Sequence[str], last: str, need_logits: bool):
    store: dict[str, torch.Tensor] = {}

    def keep(x: torch.Tensor, name: str) -> None:
        store[name] = x
        if name == last and not need_logits:
            raise _Stop

    return store, {h: keep for h in hooks}


def _run(model: Any, ids: torch.Tensor, ctx: Any, variant: Any) -> torch.Tensor | None:
    try:
        return model.decoder.forward(ids, ctx, variant)
    except _Stop:  # a decoder that does not wrap hook fns' exceptions
        return None
    except HookError as e:
        if isinstance(e.__cause__, _Stop):
            return None
        raise


def _pad(value: torch.Tensor, name: str, longest: int) -> torch.Tensor:
    """One window's unbatched value, zero-padded to `longest` on each of its position axes."""
    for dim, axis in enumerate(hook_dims(name)):
        if axis in ("pos", "pos_q", "pos_k"):
            value = _pad_dim(value, dim, longest)
    return value


def _pad_dim(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if t.shape[dim] == size:
        return t
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim)


def _damage(model: Any, ids: torch.Tensor, lengths: torch.Tensor, windows: Sequence[Window],
            logits: torch.Tensor, spec: ScanSpec) -> DamagePartial:
    """KL(faithful ‖ variant) and top-1 agreement summed over each window's real positions."""
    w, v = len(windows), len(spec.variants)
    kl_sum = torch.zeros(w, v, dtype=torch.float64)
    agree = torch.zeros(w, v, dtype=torch.int64)
    for j, variant in enumerate(spec.variants):
        sees_pads = not getattr(variant, "causal", True)
        if BATCHED_DECODER and not sees_pads:
            broken = model.decoder.forward(ids, build_context(model.hook_names, [], batched=True, saes=spec.saes),
                                           variant)
        else:
            broken = None
        for i in range(w):
            n = int(lengths[i])
            ref = logits[i, :n]  # [n, vocab]
            if broken is not None:
                other = broken[i, :n]
            else:
                other = model.decoder.forward(ids[i, :n], build_context(model.hook_names, [], saes=spec.saes), variant)
            kl_sum[i, j] = float(kl_per_position(ref, other).double().sum())  # float(): off a GPU too
            agree[i, j] = int((ref.argmax(-1) == other.argmax(-1)).sum())
    return DamagePartial(torch.tensor([x.doc for x in windows]), lengths.long(), kl_sum, agree)
