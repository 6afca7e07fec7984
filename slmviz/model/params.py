"""The decoder's parameters, stored the way the kernels read them fastest.

Matrices keep nn.Linear's layout, [out, in] and contiguous. A decoding step is a matrix-vector product
bound by reading the weights. On some CPUs MKL runs a single one on one core however many threads torch
has; there `linear` splits one-row products into one row block per thread, which streams the weights at
the machine's read bandwidth. On others MKL's own matrix-vector product is faster, and `linear` uses it:
which one wins is measured once per process (`row_split_wins`). Prompts (many rows) go through the same GEMM as
transformers. q/k/v and gate/up are fused into one matrix each, so a decoding step makes 4 matmuls per
layer instead of 7. Only slmviz/loading/weights.py knows how HF names map onto these fields.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LayerParams:
    # Norm weights by slot (see weights.NORM_WEIGHT_NAMES): lnX sits before sub-layer X, lnX_post after it;
    # a family has only the slots it uses (LLaMA: ln1, ln2; OLMo-2: ln1_post, ln2_post; Gemma: all four).
    ln1: torch.Tensor | None  # [d_model]
    ln2: torch.Tensor | None  # [d_model]
    w_qkv: torch.Tensor  # [(h + 2g) * d_head, d_model]: q rows, then k, then v
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor  # [d_model, h * d_head]
    b_o: torch.Tensor | None
    w_gate_up: torch.Tensor  # [2 * d_mlp, d_model]: gate rows first, then up; [d_mlp, d_model] (up) when ungated
    b_gate_up: torch.Tensor | None
    w_down: torch.Tensor  # [d_model, d_mlp]
    b_down: torch.Tensor | None
    ln1_post: torch.Tensor | None = None  # [d_model]
    ln2_post: torch.Tensor | None = None  # [d_model]
    q_norm: torch.Tensor | None = None  # [d_head] per head, or [h * d_head] over the projection (OLMo-2)
    k_norm: torch.Tensor | None = None  # [d_head] or [g * d_head]
    # LayerNorm biases (GPT-2, GPT-NeoX), by slot like the weights: {"ln1": [d_model], "ln2": [d_model]}.
    norm_biases: dict[str, torch.Tensor] | None = None


@dataclass
class DecoderParams:
    embed: torch.Tensor  # [vocab, d_model]
    layers: list[LayerParams]
    ln_final: torch.Tensor  # [d_model]
    unembed: torch.Tensor  # [vocab, d_model]; the same tensor as embed when embeddings are tied
    ln_final_bias: torch.Tensor | None = None  # [d_model], LayerNorm families
    pos_embed: torch.Tensor | None = None  # [max_position_embeddings, d_model], learned positions (GPT-2)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T (+ b) for [out, in] weights, like F.linear. x: [..., pos, in] -> [..., pos, out].

    Several rows are one GEMM (F.linear, as in transformers). One row (a decoding step) is a
    matrix-vector product bound by reading w, and on CPUs where MKL runs it on one core however many
    threads torch has (`row_split_wins`), w is split into one block of rows per thread and multiplied as
    one batched matmul, which torch spreads over its threads: each thread streams its own contiguous half
    of the weights (over SmolLM2's weights on 2 AMD cores, 16-19 ms per pass against 44-48 ms for one
    F.linear per matrix in bench/perf/decode_floor.py's runs). Every output is still the dot product of a weight
    row with x, summed in another order than F.linear's: on SmolLM2's matrices they differ by up to ~6e-7
    relative, the size of fp32 rounding, which
    tests/test_conventions.py::test_cached_decoding_matches_one_full_forward bounds.
    Which of the two a one-row product runs is measured (`row_split_wins`), and then kept measuring: every
    one-row call is timed, and the slower kernel is retried every OnlineChoice.EXPLORE calls, so a machine
    whose load changes (the split's fork/join is what a busy machine punishes) switches to the faster one.
    """
    blocks = _row_blocks(x, w)
    if blocks == 1:
        return F.linear(x, w, b)
    if _online is None:  # a fixed choice: forced by $SLMVIZ_ONE_ROW_KERNEL, one thread, or a test
        return _split_linear(x, w, b, blocks) if row_split_wins() else F.linear(x, w, b)
    online = _online_by_dtype.get(w.dtype)
    if online is None:  # each dtype learns its own costs (bf16's kernels are not fp32's), seeded by fp32's
        online = _online_by_dtype.setdefault(w.dtype, OnlineChoice(**_online.cost))
    kernel = online.pick()
    start = time.perf_counter()
    out = _split_linear(x, w, b, blocks) if kernel == "split" else F.linear(x, w, b)
    online.record(kernel, (time.perf_counter() - start) / w.numel())
    return out


