"""The in-process tier: an LRU of byte strings held to a byte budget.

Used from one event loop only (no locks). The budget counts each entry as its key and value
lengths plus ``ENTRY_OVERHEAD``, an estimate of what CPython spends around them (two bytes
objects' headers and the ordered dict's slot and link), so small values cannot make the real
footprint run far past the budget.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import compress
from collections.abc import Sequence
from dataclasses import dataclass

ENTRY_OVERHEAD = 160


@dataclass(slots=True)
class MemoryStats:
    hits: int = 0
    misses: int = 0
    inserts: int = 0
    evictions: int = 0
    rejected: int = 0  # values larger than the whole budget, never stored


class MemoryCache:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.stats = MemoryStats()
        self._data: OrderedDict[bytes, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: bytes) -> bool:
        return key in self._data

    def get(self, key: bytes) -> bytes | None:
        return self.get_many((key,))[0]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Values in the order of ``keys`` (None for a miss); hits become most recently used."""
        data = self._data
        out = list(map(data.get, keys))
        misses = out.count(None)
        hits = len(out) - misses
        if hits == len(out):
            deque(map(data.move_to_end, keys), 0)  # loops in C, not per row in Python
        elif hits:
            deque(map(data.move_to_end, compress(keys, out)), 0)  # values are never empty
        self.stats.hits += hits
        self.stats.misses += misses
        return out

    def put(self, key: bytes, value: bytes) -> None:
        self.put_many((key,), (value,))

    def put_many(self, keys: Sequence[bytes], values: Sequence[bytes]) -> None:
        data = self._data
        budget = self.max_bytes
        n = len(keys)
        if n and max(map(len, values)) + max(map(len, keys)) + ENTRY_OVERHEAD <= budget:
            before = len(data)
            data.update(zip(keys, values))
            if len(data) - before == n:  # the usual batch: all new keys, accounted in C
                self.bytes += sum(map(len, keys)) + sum(map(len, values)) + n * ENTRY_OVERHEAD
                self.stats.inserts += n
                if self.bytes > budget:
                    self._evict()
                return
            # Some key was there already (or repeated): recount those entries exactly. Rare.
            for k in keys:
                data.pop(k, None)
            self.bytes = sum(len(k) + len(v) for k, v in data.items()) + len(data) * ENTRY_OVERHEAD
        st = self.stats
        for k, v in zip(keys, values):
            size = len(k) + len(v) + ENTRY_OVERHEAD
            if size > budget:
                st.rejected += 1
                continue
            old = data.pop(k, None)
            if old is not None:
                self.bytes -= len(k) + len(old) + ENTRY_OVERHEAD
            data[k] = v
            self.bytes += size
            st.inserts += 1
        if self.bytes > budget:
            self._evict()

    def _evict(self) -> None:
        data = self._data
        budget = self.max_bytes
        n = 0
        while self.bytes > budget and data:
            k, v = data.popitem(last=False)
            self.bytes -= len(k) + len(v) + ENTRY_OVERHEAD
            n += 1
        self.stats.evictions += n

    def clear(self) -> None:
        self._data.clear()
        self.bytes = 0
