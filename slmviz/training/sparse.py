"""The pieces of a sparse coder's training step and start, shared by every objective: which entries are active
(TopK / BatchTopK), the sparse decode, the AuxK loss of dead features, BatchTopK's threshold, and the input scale and
least-squares fit a coder starts from. Why each is written the way it is: its docstring; the measurements behind
those choices: docs/features.md ("How the trainer is built")."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

INIT_DECODER_NORM = 0.1  # SAELens's decoder_init_norm (Anthropic's April 2024 update)
THRESHOLD_LR = 0.01  # SAELens's topk_threshold_lr
CUT_SAMPLE_STRIDE = 16  # batch_top_k_cut's first guess reads every 16th entry
CUT_SLACK = 1.5  # ... and aims its guess at 1.5x the share of entries kept, so that one guess nearly always holds
DEAD_DECODE_DENSE_FRACTION = 0.5  # dead_feature_decode multiplies densely while at most this fraction is dead


def active_entries(h: torch.Tensor, architecture: str, k: int, threshold: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A training step's active entries of h [B, d_sae] as (row, feature, value) triples grouped by row, and the
    BatchTopK threshold after this batch (`threshold` unchanged for TopK).

    TopK: relu of each row's k largest (SAELens: topk first, then relu). BatchTopK: batch_top_k's choice, and the
    threshold's EMA (SAELens's topk_threshold_lr) moved towards the smallest kept value; the run replaces it at the
    end by batch_threshold on rows from across the corpus, but a checkpoint keeps it."""
    if architecture == "topk":
        values, feats = torch.topk(h, k, dim=-1, sorted=False)  # [B, k]
        rows = torch.arange(h.shape[0], device=h.device)[:, None].expand_as(feats)
        return rows.reshape(-1), feats.reshape(-1), values.relu().reshape(-1), threshold
    rows, feats, values = batch_top_k(h, k)
    if values.numel():
        with torch.no_grad():
            threshold = (1 - THRESHOLD_LR) * threshold + THRESHOLD_LR * values.detach().min().double()
    return rows, feats, values, threshold


