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

from .agentx_presets import (  # noqa: F401  (re-exported: the trace's callers import them from here)
    ACCEPTANCE,
    PRESETS,
    Preset,
    check_acceptance,
    common_run_prefix,
    draw_int,
    draw_ln,
    seed_for,
    stream,
    trace_stats,
)

VERSION = "dsserve-agentx-gen/1"
BLOCK = 64


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


def _conversation(rng, p: Preset, shape, prefix: int, s0: int) -> list[dict]:
    """One conversation's turns (§3.2): growing context, appends, outputs, think gaps, compaction."""
    T = int(round(draw_ln(rng, shape.turns)))
    ctx = min(int(s0), p.compact_at)
    s_end = min(max(ctx + 20 * T, draw_ln(rng, shape.s_end)), p.max_ctx)
    w = np.exp(shape.append_sd * rng.standard_normal(T - 1))
    deltas = np.maximum(np.rint((s_end - ctx) * w / w.sum()), shape.min_append).astype(int) if T > 1 else []
    turns, epoch = [], 0
    for k in range(T):
        tool = compacted = human = False
        if k:
            human = bool(rng.random() < p.p_human)
            ctx += int(deltas[k - 1])
            if ctx > p.compact_at:  # auto-compact: prefix + summary, all new blocks after the prefix
                ctx = prefix + int(min(draw_ln(rng, p.summary), p.compact_at - prefix))
                epoch, compacted = epoch + 1, True
            else:
                tool = 0 if human else int(deltas[k - 1]) - min(turns[-1]["osl"], int(deltas[k - 1]))
        gap = round(draw_ln(rng, p.human_gap if human else p.tool_gap), 3) if k else 0.0
        out = int(min(round(draw_ln(rng, shape.out)), p.max_ctx - ctx))
        turns.append(
            dict(
                isl=ctx,
                osl=out,
                epoch=epoch,
                compacted=compacted,
                think=gap,
                append_tool=int(tool),
                input_type="tool_result" if k and not human else "text",
                human=human,
            )
        )
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
        tr["runs"], tr["sys_blocks"] = [r for r in runs if r[1] > 0], min(n_p, full)
    return nxt


def _session(p: Preset, seed: int, i: int) -> Session:
    rng = stream(seed, "trace", i)
    sys_t, tool_t = draw_int(rng, p.sys_tokens), draw_int(rng, p.tool_tokens)
    prefix = sys_t + tool_t
    resumed = bool(rng.random() < p.p_resumed)
    s0 = max(draw_ln(rng, p.s0_resumed), prefix + BLOCK) if resumed else prefix + draw_ln(rng, p.s0_fresh)
    convs = [
        dict(
            kind="helper",
            agent_id=f"helper{h}",
            model="small",
            prefix=0,
            turns=[
                dict(
                    isl=draw_int(rng, p.helper_in),
                    osl=draw_int(rng, p.helper_out),
                    epoch=0,
                    compacted=False,
                    think=0.0,
                    append_tool=0,
                    input_type="text",
                    stop="end_turn",
                    t=float(h),
                )
            ],
        )
        for h in range(p.n_helpers)
    ]
    root = dict(
        kind="root", agent_id="main", model="main", prefix=prefix, turns=_conversation(rng, p, p.root, prefix, s0)
    )
    convs.append(root)
    spawns = {}  # root turn -> children
    for k in range(len(root["turns"]) - 1):
        if rng.random() < p.p_spawn:
            for _ in range(min(int(rng.geometric(0.5)), p.max_fanout)):
                sp = int(draw_ln(rng, p.sub_prefix))
                sub = dict(
                    kind="subagent",
                    agent_id=f"sa{len(convs) - p.n_helpers}",
                    model="main",
                    prefix=sp,
                    turns=_conversation(rng, p, p.sub, sp, sp + draw_ln(rng, p.sub_task)),
                    gating=bool(rng.random() < p.p_gating),
                    spawned_at=k,
                    subagent_type=["Explore", "general-purpose"][int(rng.integers(2))],
                )
                spawns.setdefault(k, []).append(sub)
                convs.append(sub)
    nxt = 0
    for c in convs:
        nxt = _alloc(c["turns"], c["prefix"], nxt)
        for j, tr in enumerate(c["turns"]):
            tr.update(
                c=c, turn=j, api=round(tr["osl"] / p.out_tok_s + p.api_base, 3), after=[c["turns"][j - 1]] if j else []
            )

    for k, tr in enumerate(root["turns"]):
        if k == 0:
            tr["t"] = float(p.n_helpers)
        else:
            tr["after"] += [c["turns"][-1] for c in spawns.get(k - 1, []) if c["gating"]]
            tr["t"] = round(max(a["t"] + a["api"] for a in tr["after"]) + tr["think"], 3)
        for c in spawns.get(k, []):
            c["turns"][0].update(after=[tr], think=0.0)
            for st in c["turns"]:
                st["t"] = round(st["after"][0]["t"] + st["after"][0]["api"] + st["think"], 3)
    order = sorted((tr for c in convs for tr in c["turns"]), key=lambda tr: tr["t"])  # stable
    for n, tr in enumerate(order):
        tr["idx"] = n
    reqs = []
    for tr in order:
        par = tr["after"][0] if tr["turn"] else None
        reqs.append(
            Request(
                session=i,
                idx=tr["idx"],
                kind=tr["c"]["kind"],
                agent_id=tr["c"]["agent_id"],
                turn=tr["turn"],
                t=tr["t"],
                isl=tr["isl"],
                osl=tr["osl"],
                hash_id_runs=tr["runs"],
                parent=par and par["idx"],
                hit_blocks=common_run_prefix(par["runs"], tr["runs"]) if par else 0,
                sys_blocks=tr["sys_blocks"],
                after=[a["idx"] for a in tr["after"]],
                think_time=tr["think"],
                api_time=tr["api"],
                input_type=tr["input_type"],
                append_tool=tr["append_tool"],
                stop=tr["stop"],
                compacted=tr["compacted"],
                model=tr["c"]["model"],
            )
        )
    subs = [
        dict(
            agent_id=c["agent_id"],
            subagent_type=c["subagent_type"],
            gating=c["gating"],
            spawned_by=root["turns"][c["spawned_at"]]["idx"],
        )
        for c in convs
        if c["kind"] == "subagent"
    ]
    return Session(
        index=i,
        id=f"agentx-{p.name}-s{seed}-{i:04d}",
        sys_tokens=sys_t,
        tool_tokens=tool_t,
        resumed=resumed,
        subagents=subs,
        requests=reqs,
    )


