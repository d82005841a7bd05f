"""A pool of fixed-size KV blocks (or window slots): a free list and a reference count per block.

Reference counts let the prefix cache share a block between requests later; for now every block has one
owner. ``check`` verifies the invariant the engine relies on after every step: each block is either free
or referenced, never both, and the free list has no duplicates.
"""
from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    """Raised when an allocation asks for more blocks than are free (the scheduler checks first)."""


class BlockPool:
    def __init__(self, num_blocks: int, name: str = "block"):
        self.name = name
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self._free = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} {self.name}s, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self.ref[i] = 1
        return ids

    def free(self, ids) -> None:
        for i in ids:
            if self.ref[i] <= 0:
                raise RuntimeError(f"{self.name} {i} freed twice")
            self.ref[i] -= 1
            if self.ref[i] == 0:
                self._free.append(i)

    def check(self, owned: list[int] | None = None) -> None:
        """Invariants; ``owned`` (the blocks live requests hold, with repeats for sharing) must match."""
        free = list(self._free)
        _require(len(free) == len(set(free)), f"{self.name} free list has duplicates")
        _require(all(self.ref[i] == 0 for i in free), f"a free {self.name} is still referenced")
        _require(sum(1 for r in self.ref if r > 0) + len(free) == self.num_blocks, f"a {self.name} leaked")
        if owned is not None:
            counts: dict[int, int] = {}
            for i in owned:
                counts[i] = counts.get(i, 0) + 1
            _require(counts == {i: r for i, r in enumerate(self.ref) if r > 0}, f"{self.name} owners disagree")


class InvariantError(RuntimeError):
    """The cache's bookkeeping is inconsistent: a bug, never a user error."""


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise InvariantError(msg)
