"""A pool of fixed-size KV blocks (or window slots): reference counts and an LRU queue of free blocks.

A free block may still hold a cached prefix (the prefix cache maps its hash to it): a hit takes it back
out of the queue (``touch``); an allocation evicts the least recently freed one first, and tells the
prefix cache through ``on_evict``. Blocks of a finished request whose session is still alive wait in a
second queue that is evicted only after the plain LRU queue is empty.

``check`` verifies the invariants the engine relies on after every step: each block is free (queued) or
referenced, never both, and the owners the engine knows about account for every reference.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable


class OutOfBlocks(RuntimeError):
    """Raised when an allocation asks for more blocks than are free (the scheduler checks first)."""


class InvariantError(RuntimeError):
    """The cache's bookkeeping is inconsistent: a bug, never a user error."""


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise InvariantError(msg)


class BlockPool:
    def __init__(self, num_blocks: int, name: str = "block", on_evict: Callable[[int], None] | None = None):
        self.name = name
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.on_evict = on_evict
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self._held: OrderedDict[int, float] = OrderedDict()  # session-retained: block -> expiry time

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._held)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocks(f"asked for {n} {self.name}s, {self.num_free} free")
        ids = []
        for _ in range(n):
            queue = self._free if self._free else self._held
            b, _ = queue.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(b)
            self.ref[b] = 1
            ids.append(b)
        return ids

    def touch(self, ids) -> None:
        """Take a reference on blocks found in the prefix cache (free ones leave the queues)."""
        for b in ids:
            if self.ref[b] == 0:
                self._free.pop(b, None)
                self._held.pop(b, None)
            self.ref[b] += 1

    def free(self, ids, hold_until: float | None = None) -> None:
        """Drop one reference each. Blocks freed together are queued last-first, so a request's tail goes
        before its head (a later request more likely shares the head). ``hold_until``: session retention."""
        for b in reversed(list(ids)):
            if self.ref[b] <= 0:
                raise RuntimeError(f"{self.name} {b} freed twice")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if hold_until is None:
                    self._free[b] = None
                else:
                    self._held[b] = hold_until

    def expire_holds(self, now: float) -> int:
        """Session holds past their time rejoin the plain LRU queue (at its head: they are old)."""
        done = [b for b, t in self._held.items() if t <= now]
        for b in done:
            del self._held[b]
            self._free[b] = None
            self._free.move_to_end(b, last=False)
        return len(done)

    def check(self, owned: list[int] | None = None) -> None:
        """Invariants; ``owned`` (the blocks live requests hold, with repeats for sharing) must match."""
        queued = list(self._free) + list(self._held)
        _require(len(queued) == len(set(queued)), f"a {self.name} is queued twice")
        _require(all(self.ref[i] == 0 for i in queued), f"a queued {self.name} is still referenced")
        _require(sum(1 for r in self.ref if r > 0) + len(queued) == self.num_blocks, f"a {self.name} leaked")
        if owned is not None:
            counts: dict[int, int] = {}
            for i in owned:
                counts[i] = counts.get(i, 0) + 1
            _require(counts == {i: r for i, r in enumerate(self.ref) if r > 0}, f"{self.name} owners disagree")
