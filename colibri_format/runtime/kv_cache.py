"""Per-sequence key/value cache: one growable [capacity, kv_heads, head_dim] buffer pair per layer.

Sequences of a batch each own a cache, so a batch needs no padding: every sequence keeps its own length.
"""

from __future__ import annotations

import numpy as np


class KVCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int = 64) -> None:
        shape = (capacity, kv_heads, head_dim)
        self.keys = [np.zeros(shape, np.float32) for _ in range(num_layers)]
        self.values = [np.zeros(shape, np.float32) for _ in range(num_layers)]
        self.length = 0  # tokens committed by completed forward passes

    def extend(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Writes k, v [n, kv_heads, hd] after the committed tokens; returns all keys and values [length+n, ...]."""
        end = self.length + len(k)
        self._reserve(layer, end)
        self.keys[layer][self.length:end] = k
        self.values[layer][self.length:end] = v
        return self.keys[layer][:end], self.values[layer][:end]

    def commit(self, n: int) -> None:
        self.length += n

    def _reserve(self, layer: int, size: int) -> None:
        capacity = len(self.keys[layer])
        if size <= capacity:
            return
        new_capacity = max(size, 2 * capacity)
        for buffers in (self.keys, self.values):
            grown = np.zeros((new_capacity, *buffers[layer].shape[1:]), np.float32)
            grown[:capacity] = buffers[layer]
            buffers[layer] = grown
