"""Which server owns which parameters: contiguous ranges of the flat buffer, and sparse rows
by consistent hashing.

Both are pure functions of their arguments (no processes, no randomness beyond a fixed
seed), so workers, servers, the tree PS and the simulator compute the same placement
independently and never need to exchange it.

- Dense parameters are one flat buffer (every tensor of the model, in registration order)
  split into S contiguous ranges of equal length, to within one element, as Li et al. 2014
  partition their key space into ranges. Ranges ignore tensor boundaries: a tensor may
  straddle two servers and a server may hold a piece of one tensor only, so the load is
  balanced by size whatever the shapes, even when S exceeds the number of tensors.
- Sparse rows (embedding tables) go to servers by consistent hashing with virtual nodes
  (Karger et al. 1997, as in Li et al. 2014's server manager): each server owns
  ``vnodes`` points on a 64-bit ring and a row belongs to the first point clockwise from
  its key's hash. Rows spread evenly, and adding a server moves only about 1/(S+1) of them.
"""
from __future__ import annotations

import hashlib

import numpy as np
import torch

__all__ = ["RangeSharding", "HashRing", "mix64"]


class RangeSharding:
    """``numel`` elements split into ``servers`` contiguous ranges balanced by size."""

    def __init__(self, numel: int, servers: int) -> None:
        if numel < 0 or servers < 1:
            raise ValueError(f"need numel >= 0 and servers >= 1, got {numel} and {servers}")
        self.numel, self.servers = numel, servers
        # bounds[s] = floor(s * numel / servers): range lengths differ by at most one.
        self.bounds = [s * numel // servers for s in range(servers + 1)]

    def range(self, server: int) -> tuple[int, int]:
        """[start, stop) of ``server``'s range."""
        return self.bounds[server], self.bounds[server + 1]

    def size(self, server: int) -> int:
        start, stop = self.range(server)
        return stop - start

    def owner(self, index: int) -> int:
        """The server that owns flat element ``index``."""
        if not 0 <= index < self.numel:
            raise IndexError(f"element {index} outside [0, {self.numel})")
        # The last bound not above index; empty ranges share a bound and are skipped.
        lo, hi = 0, self.servers
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.bounds[mid] <= index:
                lo = mid
            else:
                hi = mid
        return lo


_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(keys: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fast, well-mixed 64-bit hash of integer keys (uint64 array)."""
    with np.errstate(over="ignore"):
        z = keys.astype(np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


class HashRing:
    """Consistent hashing of integer row keys onto ``servers`` servers, ``vnodes`` points each."""

    def __init__(self, servers: int, vnodes: int = 64) -> None:
        if servers < 1 or vnodes < 1:
            raise ValueError(f"need servers >= 1 and vnodes >= 1, got {servers} and {vnodes}")
        self.servers, self.vnodes = servers, vnodes
        points, owners = [], []
        for s in range(servers):
            for v in range(vnodes):
                # A cryptographic hash of the name, so points do not depend on S or on
                # Python's salted hash(): server s keeps its points when servers are added.
                digest = hashlib.blake2b(f"server {s} vnode {v}".encode(), digest_size=8).digest()
                points.append(int.from_bytes(digest, "little"))
                owners.append(s)
        order = np.argsort(np.array(points, dtype=np.uint64), kind="stable")
        self._points = np.array(points, dtype=np.uint64)[order]
        self._owners = np.array(owners, dtype=np.int64)[order]

    def owners(self, keys: torch.Tensor | np.ndarray) -> torch.Tensor:
        """The server of each key (int64 tensor shaped like ``keys``)."""
        arr = keys.cpu().numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
        if arr.size and arr.min() < 0:
            raise ValueError("row keys must be non-negative")
        slot = np.searchsorted(self._points, mix64(arr.reshape(-1)), side="left")
        slot[slot == len(self._points)] = 0  # wrap around the ring
        return torch.from_numpy(self._owners[slot].reshape(arr.shape))

    def keys_of(self, server: int, num_rows: int) -> torch.Tensor:
        """The sorted keys in [0, num_rows) that ``server`` owns."""
        all_keys = torch.arange(num_rows, dtype=torch.int64)
        return all_keys[self.owners(all_keys) == server]
