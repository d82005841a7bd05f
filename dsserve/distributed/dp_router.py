"""Which DP rank serves a request (the spec's section 5, in its simplest form).

Load is the front end's own count of a rank's requests in flight (routed, not yet finished or aborted): the engine's
running + waiting, without waiting for the rank to report it. A request with an affinity key goes where its key went
before, so that a session's turns meet their prefix cache, unless that rank is more than ``slack`` requests busier
than the least loaded one (the overload guard: absolute affinity would pin a whole group of sessions to one rank);
without a key, or a key seen for the first time, to the least loaded rank (ties: the lowest rank). The key is the
session (``X-Session-ID``, ``user``, a conversation id) when one is given, else the prompt's first full KV block
(salted like the prefix cache): the tokens a later turn of the same conversation starts with.
"""

from __future__ import annotations

import random
from collections import OrderedDict

POLICIES = ("balance", "random")


class DPRouter:
    def __init__(
        self,
        dp_size: int,
        block_size: int,
        policy: str = "balance",
        slack: int = 8,
        seed: int = 0,
        max_keys: int = 1 << 16,
    ):
        """``policy``: balance (least loaded with affinity) | random (uniform, no affinity: the reference a
        measurement compares affinity against)."""
        if policy not in POLICIES:
            raise ValueError(f"DP routing policy {policy!r}: one of {list(POLICIES)}")
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        self.dp_size, self.block_size, self.policy, self.slack = dp_size, block_size, policy, slack
        self.load = [0] * dp_size  # requests in flight per rank
        self.routed = [0] * dp_size  # requests ever routed per rank
        self.affine = 0  # requests that went to their key's earlier rank
        self._keys: OrderedDict = OrderedDict()  # affinity key -> rank, least recently used first
        self._max_keys, self._rng = max_keys, random.Random(seed)

    def key(self, prompt: list[int], session_id: str | None = None, cache_salt: str | None = None):
        """The request's affinity key, or None (no session and a prompt shorter than one block)."""
        if session_id:
            return ("session", session_id)
        if len(prompt) >= self.block_size:
            return ("block", cache_salt, tuple(prompt[: self.block_size]))
        return None

    def choose(
        self,
        prompt: list[int],
        session_id: str | None = None,
        cache_salt: str | None = None,
        rank: int | None = None,
    ) -> int:
        """The rank for a request, counted as in flight there (``finished`` releases it). ``rank``: pinned (a
        ValueError when out of range)."""
        if rank is not None:
            if not 0 <= rank < self.dp_size:
                raise ValueError(f"data-parallel rank {rank} does not exist: ranks are 0..{self.dp_size - 1}")
            chosen = rank
        elif self.policy == "random":
            chosen = self._rng.randrange(self.dp_size)
        else:
            least = min(range(self.dp_size), key=lambda r: self.load[r])
            k = self.key(prompt, session_id, cache_salt)
            prev = None if k is None else self._keys.get(k)
            if prev is not None and self.load[prev] <= self.load[least] + self.slack:
                chosen = prev
                self.affine += 1
            else:
                chosen = least
            if k is not None:
                self._keys[k] = chosen
                self._keys.move_to_end(k)
                if len(self._keys) > self._max_keys:
                    self._keys.popitem(last=False)
        self.load[chosen] += 1
        self.routed[chosen] += 1
        return chosen

    def finished(self, rank: int) -> None:
        self.load[rank] -= 1
