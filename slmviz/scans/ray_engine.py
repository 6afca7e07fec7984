"""The Ray engine of `slmviz.scan`: the same shards through `run_shard` on a Ray Data actor pool.

Each actor loads the model once (from the driver model's folder, which must exist on every node), then
per call reads one shard of the corpus itself (corpus.read_shard: a file's byte offset or row and a count,
or a list's texts), tokenizes and runs it, and returns its merged partial result serialized with
safetensors (no pickled tensors in the results). The driver merges shard results in shard order with the
same code as the local engine, so `engine="ray"` equals `engine="local"` exactly, provided each actor runs
torch with the driver's thread count (done here: a GEMM's rounding may depend on how many threads split it).

Ray pitfalls measured on this machine (Ray 2.60):
- output order is not preserved by default: `preserve_order` is switched on AND every result carries its
  shard index, and the driver re-orders with a small buffer, so order never depends on Ray's settings;
- an unreachable `RAY_ADDRESS` makes `ray.init` retry forever: the address is probed first with a TCP
  connect bounded by `CONNECT_TIMEOUT_S`;
- `write_parquet` appends to an existing folder by default: the engine never writes through Ray (the
  reduced results are small and `Scan.save` writes them on the driver, replacing its files); anything
  written with Ray Data from a scan's output should pass `mode="overwrite"`.
- `compute=ActorPoolStrategy(size=n)`, not the deprecated `concurrency=`.

Memory: for a corpus file the driver holds one small source per shard (found in one pass over the file's
lines) and the shard results waiting to be merged, never the corpus's text, tokens or activations; a list
corpus is in the driver's memory already, and its shards carry their texts.
Untested here (no GPU, no cluster): a CUDA model asks each actor for one GPU (`num_gpus=1`) and loads
the model there; a remote cluster needs slmviz installed on its nodes and the model folder at the same path.
"""

from __future__ import annotations

import inspect
import json
import os
import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import torch

from ..corpora.reading import read_shard
from .batches import ScanSpec
from .shards import Shard, ShardResult, run_shard

CONNECT_TIMEOUT_S = 10.0
INSTALL_HINT = 'pip install "slmviz[ray]"  (or: pip install "ray[data]==2.60.0")'


def import_ray() -> Any:
    try:
        import ray
        import ray.data  # noqa: F401 - ray without the [data] extra has no ray.data
    except ImportError as e:
        raise ImportError(f"engine='ray' needs Ray Data, which is not installed: {INSTALL_HINT}") from e
    return ray


def run_on_ray(model: Any, sources: list[dict], spec: ScanSpec, absorb: Callable[[ShardResult], None],
               workers: int) -> None:
    """Run every shard on an actor pool of `workers` actors and `absorb` the results in shard order.
    sources: corpus.shard_sources (each actor reads its own shard's documents)."""
    ray = import_ray()
    if model.path is None:
        raise ValueError("engine='ray' loads the model in each actor from its folder; this model has no folder")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if not sources:
        return
    started_here = connect(ray, workers)
    try:
        items = [{"index": i, "source": json.dumps(source)} for i, source in enumerate(sources)]
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
        next_index = 0
        for row in results.iter_rows():
            pending[int(row["index"])] = row["result"]
            while next_index in pending:  # merge strictly in shard order, whatever order rows arrive in
                absorb(ShardResult.from_tensors(load_tensors(pending.pop(next_index)), spec.hooks))
                next_index += 1
        if pending or next_index != len(sources):
            raise RuntimeError(f"Ray returned an incomplete scan: {len(pending)} shards out of order, "
                               f"next expected {next_index} of {len(sources)}")
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


def save_tensors(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save(tensors)


def load_tensors(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(bytes(data))


class ScanActor:
    """One Ray actor: loads the model once, then reads and runs one shard per call (`run_shard`)."""

    def __init__(self, model_path: str, spec: ScanSpec, on_gpu: bool = False):
        from ..model_api import load
        from .units import feature_of

        torch.set_num_threads(spec.threads)  # the driver's count: identical GEMM rounding
        load_kwargs = {"device": "cuda"} if on_gpu and "device" in inspect.signature(load).parameters else {}
        self.model = load(model_path, **load_kwargs)
        self.spec = spec
        self.features = {h: feature_of(h, self.model.hook_names, self.model.cfg, spec.saes) for h in spec.hooks}

    def __call__(self, rows: dict[str, np.ndarray]) -> dict[str, list]:
        out_index, out_result = [], []
        for index, source in zip(rows["index"].tolist(), rows["source"].tolist(), strict=True):
            spec = json.loads(source)
            shard = Shard(int(index), int(spec["first_doc"]), tuple(read_shard(spec)))
            result = run_shard(self.model, shard, self.spec, self.features)
            out_index.append(int(index))
            out_result.append(save_tensors(result.to_tensors()))
        return {"index": np.array(out_index), "result": np.array(out_result, dtype=object)}
