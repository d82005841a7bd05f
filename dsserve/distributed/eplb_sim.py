"""EPLB balance figures without a cluster: a model's recorded routing replayed onto simulated EP ranks.

``record_routing`` runs a single-process model (reference forward, then DSpark draft blocks) over token sequences
and keeps every row's routed experts per MoE layer (forward hooks on the gates: nothing in the model changes).
``scale_experts`` widens a small model's routing to more experts (each expert split into ``m`` sub-experts by a
hash of the row's token and the layer: the trained router's skew over experts, and the tokens' skew within one),
so the release's expert counts, scaled down, can be simulated from the built-in model. ``simulate`` replays steps
(``steps_of``: ``slots`` streams at a time, ``chunk`` rows each, the streams dealt round robin to the ranks as DP
attention deals requests), routes each pair to a physical slot as ``ReplicaMap.route`` does (the live path's
replica choice) and returns the tokens each rank's experts run, per step and layer: the balance figures' input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .eplb_replicas import ReplicaMap, occurrence


@dataclass
class Routing:
    """One MoE model's routing over a set of sequences: ``ids[s]`` is sequence s's [L, T_s, k] expert ids and
    ``tokens[s]`` its [T_s] anchor tokens (the row's token; a draft row: its block's first token + the row)."""

    n_experts: int
    ids: list[torch.Tensor]
    tokens: list[torch.Tensor]


@torch.no_grad()
def record_routing(model, sequences: list[torch.Tensor], draft_every: int = 0) -> tuple[Routing, Routing | None]:
    """(target routing, draft routing or None). ``draft_every`` > 0: a draft block every that many positions of
    each sequence (the state ingested up to there), its rows' routing kept in order."""
    cfg = model.cfg
    got: dict[str, list[torch.Tensor]] = {}

    def hook(name):
        def keep(module, args, out):
            got.setdefault(name, []).append(out[0].detach().clone())

        return keep

    handles = [b.ffn.gate.register_forward_hook(hook(f"t{i}")) for i, b in enumerate(model.layers)]
    stages = list(getattr(model, "mtp", None) or [])
    handles += [s.ffn.gate.register_forward_hook(hook(f"d{i}")) for i, s in enumerate(stages)]
    target = Routing(cfg.n_routed_experts, [], [])
    draft = Routing(cfg.dspark_n_routed_experts, [], []) if stages and draft_every else None
    try:
        for seq in sequences:
            got.clear()
            out = model(seq)
            target.ids.append(torch.stack([got[f"t{i}"][0] for i in range(len(model.layers))]))
            target.tokens.append(seq.clone())
            if draft is None:
                continue
            got.clear()
            state, done, anchors = model.mtp.new_state(), 0, []
            for p in range(draft_every - 1, seq.shape[0] - 1, draft_every):
                model.mtp.ingest({k: v[done : p + 1] for k, v in out.taps.items()}, out.positions[done : p + 1], state)
                done = p + 1
                y = int(seq[p + 1])
                model.mtp.propose(y, p, state, model.embed, model.head)
                anchors.append(y * cfg.dspark_block_size + torch.arange(cfg.dspark_block_size))
            if anchors:
                draft.ids.append(torch.stack([torch.cat(got[f"d{i}"]) for i in range(len(stages))]))
                draft.tokens.append(torch.cat(anchors))
    finally:
        for h in handles:
            h.remove()
    return target, draft


def scale_experts(r: Routing, m: int) -> Routing:
    """Each expert e split into sub-experts e * m + j, j a hash of the row's anchor token and the layer."""
    out = []
    for ids, tokens in zip(r.ids, r.tokens):
        layer = torch.arange(ids.shape[0])[:, None, None]
        h = (tokens[None, :, None] * 2654435761 + layer * 40503 + 12345) % (1 << 32)
        out.append(ids * m + (h >> 7) % m)
    return Routing(r.n_experts * m, out, r.tokens)