@dataclass
class Trace:
    """A generated corpus: ``sessions[i]`` depends only on (preset, seed, i) (§3.1)."""

    preset: str
    seed: int
    version: str
    block_size: int
    sessions: list

    def requests(self):
        return (r for s in self.sessions for r in s.requests)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Trace":
        d = json.loads(text)
        d["sessions"] = [Session(**{**s, "requests": [Request(**r) for r in s["requests"]]}) for s in d["sessions"]]
        return cls(**d)

    def sha256(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def stats(self) -> dict:
        return trace_stats(self)

    def write(self, path: str, check: bool = True) -> dict:
        """Print the corpus stats and write JSON; refuse (ValueError) if a full preset corpus is off-band."""
        st = self.stats()
        print(json.dumps(st, sort_keys=True, indent=1))
        full = self.preset in ACCEPTANCE and len(self.sessions) == PRESETS[self.preset].traces
        if check and full and (bad := check_acceptance(st, self.preset)):
            raise ValueError("corpus outside acceptance bands: " + "; ".join(bad))
        with open(path, "w") as f:
            f.write(self.to_json())
        return st


def generate(preset: str, seed: int = 42, num_sessions: int | None = None) -> Trace:
    """Generate ``num_sessions`` (default: the preset's trace count) sessions of ``PRESETS[preset]``."""
    p = PRESETS[preset]
    n = p.traces if num_sessions is None else num_sessions
    return Trace(
        preset=preset, seed=seed, version=VERSION, block_size=BLOCK, sessions=[_session(p, seed, i) for i in range(n)]
    )


@lru_cache(maxsize=8)
def _allowed(vocab_size: int, reserved: frozenset) -> np.ndarray:
    keep = np.ones(vocab_size, dtype=bool)
    keep[[i for i in reserved if 0 <= i < vocab_size]] = False
    return np.flatnonzero(keep)


@lru_cache(maxsize=1 << 16)
def _block_fill(master: int, tag: str, block: int, n: int) -> np.ndarray:
    return stream(master, tag, block).integers(0, n, BLOCK)


def request_token_ids(
    trace: Trace, request: Request, vocab_size: int, reserved_ids=(), salt: str | None = None
) -> list[int]:
    """Exactly ``request.isl`` prompt token ids: block id b of session s is filled with 64 ids drawn from
    stream ``tokens/<s>/<b>`` (§3.1) over ``range(vocab_size)`` minus ``reserved_ids`` (a partial last block
    takes the first isl % 64), so equal hash ids give equal tokens and the theoretical hit is realisable.
    ``salt`` (per-play cache bust, §1.3) changes every block after the system+tools prefix."""
    allowed = _allowed(vocab_size, frozenset(reserved_ids))
    s = request.session
    parts = [
        _block_fill(
            trace.seed,
            f"tokens/{s}" if salt is None or pos < request.sys_blocks else f"tokens/{s}/{salt}",
            b,
            len(allowed),
        )
        for pos, b in enumerate(request.hash_ids)
    ]
    return allowed[np.concatenate(parts)[: request.isl]].tolist()
