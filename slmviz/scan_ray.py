"""The Ray engine of `slmviz.scan`: the same batches through `run_batch` on a Ray Data actor pool.

Each actor loads the model once (from the driver model's folder, which must exist on every node) and
turns one planned batch into its partial result, serialized with safetensors (no pickled tensors in
the results). The driver merges partials in batch-index order with the same code as the local engine,
so `engine="ray"` equals `engine="local"` exactly, provided each actor runs torch with the driver's
thread count (done here: a GEMM's rounding may depend on how many threads split it).

Ray pitfalls measured on this machine (DESIGN.md, Ray 2.60):
- output order is not preserved by default: `preserve_order` is switched on AND every result carries its
  batch index, and the driver re-orders with a small buffer, so order never depends on Ray's settings;
- an unreachable `RAY_ADDRESS` makes `ray.init` retry forever: the address is probed first with a TCP
  connect bounded by `CONNECT_TIMEOUT_S`;
- `write_parquet` appends to an existing folder by default: the engine never writes through Ray (the
  reduced results are small and `Scan.save` writes them on the driver, replacing its files); anything
  written with Ray Data from a scan's output should pass `mode="overwrite"`.
- `compute=ActorPoolStrategy(size=n)`, not the deprecated `concurrency=`.

Memory: the driver holds the token ids of the planned batches (4-8 bytes a token), not activations.
Untested here (no GPU, no cluster): a CUDA model asks each actor for one GPU (`num_gpus=1`) and loads
the model there; a remote cluster needs slmviz installed on its nodes and the model folder at the same path.
"""

from __future__ import annotations

import inspect
import os
import socket
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import torch

from .scan_batches import Batch, BatchResult, ScanSpec, Window, run_batch

CONNECT_TIMEOUT_S = 10.0
INSTALL_HINT = 'pip install "slmviz[ray]"  (or: pip install "ray[data]==2.60.0")'


def import_ray() -> Any:
    try:
        import ray
        import ray.data  # noqa: F401 - ray without the [data] extra has no ray.data
    except ImportError as e:
        raise ImportError(f"engine='ray' needs Ray Data, which is not installed: {INSTALL_HINT}") from e
    return ray


def run_on_ray(model: Any, batches: Iterable[Batch], spec: ScanSpec,
               absorb: Callable[[BatchResult, Batch], None], workers: int, report: Callable[[], None]) -> None:
    """Run every batch on an actor pool of `workers` actors and `absorb` the results in batch order."""
    ray = import_ray()
    if model.path is None:
        raise ValueError("engine='ray' loads the model in each actor from its folder; this model has no folder")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    started_here = connect(ray, workers)
    try:
        planned = list(batches)
        if not planned:
            return
        by_index = {b.index: b for b in planned}
        items = [encode_batch(b) for b in planned]
        data = ray.data.DataContext.get_current()
        data.execution_options.preserve_order = True
        data.enable_progress_bars = False  # slmviz shows its own bar
        on_gpu = model.decoder.params.embed.device.type == "cuda"
        results = ray.data.from_items(items).map_batches(
            ScanActor, fn_constructor_kwargs={"model_path": str(model.path), "spec": spec, "on_gpu": on_gpu},
            batch_size=1, batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=workers),
            num_cpus=1, num_gpus=1 if on_gpu else None,
        )
        pending: dict[int, bytes] = {}
        next_index = planned[0].index
        for row in results.iter_rows():
            pending[int(row["index"])] = row["result"]
            while next_index in pending:  # merge strictly in batch order, whatever order rows arrive in
                absorb(decode_result(pending.pop(next_index), spec), by_index[next_index])
                next_index += 1
                report()
        if pending or next_index != planned[-1].index + 1:
            raise RuntimeError(f"Ray returned an incomplete scan: {len(pending)} batches out of order, "
                               f"next expected {next_index}")
    finally:
        if started_here:
            ray.shutdown()


def connect(ray: Any, workers: int) -> bool:
    """Join the cluster at $RAY_ADDRESS (probed first, bounded) or start a local node. True if started here."""
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if address and address not in ("local", "auto"):
        probe(address)
        ray.init(address=address, log_to_driver=False)
    elif address == "auto":
        ray.init(address="auto", log_to_driver=False)
    else:
        ray.init(address="local", num_cpus=max(workers, 1), include_dashboard=False, log_to_driver=False)
    return True


def probe(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Raise ConnectionError unless a TCP connection to host:port of `address` opens within `timeout` s."""
    parts = urlsplit(address if "://" in address else f"ray://{address}")
    host, port = parts.hostname, parts.port
    if not host or not port:
        raise ConnectionError(f"RAY_ADDRESS={address!r} is not host:port (or ray://host:port)")
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as e:
        raise ConnectionError(
            f"Cannot reach the Ray cluster at RAY_ADDRESS={address!r} within {timeout:g} s ({e}); "
            "unset RAY_ADDRESS to scan on a local Ray node"
        ) from e


def encode_batch(batch: Batch) -> dict[str, Any]:
    """A batch as one Arrow-friendly row: flat ids plus per-window length, document and offset."""
    return {
        "index": batch.index,
        "ids": [i for w in batch.windows for i in w.ids],
        "lengths": [len(w.ids) for w in batch.windows],
        "docs": [w.doc for w in batch.windows],
        "offsets": [w.offset for w in batch.windows],
    }


def decode_batch(row: dict[str, Any]) -> Batch:
    ids = np.asarray(row["ids"]).tolist()
    windows, start = [], 0
    for n, doc, offset in zip(np.asarray(row["lengths"]).tolist(), np.asarray(row["docs"]).tolist(),
                              np.asarray(row["offsets"]).tolist(), strict=True):
        windows.append(Window(doc, offset, tuple(ids[start:start + n])))
        start += n
    return Batch(int(row["index"]), tuple(windows))


def encode_result(result: BatchResult) -> bytes:
    from safetensors.torch import save

    return save(result.to_tensors())


def decode_result(data: bytes, spec: ScanSpec) -> BatchResult:
    from safetensors.torch import load

    return BatchResult.from_tensors(load(bytes(data)), spec.hooks)


class ScanActor:
    """One Ray actor: loads the model once, then runs `run_batch` on one planned batch per call."""

    def __init__(self, model_path: str, spec: ScanSpec, on_gpu: bool = False):
        import slmviz
        from slmviz.features import feature_of

        torch.set_num_threads(spec.threads)  # the driver's count: identical GEMM rounding
        load_kwargs = {"device": "cuda"} if on_gpu and "device" in inspect.signature(slmviz.load).parameters else {}
        self.model = slmviz.load(model_path, **load_kwargs)
        self.spec = spec
        self.features = {h: feature_of(h, self.model.hook_names, self.model.cfg) for h in spec.hooks}

    def __call__(self, rows: dict[str, np.ndarray]) -> dict[str, list]:
        out_index, out_result = [], []
        for i in range(len(rows["index"])):
            batch = decode_batch({k: v[i] for k, v in rows.items()})
            out_index.append(batch.index)
            out_result.append(encode_result(run_batch(self.model, batch, self.spec, self.features)))
        return {"index": np.array(out_index), "result": np.array(out_result, dtype=object)}
