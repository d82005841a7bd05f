"""Deterministic Engram hashing (spec 1.5, 2.7): bucket primes, table offsets, hash multipliers, row indices.

Everything here depends only on the config and on (compressed) token ids, never on weights.

Prime rule (release ``engram.py`` as restated by Penguinjanator/warp ``tools/ds41_engram.py`` and vLLM
``deepseek_v41/common/engram.py``): for each Engram layer in ``engram_layer_ids`` order, for each n-gram order
2..max, the search restarts at ``engram_vocab_size - 1`` and takes ``engram_n_heads`` times the next prime
*strictly greater* than the current value that is not in ``seen``; ``seen`` is shared across all layers. Since every
smaller prime is already in ``seen``, this is "the smallest unused primes > engram_vocab_size - 1, in order".

Multiplier rule (same sources): ``numpy.random.default_rng(10007 * layer_id).integers(0, B, size=max_ngram,
dtype=int64) * 2 + 1`` with ``B = max(1, (2**63 - 1) // compressed_vocab_size // 2)``.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

DEAD = -1  # compressed id of a token that takes no part in n-grams (image spans)
_BEFORE_START = -2  # internal marker: lookback before the sequence start (blocked like DEAD)


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin; bases 2..37 are exact for n < 3.3e24."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in small:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@lru_cache(maxsize=64)
def _prime_layout(layer_ids: tuple[int, ...], n_orders: int, n_heads: int, vocab: int) -> dict:
    seen: set[int] = set()
    out = {}
    for layer in layer_ids:
        flat: list[int] = []
        for _ in range(n_orders):
            cur = vocab - 1  # the search restarts here for every (layer, order) ...
            for _ in range(n_heads):
                cur += 1  # ... and takes the next prime strictly above, skipping primes already handed out
                while cur in seen or not is_prime(cur):
                    cur += 1
                seen.add(cur)
                flat.append(cur)
        out[layer] = tuple(flat)
    return out


def engram_primes(cfg) -> dict[int, list[int]]:
    """Per Engram layer: its column primes in column order c = (n-2)*heads + h."""
    lay = _prime_layout(tuple(cfg.engram_layer_ids), len(cfg.engram_orders), cfg.engram_n_heads, cfg.engram_vocab_size)
    return {layer: list(p) for layer, p in lay.items()}


def engram_offsets(cfg) -> dict[int, list[int]]:
    """Per Engram layer: the first table row of each column (running sum of the primes, column order)."""
    out = {}
    for layer, primes in engram_primes(cfg).items():
        out[layer] = [int(x) for x in np.cumsum([0] + primes[:-1])]
    return out


def engram_rows_per_layer(cfg) -> dict[int, int]:
    """Rows of each layer's table = the sum of its primes."""
    return {layer: sum(p) for layer, p in engram_primes(cfg).items()}


@lru_cache(maxsize=64)
def _multipliers(layer_id: int, compressed_vocab_size: int, max_ngram: int) -> tuple[int, ...]:
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    v = np.random.default_rng(10007 * layer_id).integers(0, bound, size=(max_ngram,), dtype=np.int64)
    return tuple(int(x) * 2 + 1 for x in v)


def hash_multipliers(layer_id: int, compressed_vocab_size: int, max_ngram: int) -> list[int]:
    """The layer's odd multipliers M_0..M_{max_ngram-1}, one per lookback."""
    return list(_multipliers(layer_id, compressed_vocab_size, max_ngram))


