"""The prefix cache: full blocks of global KV, found again by a hash chain of their tokens.

Only the persistent state is cached: the global main KV and index keys, which depend on the tokens alone
(through the encoder). The sliding window is rebuilt on a hit by bounded replay; in exact mode (replay
off) the window rows are stored with the blocks too. A block becomes shareable as soon as it is full.
"""

from __future__ import annotations

import hashlib
import struct


def block_hashes(
    tokens: list[int], block_size: int, salt: str | None = None, start: int = 0, parent: bytes | None = None
) -> list[bytes]:
    """Chained digests of the full blocks from block ``start`` on; each covers every token before it."""
    out = []
    h = parent if parent is not None else hashlib.blake2b((salt or "").encode(), digest_size=16).digest()
    for b in range(start, len(tokens) // block_size):
        chunk = tokens[b * block_size : (b + 1) * block_size]
        h = hashlib.blake2b(h + struct.pack(f"<{len(chunk)}q", *chunk), digest_size=16).digest()
        out.append(h)
    return out


class PrefixCache:
    def __init__(self):
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self._block_of)

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """Physical blocks of the longest cached prefix of ``hashes``."""
        out = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def register(self, block: int, h: bytes) -> None:
        if h not in self._block_of and block not in self._hash_of:  # the first copy stays canonical
            self._block_of[h] = block
            self._hash_of[block] = h

    def evict(self, block: int) -> None:
        """The pool is reusing ``block`` for new data: forget what it held."""
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._block_of[h]

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def clear(self) -> None:
        self._block_of.clear()
        self._hash_of.clear()