@dataclass
class Steps:
    """``ids`` [L, n_steps, rows, k]: each step's rows (stream by stream, ``chunk`` rows a stream); ``stream`` [rows]:
    the stream each row belongs to."""

    ids: torch.Tensor
    stream: torch.Tensor

    def __len__(self) -> int:
        return self.ids.shape[1]

    def split(self, at: int) -> tuple[Steps, Steps]:
        return Steps(self.ids[:, :at], self.stream), Steps(self.ids[:, at:], self.stream)


def steps_of(r: Routing, slots: int, chunk: int, n_steps: int) -> Steps:
    """Steps of ``slots`` streams side by side, ``chunk`` rows each a step: the sequences concatenated, stream s
    reading from s / slots of the way in (wrapping), so a step's rows come from different places, as a decode batch's
    requests do."""
    ids = torch.cat(r.ids, dim=1)
    n = ids.shape[1]
    starts = torch.arange(slots) * n // slots
    at = starts[None, :, None] + torch.arange(n_steps)[:, None, None] * chunk + torch.arange(chunk)[None, None, :]
    return Steps(ids[:, (at % n).reshape(n_steps, -1)], torch.arange(slots).repeat_interleave(chunk))


def simulate(
    steps: Steps, phy2log: list[tuple[int, ...]], n_experts: int, ep_size: int, uniform_seed: int | None = None
) -> torch.Tensor:
    """[n_steps, L, EP] tokens each rank's experts run, with layer l's placement ``phy2log[l]``: stream s's rows on
    rank s % EP (in stream order), each pair on a replica as ``ReplicaMap.route`` picks it on that rank (the j-th
    pair of an expert in the rank's batch: replica (j + rank) % replicas); ``uniform_seed``: every pair's expert
    drawn uniformly instead (k distinct a row), the same rows (the --uniform-routing reference)."""
    n_layers, n_steps, rows, k = steps.ids.shape
    rank = (steps.stream % ep_size)[:, None].expand(rows, k)  # [rows, k]
    per = len(phy2log[0]) // ep_size
    gen = None if uniform_seed is None else torch.Generator().manual_seed(uniform_seed)
    out = torch.zeros(n_steps, n_layers, ep_size, dtype=torch.long)
    for layer in range(n_layers):
        ids = steps.ids[layer]
        if gen is not None:
            ids = _uniform(n_steps, rows, n_experts, k, gen)
        table, counts = ReplicaMap(phy2log[layer], n_experts)._tables(ids.device)
        # a pair's occurrence among its rank's pairs of the same expert, in (row, k) order
        turn = occurrence((rank * n_experts + ids).reshape(n_steps, -1), ep_size * n_experts).view(ids.shape) + rank
        dest = table[ids, turn % counts[ids]] // per  # [n_steps, rows, k]
        dest = dest.reshape(n_steps, -1) + torch.arange(n_steps)[:, None] * ep_size
        out[:, layer] = torch.bincount(dest.reshape(-1), minlength=n_steps * ep_size).view(n_steps, ep_size)
    return out


def _uniform(n_steps: int, rows: int, n_experts: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """[n_steps, rows, k] distinct experts a row, uniform (k = 2: a first pick and a distinct second one)."""
    if k != 2:
        return torch.rand(n_steps, rows, n_experts, generator=gen).topk(k, dim=-1).indices
    first = torch.randint(0, n_experts, (n_steps, rows), generator=gen)
    second = (first + 1 + torch.randint(0, n_experts - 1, (n_steps, rows), generator=gen)) % n_experts
    return torch.stack((first, second), dim=-1)


def expert_load(steps: Steps, n_experts: int) -> torch.Tensor:
    """[L, E] tokens per logical expert over the steps (what the recorder's window holds)."""
    return torch.stack([torch.bincount(row.reshape(-1), minlength=n_experts) for row in steps.ids])
