"""A preallocated KV cache: one [b, g, capacity, d_head] buffer per layer for keys and values."""

from __future__ import annotations

import torch


class KVCache:
    """Keys (after RoPE) and values of every position seen so far, per layer.

    Buffers are allocated once for `capacity` positions and written in place, so a decoding step
    never reallocates; `grow` doubles them if a caller goes past the capacity it asked for.
    `length` is the number of positions *committed*: the decoder advances it once per forward,
    after every layer has appended (see decoder.position_offset).
    """

    def __init__(self, n_layers: int, n_kv_heads: int, d_head: int, capacity: int, dtype=torch.float32,
                 batch: int = 1, device: torch.device | str = "cpu"):
        shape = (batch, n_kv_heads, capacity, d_head)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [b, g, n_new, dh] after the committed positions; return views of all keys/values so far."""
        start, n_new = self.length, k.shape[2]
        if start + n_new > self.capacity:
            self._grow(start + n_new)
        keys, values = self.k[layer], self.v[layer]
        # narrow(), not slicing: a decoding step writes 60 of these (k and v of every layer), and narrow skips
        # Python's slice parsing.
        keys.narrow(2, start, n_new).copy_(k)
        values.narrow(2, start, n_new).copy_(v)
        return keys.narrow(2, 0, start + n_new), values.narrow(2, 0, start + n_new)

    def advance(self, n_new: int) -> None:
        self.length += n_new

    def _grow(self, needed: int) -> None:
        new_capacity = max(needed, 2 * self.capacity)
        for buffers in (self.k, self.v):
            for i, old in enumerate(buffers):
                new = old.new_empty(old.shape[0], old.shape[1], new_capacity, old.shape[3])
                new[:, :, : self.length] = old[:, :, : self.length]
                buffers[i] = new
