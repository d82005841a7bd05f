"""Seeded, offline AgentX-like workload generator (spec agentx.md §1.2-1.4, §3.1-3.2, §3.5).

A ``Trace`` is a corpus of ``Session``s (one Weka-style agent run each).  A session has two helper
sidecars, a root conversation whose prompt grows turn by turn (assistant output + tool results), and
subagent conversations spawned after some root turns.  Every request lists the hash ids of its 64-token
input blocks as runs ``[[first_id, count], ...]`` (ids are local to the session); a request shares its
leading blocks with ``parent`` (the previous request of its conversation), so ``hit_blocks`` is the
exact theoretical prefix hit (longest leading run of already-seen ids under an infinite cache).
Replay: a request with empty ``after`` starts ``t`` seconds after its session starts; otherwise
``think_time`` after the last request in ``after`` completes (parent turn and gating subagents, §3.3).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from functools import lru_cache

import numpy as np

from .agentx_presets import ACCEPTANCE, PRESETS, Preset, check_acceptance

__all__ = ["ACCEPTANCE", "PRESETS", "Request", "Session", "Trace", "check_acceptance", "generate",
           "request_token_ids", "seed_for"]
VERSION = "dsserve-agentx-gen/1"
BLOCK = 64


def seed_for(master: int, tag: str, i: int) -> int:
    """§3.1: first 8 bytes of SHA-256(f"{master}:{tag}:{i}") as an unsigned integer."""
    return int.from_bytes(hashlib.sha256(f"{master}:{tag}:{i}".encode()).digest()[:8], "big")


def _rng(master: int, tag: str, i: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(seed_for(master, tag, i)))


def _ln(rng, d) -> float:
    """Clamped lognormal: d = (median, log_sd, lo, hi)."""
    return float(min(max(d[0] * np.exp(d[1] * rng.standard_normal()), d[2]), d[3]))


def _ui(rng, d) -> int:
    return int(rng.integers(d[0], d[1] + 1))


@dataclass
class Request:
    session: int  # session index (filler stream tokens/<session>/<block>)
    idx: int  # position in the session, ordered by start offset t
    kind: str  # "root" | "subagent" | "helper"
    agent_id: str  # "main", "sa<n>", "helper<n>"
    turn: int  # turn within its conversation
    t: float  # recorded start offset (s)
    isl: int  # input tokens = cached prefix + new tokens
    osl: int  # output tokens (max_tokens with ignore_eos)
    hash_id_runs: list  # [[first_id, count], ...] covering the ceil(isl/64) input blocks
    parent: int | None  # prefix parent: previous request of this conversation
    hit_blocks: int  # leading blocks shared with parent = theoretical hit
    sys_blocks: int  # leading blocks of pure system+tools prompt (shared by replays of the session)
    after: list  # request idxs that gate this one
    think_time: float  # end-to-start gap after the last of `after`
    api_time: float  # recorded duration, out/60 + 0.5 s
    input_type: str  # what was appended: "text" (first turn / human) | "tool_result"
    append_tool: int  # tool-result tokens of this turn's append (the rest is the previous output)
    stop: str  # "tool_use" | "end_turn"
    compacted: bool  # first prompt after auto-compaction: only the system prefix is reused
    model: str  # "main" | "small" (haiku-class helpers)

    @property
    def blocks(self) -> int:
        return -(-self.isl // BLOCK)

    @property
    def cached_tokens(self) -> int:
        return self.hit_blocks * BLOCK

    @property
    def new_tokens(self) -> int:
        return self.isl - self.cached_tokens

    @property
    def hash_ids(self) -> list[int]:
        return [s + j for s, n in self.hash_id_runs for j in range(n)]


@dataclass
class Session:
    index: int
    id: str
    sys_tokens: int
    tool_tokens: int
    resumed: bool
    subagents: list  # [{"agent_id", "subagent_type", "spawned_by": idx, "gating": bool}]
    requests: list


def _common_blocks(a: list, b: list) -> int:
    """Length of the common leading id run of two run lists."""
    i = j = oa = ob = n = 0
    while i < len(a) and j < len(b) and a[i][0] + oa == b[j][0] + ob:
        m = min(a[i][1] - oa, b[j][1] - ob)
        n, oa, ob = n + m, oa + m, ob + m
        if oa == a[i][1]:
            i, oa = i + 1, 0
        if ob == b[j][1]:
            j, ob = j + 1, 0
    return n


def _conversation(rng, p: Preset, shape, prefix: int, s0: int) -> list[dict]:
    """One conversation's turns (§3.2): growing context, appends, outputs, think gaps, compaction."""
    T = int(round(_ln(rng, shape.turns)))
    ctx = min(int(s0), p.compact_at)
    s_end = min(max(ctx + 20 * T, _ln(rng, shape.s_end)), p.max_ctx)
    w = np.exp(shape.append_sd * rng.standard_normal(T - 1))
    deltas = np.maximum(np.rint((s_end - ctx) * w / w.sum()), shape.min_append).astype(int) if T > 1 else []
    turns, epoch = [], 0
    for k in range(T):
        tool = compacted = human = False
        if k:
            human = bool(rng.random() < p.p_human)
            ctx += int(deltas[k - 1])
            if ctx > p.compact_at:  # auto-compact: prefix + summary, all new blocks after the prefix
                ctx = prefix + int(min(_ln(rng, p.summary), p.compact_at - prefix))
                epoch, compacted = epoch + 1, True
            else:
                tool = 0 if human else int(deltas[k - 1]) - min(turns[-1]["osl"], int(deltas[k - 1]))
        gap = round(_ln(rng, p.human_gap if human else p.tool_gap), 3) if k else 0.0
        out = int(min(round(_ln(rng, shape.out)), p.max_ctx - ctx))
        turns.append(dict(isl=ctx, osl=out, epoch=epoch, compacted=compacted, think=gap, append_tool=int(tool),
                          input_type="tool_result" if k and not human else "text", human=human))
    for k, tr in enumerate(turns):
        tr["stop"] = "end_turn" if k == T - 1 or turns[k + 1]["human"] else "tool_use"
    return turns