class EngramHasher:
    """Row indices into one Engram layer's table for a stream of compressed token ids.

    ``rows(ids, history)`` hashes ``ids`` (compressed ids, DEAD = -1 for image-span tokens) given ``history``, the
    compressed ids (or DEAD) immediately before ``ids[0]`` in order (``history[-1]`` is the previous token). Only the
    last ``max_ngram - 1`` entries are used; a shorter history means the sequence starts right before it, so earlier
    lookbacks are blocked. Hashing a sequence in one call equals hashing its chunks with the history carried
    (``next_history``).
    """

    def __init__(self, cfg, layer_id: int, pad_id: int | None = None):
        if layer_id not in cfg.engram_layer_ids:
            raise ValueError(f"layer {layer_id} is not an Engram layer of {cfg.name!r} ({cfg.engram_layer_ids})")
        self.layer_id = layer_id
        self.max_ngram = cfg.engram_max_ngram_size
        self.n_heads = cfg.engram_n_heads
        self.columns = cfg.engram_columns
        self.compressed_vocab_size = cfg.engram_compressed_vocab_size
        # the pad id is the compressed id of engram_pad_token_id (identity for tiny, 2 -> 2 in the release)
        self.pad_id = cfg.engram_pad_token_id if pad_id is None else pad_id
        self.primes = engram_primes(cfg)[layer_id]
        self.offsets = engram_offsets(cfg)[layer_id]
        self.num_rows = sum(self.primes)
        self.multipliers = hash_multipliers(layer_id, self.compressed_vocab_size, self.max_ngram)
        self._dev: dict = {}

    def constants(self, device):
        """(multipliers [max_ngram], primes and offsets [max_ngram - 1, heads]) as int64 tensors on ``device``
        (made once per device): what rows_of_lookbacks and kernels.engram_rows hash with."""
        key = str(device)
        if key not in self._dev:
            t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
            p = t(self.primes).view(self.max_ngram - 1, self.n_heads)
            o = t(self.offsets).view(self.max_ngram - 1, self.n_heads)
            self._dev[key] = (t(self.multipliers), p, o)
        return self._dev[key]

    @staticmethod
    def is_dead(ids: torch.Tensor) -> torch.Tensor:
        """Per row: True where the token itself is DEAD; its Engram gate is 0."""
        return ids == DEAD

    def next_history(self, history: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
        """The history to pass with the chunk that follows ``ids``."""
        h = ids if history is None else torch.cat([history.to(ids), ids])
        return h[-(self.max_ngram - 1) :] if self.max_ngram > 1 else h[:0]

    def rows(self, ids: torch.Tensor, history: torch.Tensor | None = None, check: bool = True) -> torch.Tensor:
        """LongTensor[T, columns] of global rows into this layer's table, column c = (n-2)*heads + h."""
        if ids.dim() != 1:
            raise ValueError(f"ids must be 1-D (one sequence), got shape {tuple(ids.shape)}")
        return self.rows_of_seqs(ids, [slice(0, ids.numel())], [history], check)

    def rows_of_seqs(
        self,
        ids: torch.Tensor,
        seq_rows: list[slice],
        histories: list,
        check: bool = True,
        reach: torch.Tensor | None = None,
    ):
        """``rows`` of every sequence (its slice of ``ids``, with its history; None = it starts there) in one pass:
        the same ops whatever the number of sequences, where a loop over them costs ~50 launches each. ``reach`` [T]
        (training's packed problems): row t looks back at most reach[t] tokens, as if its problem started there."""
        ids = ids.to(torch.int64)
        k = self.max_ngram - 1
        lead = ids.new_full((k,), _BEFORE_START)
        # ext: per sequence, k lookback slots (history right-aligned, the rest marked before-start), then its ids
        pieces, where, base = [], [], 0
        for r, h in zip(seq_rows, histories):
            hist = ids[:0] if h is None or k == 0 else h.reshape(-1)[-k:].to(ids.device, torch.int64, non_blocking=True)
            pieces += [lead[: k - hist.numel()], hist, ids[r]]
            where.append((base + k, r.stop - r.start))
            base += k + r.stop - r.start
        ext = torch.cat(pieces) if pieces else ids[:0]
        if check and ids.device.type == "cpu" and pieces:
            real = torch.cat([p for i, p in enumerate(pieces) if i % 3])  # histories and ids, not the marks
            if real.numel() and (int(real.min()) < DEAD or int(real.max()) >= self.compressed_vocab_size):
                raise ValueError(f"compressed ids must lie in [-1, {self.compressed_vocab_size})")
        # made on the ids' device: no upload, so a training step can run as a CUDA graph
        at = (
            torch.cat([torch.arange(b, b + n, device=ids.device) for b, n in where])
            if where
            else torch.zeros(0, dtype=torch.int64, device=ids.device)
        )
        # src[t, s] = token at lookback s from row t (within its sequence's ext segment)
        back = torch.arange(self.max_ngram, device=ids.device)
        src = ext[at[:, None] - back[None, :]]
        if reach is not None:
            src = src.masked_fill(back[None, :] > reach[:, None], _BEFORE_START)
        return self.rows_of_lookbacks(src)

    def lookbacks(self, ids: torch.Tensor, histories: list) -> torch.Tensor:
        """[T, max_ngram] for rows that each continue their own sequence (a decode step: row t's history is
        ``histories[t]``): column s is the id s tokens back, -2 before the sequence start."""
        k = self.max_ngram - 1
        # one tensor from host lists: torch ops per row cost more than the rows' values (CPU, B = 32: 356 -> 173 us)
        back = [h.reshape(-1).tolist()[-k:][::-1] if k else [] for h in histories]
        back += [[]] * (ids.shape[0] - len(back))  # rows without a history start their sequence
        rows = [[i] + b + [_BEFORE_START] * (k - len(b)) for i, b in zip(ids.tolist(), back)]
        return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), k + 1)

    def rows_of_lookbacks(self, src: torch.Tensor) -> torch.Tensor:
        """Table rows [T, columns] from each row's id and lookbacks ([T, max_ngram], see ``lookbacks``)."""
        mult, primes, offs = self.constants(src.device)
        T = src.shape[0]
        blocked = torch.cumsum((src < 0).to(torch.int64), dim=1) > 0  # sticky
        v = torch.where(blocked, torch.full_like(src, self.pad_id), src)
        prod = v * mult  # int64, wraps on overflow (never for in-range ids)
        out = torch.empty(T, self.columns, dtype=torch.int64, device=src.device)
        r = prod[:, 0]
        for s in range(1, self.max_ngram):
            r = r ^ prod[:, s]
            # torch's % is a floor mod: non-negative for positive primes, even for a wrapped (negative) hash
            out[:, (s - 1) * self.n_heads : s * self.n_heads] = r[:, None] % primes[s - 1] + offs[s - 1]
        return out