def _split_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, blocks: int) -> torch.Tensor:
    """One row times w split into `blocks` row blocks, as one batched matmul (see `linear`)."""
    lead = x.shape[:-1]  # (1,) or (1, 1): one row
    x = x.reshape(1, x.shape[-1])
    rows = w.view(blocks, w.shape[0] // blocks, w.shape[1])  # [out, in] -> [blocks, out/blocks, in] (no copy)
    # x.t() of a [1, in] row with unit stride is an [in, 1] column MKL reads directly; a column built any
    # other way (e.g. x.view(in, 1), stride (1, 1)) sends bmm down a path ~4x slower.
    column = (x if x.stride(-1) == 1 else x.contiguous()).t().expand(blocks, -1, 1)  # [blocks, in, 1]
    out = torch.bmm(rows, column) if b is None else torch.baddbmm(b.view(blocks, -1, 1), rows, column)
    return out.view(*lead, -1)  # [blocks, out/blocks, 1] -> [..., 1, out]: the blocks in row order


_MIN_SPLIT = 1 << 16  # below ~256 KB of weights one core's read is too short to be worth the extra ops


def _row_blocks(x: torch.Tensor, w: torch.Tensor) -> int:
    """How many row blocks a one-row product could be split into: one per thread; 1 = never split (several rows,
    a small or strided w, not on the CPU, one thread), and then `linear` is F.linear with no measurement."""
    if x.numel() != x.shape[-1] or not w.is_contiguous() or w.numel() < _MIN_SPLIT or w.device.type != "cpu":
        return 1
    threads = torch.get_num_threads()
    if threads < 2:
        return 1
    n_out = w.shape[0]
    return next((k for k in range(threads, 1, -1) if n_out % k == 0), 1)


def probe_matrices(matrix_bytes: int) -> int:
    """How many matrices of `matrix_bytes` row_split_wins times: together 4x the last-level cache (64-512 MB).

    What breaks if the probe fits in the cache: it then measures cache bandwidth, where one core's F.linear keeps
    up, and picks F.linear for a model whose weights stream from memory. On this machine kind's AMD EPYC (32 MB
    of L3) the former 56 MB probe did exactly that, and decoding ran 2.4x slower than the split it passed over
    (bench/results/perf.md's floor rows: 33 ms of matmuls a step against a 14 ms split pass).
    Pinned by tests/test_fast_paths.py::test_the_kernel_probe_streams_from_memory_not_the_cache.
    """
    working_set = min(max(4 * last_level_cache_bytes(), 64 << 20), 512 << 20)
    return max(1, -(-working_set // matrix_bytes))


def last_level_cache_bytes() -> int:
    """The size of CPU 0's largest cache, from Linux's sysfs; 32 MiB where it cannot be read."""
    from pathlib import Path

    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = path.read_text().strip().upper()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        if text[-1:] in units and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes, default=32 << 20)


class OnlineChoice:
    """Two ways of doing the same work, named as keywords with their starting costs, and each one's recent cost: an
    exponential moving average of its own timed calls (for the one-row kernels, `split` and `linear`, seconds per
    weight element). A cost of math.inf is not yet measured, and its first counted call sets it; on a tie `best` is
    the second name. `pick` returns the cheaper one, and now and then the other so that its cost stays
    current: a run of RUN consecutive calls after EXPLORE calls, then after twice as many each time the retried
    kernel is still the slower one (up to MAX_INTERVAL: on a busy machine a retried split can cost a few ms),
    and again after EXPLORE once the choice flips. Both kernels give the same values to fp32 rounding (see
    `linear`), so switching changes no result beyond that; timing a call costs two clock reads (~0.1 µs)
    against a ~0.1-1 ms product.

    Why runs, and why the first call after a switch is not counted: while F.linear's one-core product is the choice,
    the split's second thread sleeps, and a lone retried split pays its wake-up. Judged on such single calls the
    split looks several times slower per element than when it runs every call, and decoding would stay on
    F.linear at twice the time of a step of splits (bench/perf/generate.py; docs/performance.md).
    Pinned by tests/test_fast_paths.py::test_a_retried_runs_first_call_is_not_counted.
    """

    EXPLORE = 32
    RUN = 16
    MAX_INTERVAL = 4096
    DECAY = 0.2
    CLIP = 4.0

    def __init__(self, **cost: float):
        if len(cost) != 2:
            raise ValueError(f"OnlineChoice chooses between two kernels, got {list(cost)}")
        self.cost = dict(cost)
        self.calls = 0
        self.interval = self.EXPLORE
        self.next_try = self.EXPLORE
        self.retry: str | None = None  # the kernel of the run under way
        self.retry_left = 0
        self.last: str | None = None  # the kernel of the previous call

    def best(self) -> str:
        first, second = self.cost
        return first if self.cost[first] < self.cost[second] else second

    def pick(self) -> str:
        self.calls += 1
        if self.retry is None and self.calls >= self.next_try:
            best = self.best()
            self.retry = next(kernel for kernel in self.cost if kernel != best)
            self.retry_left = self.RUN
        return self.retry or self.best()

    def record(self, kernel: str, seconds_per_element: float) -> None:
        switched, self.last = kernel != self.last, kernel
        if not switched:  # the first call after a switch pays the switch itself (a sleeping thread's wake-up)
            # One call preempted by the OS can take 50x its time; clipped at CLIP x the average, a lone outlier moves
            # it by at most (CLIP - 1) * DECAY, while a kernel that stays slower (a busy machine) still wins the
            # average over within a few calls.
            if self.cost[kernel] == math.inf:  # never measured: this first counted call is its cost
                self.cost[kernel] = seconds_per_element
            else:
                sample = min(seconds_per_element, self.CLIP * self.cost[kernel])
                self.cost[kernel] += self.DECAY * (sample - self.cost[kernel])
        if kernel == self.retry:
            self.retry_left -= 1
            if self.retry_left == 0:  # the run is over: back off while the other kernel stays ahead
                self.interval = self.next_interval(kernel)
                self.next_try = self.calls + self.interval
                self.retry = None

    def next_interval(self, retried: str) -> int:
        """Calls until the next retry, after a run of the `retried` kernel: EXPLORE once it has become the
        choice, twice the last interval (up to MAX_INTERVAL) while it stays the slower one."""
        return self.EXPLORE if self.best() == retried else min(2 * self.interval, self.MAX_INTERVAL)


class StepThreads(OnlineChoice):
    """Whether a decoding step runs on every thread torch has ("every") or on one ("one"), measured per model as
    seconds per step and row (Decoder.is_plain_step says which forwards are steps). Unmeasured, a step runs on
    every thread; "one" is tried after EXPLORE steps, in runs as OnlineChoice's.

    Why measured: a decoding step is a few hundred small ops, and its weight matrix-vector products and the
    unembedding are each split over the threads (the row split, or MKL's own threads). On a quiet machine every
    thread streams the weights faster. On a busy one (more runnable processes than cores, as on a shared machine)
    each split is an OpenMP fork/join whose join waits until the OS runs the other thread again, and a whole step
    on one thread is several times faster than on two (bench/results/families.md). Neither is right everywhere,
    and a machine's load changes while it decodes. The values differ only as the one-row kernels do (`linear`).
    torch's thread count is per Python thread once a thread has run torch, so a step on one thread leaves the
    app's other requests on theirs; a thread whose first torch call falls inside such a step starts on one.
    Pinned by tests/test_families_fast_paths.py::test_decoding_steps_measure_one_thread_against_every_thread.
    """

    EXPLORE = 8  # steps: a step is a whole forward, hundreds of times a one-row product
    RUN = 4
    MAX_INTERVAL = 512
    OVERHEAD = 0.05  # the share of decoding time the retries of the slower way may cost

    def __init__(self):
        super().__init__(one=math.inf, every=math.inf)

    def next_interval(self, retried: str) -> int:
        """OnlineChoice's interval, but at least long enough that the retries cost at most OVERHEAD of the time:
        on a busy machine a step on every thread can take several times one on one thread, and retrying it
        every few steps (a run each time) would eat much of what the choice saves."""
        interval = super().next_interval(retried)
        costs = sorted(self.cost.values())
        if math.inf in costs:
            return interval
        return min(max(interval, math.ceil(self.RUN * (costs[1] / costs[0] - 1) / self.OVERHEAD)), self.MAX_INTERVAL)

    def threads(self, kernel: str, device: torch.device) -> contextlib.AbstractContextManager:
        """The context a step picked as `kernel` runs in."""
        return one_thread(device) if kernel == "one" else contextlib.nullcontext()


_row_split_wins: bool | None = None  # measured on first use; tests set it to exercise one kernel
_online: OnlineChoice | None = None  # set by the measurement (not when forced); None: the choice is fixed
_online_by_dtype: dict[torch.dtype, OnlineChoice] = {}  # what `linear` updates, one per weight dtype
ONE_ROW_KERNEL_ENV = "SLMVIZ_ONE_ROW_KERNEL"  # "split" or "linear": skip the measurement


def row_split_wins() -> bool:
    """True if a one-row product is faster split into row blocks (bmm) than through F.linear, on this CPU.

    Measured, not assumed: on some CPUs MKL runs F.linear's matrix-vector product on one core and the split
    streams the weights faster (bench/perf/decode_floor.py); on others F.linear uses every core and the split is
    slower (bench/perf/gemma.py shows the unembedding's share of a step). On a busy machine (more runnable
    processes than cores) the split's fork/join waits for the OS to run its second thread again and loses by an
    order of magnitude. docs/performance.md records the figures. Both give the same numbers to fp32 rounding.
    Timed once per process on matrices the size of a decoder layer's ([768 · threads, 576] each, as
    many as `probe_matrices` says: at least 4x the CPU's last-level cache, so the passes stream from memory as a
    model's weights do), the median of 5 alternating passes after a warm-up (~0.3 s), which also seeds the
    OnlineChoice that `linear` keeps updating from then on; $SLMVIZ_ONE_ROW_KERNEL=split|linear decides
    instead, once and for all.
    """
    global _row_split_wins, _online
    if _row_split_wins is None:
        import os
        import statistics

        forced = os.environ.get(ONE_ROW_KERNEL_ENV)
        if forced in ("split", "linear"):
            _row_split_wins = forced == "split"
        else:
            threads = torch.get_num_threads()
            if threads < 2:
                _row_split_wins = False
            else:
                ws = [torch.randn(768 * threads, 576) for _ in range(probe_matrices(768 * threads * 576 * 4))]
                x = torch.randn(1, 576)
                column = x.t().expand(threads, -1, 1)

                def split() -> None:
                    for w in ws:
                        torch.bmm(w.view(threads, -1, 576), column)

                def plain() -> None:
                    for w in ws:
                        F.linear(x, w)

                times: dict[str, list[float]] = {"split": [], "plain": []}
                with torch.inference_mode():
                    split(), plain()
                    for _ in range(5):
                        for name, fn in (("split", split), ("plain", plain)):
                            start = time.perf_counter()
                            fn()
                            times[name].append(time.perf_counter() - start)
                elements = sum(w.numel() for w in ws)
                split_cost, plain_cost = (statistics.median(times[k]) / elements for k in ("split", "plain"))
                _row_split_wins = split_cost < plain_cost
                _online = OnlineChoice(split=split_cost, linear=plain_cost)
    return _row_split_wins


@contextlib.contextmanager
def one_thread(device: torch.device) -> Iterator[None]:
    """Run the ops inside on one CPU thread (torch's thread count is restored after; no-op off the CPU).

    A decoding step's attention is three ops on a few thousand numbers (baddbmm, softmax, bmm), and ATen still
    splits each over every thread. Each split is an OpenMP fork/join: on a quiet machine a few µs, 90 of them a
    step; on a busy one (more runnable processes than cores) the join waits until the OS runs the other thread
    again, which can cost a tiny 30-layer model's step ten times its one-thread time. On one thread
    they compute the same numbers (each output is one thread's dot product either way).
    Pinned by tests/test_fast_paths.py::test_one_thread_restores_the_thread_count_and_changes_no_number.
    """
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


_bf16_slowdown: float | None = None  # measured on first use; tests set it to exercise the warning


def bf16_matmul_slowdown() -> float:
    """time(bf16 GEMM) / time(fp32 GEMM) on this CPU, measured once per process: above 1, bf16 is slower.

    Measured, not read from the CPU's name: with AVX512-BF16 or AMX a bf16 GEMM runs several times faster than
    fp32 (this machine kind's Xeon with AMX: ~6.5x, its AMD EPYC with AVX512-BF16: ~3x); without them
    PyTorch converts in software and the same product can be tens to hundreds of times slower. Timed on a
    [64, 512] x [512, 512] product (34 MFLOP: ~1 ms in fp32, at most ~0.2 s even where bf16 is 100x slower),
    one warm-up each, then the min of 3 alternating runs.
    """
    global _bf16_slowdown
    if _bf16_slowdown is None:
        fp32, bf16 = _best_matmul_seconds((64, 512), (512, 512), repeats=3)
        _bf16_slowdown = bf16 / fp32
    return _bf16_slowdown


_bf16_bulk_speedup: float | None = None  # measured on first use; tests set it
BF16_SPEEDUP = 1.5  # bulk work runs in bf16 (train_sae's dtype=None, the app's fast switch) where it wins by this


def bf16_bulk_speedup() -> float:
    """time(fp32 GEMM) / time(bf16 GEMM) for bulk work (a batched forward's [1024, 576] x [576, 2048] product) on
    this CPU, measured once per process: above 1, bf16 is faster. The app offers its "fast (bf16)" switch for
    scans and sweeps from this (app/fast_mode.py).

    A product of bulk size, not bf16_matmul_slowdown's small one: the two ratios differ by a factor of two or more
    on the same CPU, and a decision near a threshold must not flip between processes.
    The best of 5 alternating runs after a warm-up each (~0.1 s).
    """
    global _bf16_bulk_speedup
    if _bf16_bulk_speedup is None:
        fp32, bf16 = _best_matmul_seconds((1024, 576), (2048, 576), repeats=5)
        _bf16_bulk_speedup = fp32 / bf16
    return _bf16_bulk_speedup


def _best_matmul_seconds(x_shape: tuple[int, int], w_shape: tuple[int, int], repeats: int) -> tuple[float, float]:
    """(fp32, bf16) seconds of F.linear(x, w) on random x [x_shape], w [w_shape]: one warm-up each, then the best of
    `repeats` alternating runs (alternating, so a neighbour's burst of work lands on both dtypes)."""
    torch.manual_seed(0)
    x, w = torch.randn(x_shape), torch.randn(w_shape)
    pairs = {torch.float32: (x, w), torch.bfloat16: (x.bfloat16(), w.bfloat16())}
    best = {dtype: float("inf") for dtype in pairs}
    with torch.inference_mode():
        for a, b in pairs.values():
            F.linear(a, b)
        for _ in range(repeats):
            for dtype, (a, b) in pairs.items():
                start = time.perf_counter()
                F.linear(a, b)
                best[dtype] = min(best[dtype], time.perf_counter() - start)
    return best[torch.float32], best[torch.bfloat16]