def _alloc(turns: list[dict], prefix: int, nxt: int) -> int:
    """Lay out hash-id runs: a shared system-prefix run, one run per compaction epoch, one id per partial block."""
    n_p = prefix // BLOCK
    pstart, nxt = nxt, nxt + n_p
    ep = {}
    for tr in turns:
        ep[tr["epoch"]] = max(ep.get(tr["epoch"], 0), tr["isl"] // BLOCK - n_p)
    for e in sorted(ep):
        ep[e], nxt = nxt, nxt + max(ep[e], 0)
    for tr in turns:
        full = tr["isl"] // BLOCK
        runs = [[pstart, min(n_p, full)], [ep[tr["epoch"]], full - n_p]]
        if tr["isl"] % BLOCK:
            runs, nxt = runs + [[nxt, 1]], nxt + 1
        merged = []
        for s, n in runs:
            if n > 0 and merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1][1] += n
            elif n > 0:
                merged.append([s, n])
        tr["runs"], tr["sys_blocks"] = merged, min(n_p, full)
    return nxt


def _session(p: Preset, seed: int, i: int) -> Session:
    rng = _rng(seed, "trace", i)
    sys_t, tool_t = _ui(rng, p.sys_tokens), _ui(rng, p.tool_tokens)
    prefix = sys_t + tool_t
    resumed = bool(rng.random() < p.p_resumed)
    s0 = max(_ln(rng, p.s0_resumed), prefix + BLOCK) if resumed else prefix + _ln(rng, p.s0_fresh)
    convs = [dict(kind="helper", agent_id=f"helper{h}", model="small", prefix=0, turns=[dict(
        isl=_ui(rng, p.helper_in), osl=_ui(rng, p.helper_out), epoch=0, compacted=False, think=0.0,
        append_tool=0, input_type="text", stop="end_turn", t0=float(h))]) for h in range(p.n_helpers)]
    root = dict(kind="root", agent_id="main", model="main", prefix=prefix,
                turns=_conversation(rng, p, p.root, prefix, s0))
    convs.append(root)
    spawns = {}  # root turn -> children
    for k in range(len(root["turns"]) - 1):
        if rng.random() < p.p_spawn:
            for _ in range(min(int(rng.geometric(0.5)), p.max_fanout)):
                sp = int(_ln(rng, p.sub_prefix))
                sub = dict(kind="subagent", agent_id=f"sa{len(convs) - p.n_helpers}", model="main", prefix=sp,
                           turns=_conversation(rng, p, p.sub, sp, sp + _ln(rng, p.sub_task)),
                           gating=bool(rng.random() < p.p_gating), spawned_at=k,
                           subagent_type=["Explore", "general-purpose"][int(rng.integers(2))])
                spawns.setdefault(k, []).append(sub)
                convs.append(sub)
    nxt = 0
    for c in convs:
        nxt = _alloc(c["turns"], c["prefix"], nxt)
        for j, tr in enumerate(c["turns"]):
            tr.update(c=c, turn=j, api=round(tr["osl"] / p.out_tok_s + p.api_base, 3), after=[])
            if j:
                tr["after"] = [c["turns"][j - 1]]

    def end(tr):
        return tr["t"] + tr["api"]

    for c in convs[: p.n_helpers]:
        c["turns"][0]["t"] = c["turns"][0]["t0"]
    for k, tr in enumerate(root["turns"]):
        if k == 0:
            tr["t"] = float(p.n_helpers)
        else:
            tr["after"] += [c["turns"][-1] for c in spawns.get(k - 1, []) if c["gating"]]
            tr["t"] = round(max(end(a) for a in tr["after"]) + tr["think"], 3)
        for c in spawns.get(k, []):
            for j, st in enumerate(c["turns"]):
                st["after"] = [tr] if j == 0 else st["after"]
                st["think"] = 0.0 if j == 0 else st["think"]
                st["t"] = round(end(st["after"][0]) + st["think"], 3)
    order = sorted((tr for c in convs for tr in c["turns"]), key=lambda tr: tr["t"])  # stable
    for n, tr in enumerate(order):
        tr["idx"] = n
    reqs = []
    for tr in order:
        par = tr["after"][0] if tr["turn"] else None
        reqs.append(Request(
            session=i, idx=tr["idx"], kind=tr["c"]["kind"], agent_id=tr["c"]["agent_id"], turn=tr["turn"],
            t=tr["t"], isl=tr["isl"], osl=tr["osl"], hash_id_runs=tr["runs"], parent=par and par["idx"],
            hit_blocks=_common_blocks(par["runs"], tr["runs"]) if par else 0, sys_blocks=tr["sys_blocks"],
            after=[a["idx"] for a in tr["after"]], think_time=tr["think"], api_time=tr["api"],
            input_type=tr["input_type"], append_tool=tr["append_tool"], stop=tr["stop"],
            compacted=tr["compacted"], model=tr["c"]["model"]))
    subs = [dict(agent_id=c["agent_id"], subagent_type=c["subagent_type"], gating=c["gating"],
                 spawned_by=root["turns"][c["spawned_at"]]["idx"]) for c in convs if c["kind"] == "subagent"]
    return Session(index=i, id=f"agentx-{p.name}-s{seed}-{i:04d}", sys_tokens=sys_t, tool_tokens=tool_t,
                   resumed=resumed, subagents=subs, requests=reqs)