def gather(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t[index] along dim 0, where `index` repeats (a feature active in many rows): what every objective gathers per
    active entry. Why not t[index]: on the CPU advanced indexing's backward adds the repeats' gradients with parallel
    atomic adds, in an order that changes from run to run, so the same training run gave other weights in another
    process (two builds of the quick set differed in every layer); index_select's backward adds them in index
    order, and is faster. Pinned by tests/test_sae_train.py (one gradient however often a step runs)."""
    return t.index_select(0, index)


def batch_top_k(h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BatchTopK's choice: the k*B largest entries of relu(h) [B, d_sae] over the whole batch, as (row, feature,
    value) triples grouped by row (rows non-decreasing, as decode_sparse needs). Zeros are never kept: SAELens
    counts a feature as fired only where its activation is > 0, so a zero kept would reset its dead counter.

    Found by a cut (batch_top_k_cut: the largest value left out) instead of a top-k over the flattened batch: the
    entries above it are kept, and entries equal to it (bf16 matmuls make ties common) fill the count up to k*B in
    index order, so the count is exactly min(k*B, #positive) and the choice deterministic. The kept indices come out
    sorted, where topk's needed a sort."""
    flat = h.relu().flatten()
    keep = min(k * h.shape[0], flat.numel())
    a = flat.detach()
    with torch.no_grad():
        if keep < a.numel():
            cut = batch_top_k_cut(a, keep)
            chosen = a > cut
            short = keep - int(chosen.sum())
            if short > 0 and cut > 0:
                chosen[(a == cut).nonzero().squeeze(1)[:short]] = True
        else:
            chosen = a > 0
        index = chosen.nonzero().squeeze(1)  # ascending: grouped by row
    return index // h.shape[1], index % h.shape[1], gather(flat, index)


def batch_top_k_cut(a: torch.Tensor, keep: int) -> torch.Tensor:
    """The (keep+1)-th largest entry of a (keep < a.numel()): the largest value BatchTopK leaves out.

    Exact, from a guess. `low` is a value that a strided sample (every CUT_SAMPLE_STRIDE-th entry) says has about
    CUT_SLACK x (keep + 1) entries above it. When more than `keep` entries of `a` lie above `low`, the cut lies
    above it too, so it is the (keep+1)-th largest of those candidates alone. When not (the sample misled, e.g. a
    feature large on every row in columns the stride skips), `low` is taken lower in the sample, and at the end
    every entry is a candidate: the answer is the same value as a top-k over all of `a`, only cheaper.

    Why: this runs in every BatchTopK step and in each layer's final threshold, and a top-k over the flattened
    batch, or each row's largest entries first, cost several times more (docs/features.md)."""
    flat = a.reshape(-1)
    sample = flat[::CUT_SAMPLE_STRIDE]
    n = sample.numel()
    q = min(math.ceil((keep + 1) / CUT_SAMPLE_STRIDE * CUT_SLACK), n)
    while True:
        low = sample.topk(q, sorted=False).values.min() if q <= n else flat.new_tensor(-math.inf)
        candidates = flat[flat > low]
        if candidates.numel() > keep:
            return candidates.topk(keep + 1, sorted=False).values.min()
        q = min(4 * q, n) if q < n else n + 1  # lower in the sample; past its smallest entry: every entry


def batch_threshold(h: torch.Tensor, k: int) -> torch.Tensor:
    """The JumpReLU threshold that keeps what BatchTopK kept on h [n, d_sae]: the largest value of relu(h) below its
    k*n largest (float64 scalar)."""
    a = h.relu()
    kept = k * h.shape[0]
    return (batch_top_k_cut(a, kept) if kept < a.numel() else a.min()).double()


def decode_sparse(rows: torch.Tensor, feats: torch.Tensor, values: torch.Tensor, W_dec: torch.Tensor,
                  n_rows: int) -> torch.Tensor:
    """sum_j values_j * W_dec[feats_j] for each row: [n_rows, d_out], entries grouped by row (rows non-decreasing).

    An embedding bag reads only the k active rows of W_dec per token (B*k*d_out multiply-adds) where the dense
    f @ W_dec would multiply B*d_sae*d_out, nearly all by zero; its backward gives W_dec's and the values' grads.
    A dense backward (codes.T @ grad, (grad @ W_dec.T)[rows, feats]) lost to the bag's at every width tried."""
    offsets = torch.searchsorted(rows, torch.arange(n_rows, device=rows.device))
    return F.embedding_bag(feats, W_dec, offsets, mode="sum", per_sample_weights=values.to(W_dec.dtype))


def aux_loss(h: torch.Tensor, dead: torch.Tensor, residual: torch.Tensor, norms: torch.Tensor, W_dec: torch.Tensor,
             k_aux: int, coefficient: float) -> torch.Tensor:
    """SAELens's calculate_topk_aux_loss (Gao et al. 2024's AuxK): the top k_aux pre-activations of h [B, d_sae]
    among the `dead` features [d_sae] reconstruct the detached `residual` [B, d_out] through W_dec [d_sae, d_out],
    scaled by min(n_dead / k_aux, 1); 0 while no feature is dead. k_aux is d_in / 2 (Gao et al., appendix B.1).

    Why: a dead feature gets no gradient from the reconstruction (it is never selected); this loss gives the dead
    ones a target, the part of the output the live features miss, so they revive."""
    n_dead = int(dead.sum())
    if n_dead == 0:
        return h.new_zeros(())
    scale = min(n_dead / k_aux, 1.0)
    recons = dead_feature_decode(h, dead, min(k_aux, n_dead), norms, W_dec)  # no b_dec
    return coefficient * scale * (recons - residual).pow(2).sum(-1).mean()


def dead_feature_decode(h: torch.Tensor, dead: torch.Tensor, k_aux: int, norms: torch.Tensor,
                        W_dec: torch.Tensor) -> torch.Tensor:
    """The aux loss's reconstruction (SAELens's calculate_topk_aux_loss): each row of h [B, d_sae] keeps its k_aux
    largest raw pre-activations among the dead features, divided by their decoder norms, decoded by W_dec
    [d_sae, d_out] (no b_dec) -> [B, d_out].

    Over the dead features' columns alone, as a dense product: with k_aux = d_in / 2 of a few hundred to a thousand
    dead features per row the codes are dense there, and [B, n_dead] @ W_dec[dead] beats the sparse decode of
    B*k_aux entries. It loses once most features are dead, where the sparse decode is kept (docs/features.md)."""
    if dead.float().mean() > DEAD_DECODE_DENSE_FRACTION:
        masked = torch.where(dead[None], h, -torch.inf)  # [B, d_sae]
        values, feats = masked.topk(k_aux, dim=-1, sorted=False)  # [B, k_aux]; raw values, as SAELens
        rows = torch.arange(h.shape[0], device=h.device)[:, None].expand_as(feats).reshape(-1)
        feats = feats.reshape(-1)
        return decode_sparse(rows, feats, values.reshape(-1) / gather(norms, feats), W_dec, h.shape[0])
    idx = dead.nonzero().squeeze(1)
    h_dead = h[:, idx]  # [B, n_dead]
    values, pos = h_dead.topk(k_aux, dim=-1, sorted=False)  # [B, k_aux]
    codes = torch.zeros_like(h_dead).scatter(1, pos, values) / norms[idx]
    return codes @ W_dec[idx]


def unit_scale(x: torch.Tensor) -> float:
    """s with E||s x||^2 = d (SAELens's "expected_average_only_in" scaling factor), so a learning rate means the
    same on every hook. Each row's ||x||^2 in fp32 (one dot product of d entries), their mean in float64: within
    1e-8 of an all-float64 sum, without a float64 copy of the block."""
    x = x.reshape(-1, x.shape[-1])
    return math.sqrt(x.shape[-1] / float(torch.einsum("nd,nd->n", x, x).double().mean()))


def linear_fit(x: torch.Tensor, y: torch.Tensor, ridge: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """(W [d_out, d_in], b [d_out]) minimising ||x @ W.T + b - y||^2 (+ ridge * mean diagonal of the covariance *
    ||W||^2, so a rank-deficient block still solves): the least-squares start of a skip transcoder's W_skip and b_dec.

    SAELens starts W_skip at 0; from there Adam needs thousands of steps to learn the linear part of an MLP, which a
    CPU run does not have. From the fit, the features learn only what a linear map of the input leaves.

    The two products over the rows (x's covariance and its cross-covariance with y) run in fp32 and only the d x d
    solve in float64: the result differs from an all-float64 fit by 1e-6 to 1e-5 relative, with the same held-out
    explained variance, at a fraction of the time (docs/features.md). Returns float64."""
    x, y = x.float(), y.float()
    xm, ym = x.mean(0), y.mean(0)
    xc = x - xm
    cov = (xc.T @ xc).double()
    cov += ridge * cov.diagonal().mean() * torch.eye(cov.shape[0], dtype=cov.dtype, device=cov.device)
    W = torch.linalg.solve(cov, (xc.T @ (y - ym)).double()).T  # [d_out, d_in]
    return W, ym.double() - xm.double() @ W.T


def kaiming_rows(n: int, width: int, generator: torch.Generator) -> torch.Tensor:
    """n rows of `width` drawn kaiming-uniform from `generator` and scaled to norm INIT_DECODER_NORM: SAELens's
    decoder init (and a transcoder's encoder, whose input width differs from its decoder's)."""
    w = torch.empty(n, width)
    torch.nn.init.kaiming_uniform_(w, generator=generator)
    return w / w.norm(dim=-1, keepdim=True) * INIT_DECODER_NORM
