"""A decode step's fixed-shape batch (``FixedBatch``): one row per sequence, padded to ``capacity`` rows.

The whole model runs on it (``DeepseekForCausalLM.forward_decode``), the compressors included: padding rows repeat
row 0's inputs and write nothing, their window and entry stores going to row -1 and their compressor carry to the
spare slot (``carry_slots``).

The host's per-step values travel in ONE int64 vector (``inputs``): ``fill`` writes them into a pinned staging
vector and issues one copy; ``begin`` (the first thing a run does, so inside a captured graph) unpacks them into
the buffers the kernels read. Layout, each segment ``capacity`` long unless stated: tokens | positions | slots |
carry slots | real | Engram lookbacks (capacity x lookbacks: the compressed ids 1.. back, -2 before the start) |
block tables (capacity x bound / block_size). A step's tokens may instead come from a device tensor (the previous
step's samples, not yet on the host: asynchronous scheduling), copied over their segment after the upload.
"""

from __future__ import annotations

import torch

from ..layers.context import SeqRows
from .fixed_batch import FixedBatch
from .paged import PagedKVCache, SequenceKV


class DecodeBatch(FixedBatch):
    is_decode = True

    def __init__(self, cache: PagedKVCache, capacity: int, bound: int, lookbacks: int = 0):
        """``lookbacks``: Engram's history ids per row (max_ngram - 1; 0 for a model without Engram)."""
        self.lookbacks = lookbacks
        width = bound // cache.layout.block_size
        self._at = {}
        at = 0
        for name, n in (
            ("tokens", capacity),
            ("positions", capacity),
            ("slots", capacity),
            ("carry", capacity),
            ("real", capacity),
            ("back", capacity * lookbacks),
            ("tables", capacity * width),
        ):
            self._at[name] = slice(at, at + n)
            at += n
        self.inputs = torch.zeros(at, dtype=torch.long, device=cache.device)
        pin = cache.device.type == "cuda"
        # two staging vectors, used in turn: the one filled now may still feed the previous step's copy
        self._staging = [torch.zeros(at, dtype=torch.long, pin_memory=pin) for _ in range(2 if pin else 1)]
        self._uploaded: list = [None] * len(self._staging)
        self._turn = 0
        super().__init__(cache, capacity, capacity, bound)
        self.carry_slots = torch.zeros(capacity, dtype=torch.long, device=cache.device)  # spare slot: padding
        self.row_first.copy_(torch.arange(capacity))  # each row its own sequence
        self.row_seq.copy_(torch.arange(capacity))
        self.seqs = [SeqRows(slice(t, t + 1), None) for t in range(capacity)]
        self.engram_back = torch.zeros(capacity, lookbacks, dtype=torch.long, device=cache.device)

    def _segment(self, name: str) -> torch.Tensor:
        return self.inputs[self._at[name]]

    def forget_derived(self) -> None:
        super().forget_derived()
        self._entry_stores = {}
        self.derived: dict = {}  # what layers derive from the buffers once a run (layers.compress_v4_decode)

    def begin(self) -> None:
        super().begin()
        if not hasattr(self, "engram_back"):  # FixedBatch.__init__'s call: nothing uploaded yet
            return
        cap = self.capacity
        self.tokens.copy_(self._segment("tokens"))
        self.positions.copy_(self._segment("positions"))
        self.slots.copy_(self._segment("slots"))
        self.carry_slots.copy_(self._segment("carry"))
        self.real.copy_(self._segment("real") != 0)
        self.engram_back.copy_(self._segment("back").view(cap, self.lookbacks))
        self.seq_tables.copy_(self._segment("tables").view(cap, -1))

    @property
    def block_rows(self) -> torch.Tensor:
        return self.seq_tables  # row t is sequence t

    @staticmethod
    def fits(seqs: list[SequenceKV], carried: bool = True) -> str | None:
        """Why these sequences cannot take a fixed-shape decode step at their next positions (None: they can):
        the host's compressor counts must be those of a sequence that ran every earlier position. ``carried``:
        check V4.1's carried-row counts (V4 keeps its pending rows otherwise: layers.compress_v4_decode)."""
        for kv in seqs:
            p = kv.num_tokens
            if p < kv.published_until:
                return "a row is inside its sequence's cached prefix"
            for src, (r, _) in kv.cache.layout.sources.items():
                if kv.num_entries(src) != p // r or (carried and r > 1 and kv.carried.get(src, 0) != p % r):
                    return f"source {src}'s entries or carried rows are not those of position {p}"
        return None

    def fill(
        self, seqs: list[SequenceKV], tokens: list[int] | torch.Tensor, engram_back: torch.Tensor | None = None
    ) -> None:
        """This step's rows (sequence i decodes token i at its next position) into the inputs; padding repeats
        row 0. ``tokens``: host ids, or a LongTensor [len(seqs)] on the device (not read by the host).
        ``engram_back``: host LongTensor [len(seqs), lookbacks] (see the module docstring). No host wait."""
        b, cap = len(seqs), self.capacity
        if not 0 < b <= cap:
            raise ValueError(f"a decode batch of {b} rows does not fit capacity {cap}")
        on_device = isinstance(tokens, torch.Tensor)
        if (tokens.shape[0] if on_device else len(tokens)) != b:
            raise ValueError(f"{b} sequences need {b} tokens")
        pos = [kv.num_tokens for kv in seqs]
        self.check_bound(max(pos))
        slots = [kv.slot for kv in seqs]
        pad = cap - b
        i = self._turn
        self._turn = (i + 1) % len(self._staging)
        if self._uploaded[i] is not None:  # its previous copy must have read it (long done in practice)
            self._uploaded[i].synchronize()
        host = self._staging[i]
        seg = lambda name: host[self._at[name]]  # noqa: E731
        if not on_device:
            seg("tokens").copy_(torch.tensor(tokens + tokens[:1] * pad))
        seg("positions").copy_(torch.tensor(pos + pos[:1] * pad))
        seg("slots").copy_(torch.tensor(slots + slots[:1] * pad))
        seg("carry").copy_(torch.tensor(slots + [self.cache.slots.num_blocks] * pad))
        seg("real").copy_(torch.tensor([1] * b + [0] * pad))
        if self.lookbacks:
            back = seg("back").view(cap, self.lookbacks)
            if engram_back is None:
                raise ValueError("this batch carries Engram lookbacks: pass engram_back")
            back[:b] = engram_back
            back[b:] = engram_back[:1]
        seg("tables").view(cap, -1).copy_(self.tables(seqs, cap))
        self.inputs.copy_(host, non_blocking=True)
        if self.inputs.device.type == "cuda":
            self._uploaded[i] = torch.cuda.Event()
            self._uploaded[i].record()
        if on_device:
            dst = self._segment("tokens")
            dst[:b].copy_(tokens)
            if pad:
                dst[b:].copy_(tokens[:1].expand(pad))

    def mask_writes(self) -> None:
        """Every row a padding row (stores nothing): for the warm-up runs before a capture."""
        self._segment("real").fill_(0)
        self._segment("carry").fill_(self.cache.slots.num_blocks)

    def entry_stores(self, ratio: int, rope, dtype: torch.dtype):
        """Per row, where a ratio-r source stores the entry the row completes (-1: none completes, or padding) and
        the RoPE tables at that entry's position; the same for every source of the ratio (the pools share block
        tables), so computed once per ratio per step."""
        key = (ratio, rope.spec, dtype == torch.float64)
        if key not in self._entry_stores:
            bs, p = self.cache.layout.block_size, self.positions
            epb = bs // ratio
            e = torch.div(p, ratio, rounding_mode="floor")  # the entry whose group holds p
            done = ((p + 1) % ratio == 0) & self.real
            rows = torch.where(done, self.seq_tables.long().gather(1, (p // bs)[:, None])[:, 0] * epb + e % epb, -1)
            self._entry_stores[key] = rows, rope.kernel_tables(e * ratio, dtype)
        return self._entry_stores[key]
