"""Train the DSpark drafter of a trained model with its backbone frozen (issue 56), and measure its acceptance.

    python -m dsserve.train.draft --init tiny-trained --problems 600 --time-limit 2400 --out runs/draft

The backbone never changes: it runs once per training problem under ``no_grad`` (teacher-forced on the problem's
prompt and gold completion), and what the drafter needs of it is kept: the taps of the DSpark target layers (the
stream entering each, averaged over the copies: ``ForwardOutput.taps``) and the target's argmax at every row. The
drafter then trains on those for as many passes as the clock allows (``--time-limit``), so no gradient can reach
the backbone, whose parameters are not even handed to the optimiser (spec 2.10: "its gradients never flow into the
backbone").

A training block is what ``DSpark.propose`` drafts after committed position p: the ring holds the entries of
positions p - W + 1 .. p (``DSpark.ingest`` of the taps), the block's ids are [y, noise x 4] with y the token at
p + 1, and draft i proposes the token at p + 2 + i. Every block of a batch runs at once: the stages are row-wise
except the attention, which reads each block's own window and its own five rows (``block_hidden``; the same sums
as ``DraftAttention``, checked against ``propose`` in tests/train/test_draft.py). The objective:

- cross entropy of draft i's logits (the shared head plus the Markov head) against the **target's argmax** at row
  p + 1 + i (self-distillation: greedy verification accepts a draft exactly when it equals that argmax), the
  Markov head teacher-forced with the sequence's tokens (prev_i = the token at p + 1 + i, which is draft i-1
  whenever draft i-1 was accepted). Completion blocks weigh 1, prompt blocks ``prompt_weight``;
- plus ``conf_weight`` x the binary cross entropy of the confidence logit kappa_i against "draft i equals the
  target's argmax" (its inputs detached: the confidence head learns to predict acceptance, it does not shape the
  drafts).

``acceptance`` measures held-out problems (``tasks`` eval split) as the engine would meet them: the target's own
greedy continuation of the prompt, and at each committed position of it the drafter's block (greedy, the Markov
head fed its own drafts, as ``propose``), accepted up to the first draft that differs from the target's argmax.
``ship`` writes the trained stages into a copy of the checkpoint: every other tensor's bytes are copied unchanged
(``backbone_digest`` before and after proves it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import struct
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ..bench.provenance import run_meta
from ..layers.attention import sparse_attention_with_sink
from ..layers.context import ForwardContext, SeqRows, StepBatch
from ..layers.mhc import collapse
from .tasks import TASKS, problem, prompt_ids

DRAFT_PREFIX = "mtp."  # the checkpoint names of the DSpark stages (spec 4.3); everything else is the backbone


@dataclass(frozen=True)
class DraftConfig:
    init: str = "tiny-trained"  # the trained model whose drafter is trained (its backbone stays frozen)
    seed: int = 0
    problems: int = 600  # training problems (train split), each run through the backbone once
    mix: tuple = (("arithmetic", 0.45), ("retrieval", 0.15), ("chat", 0.4))
    prompt_anchors: int = 24  # blocks drafted at random prompt positions a problem, besides every completion one
    # What follows a training prompt: "gold", the problem's completion and EOS; "target", the target's own greedy
    # output (up to EOS or ``continuation_tokens``), what the drafter meets when it serves: past a gold answer's end
    # too (a retrieval drill's model goes on asking itself questions until max_tokens).
    continuation: str = "gold"
    continuation_tokens: int = 32
    from_init: bool = False  # start from ``init``'s own drafter (fine-tuning it), not from fresh seeded weights
    backbone_batch: int = 1  # problems a forward in the backbone pass
    prompt_weight: float = 0.3
    conf_weight: float = 0.1
    batch: int = 8  # problems a step
    steps: int = 4000
    lr: float = 2e-3
    warmup: int = 50
    time_limit: float = 0.0  # seconds of training (after the backbone pass): the schedule runs on the clock
    heldout_n: int = 24  # held-out problems a task for the acceptance at the end (0: none)
    max_new: int = 64  # greedy continuation length cap for the acceptance
    log_every: int = 25
    save_every: int = 200  # steps between checkpoints of the drafter's state (resumable with --resume)
    device: str = "cpu"


# ------------------------------------------------------------------------------------------------ data
@dataclass
class Example:
    """One problem as the drafter trains on it: rows ``start`` .. of its token sequence (enough for every anchor's
    window), the backbone's taps and argmax at those rows, and the anchors (positions p a block is drafted after)."""

    task: str
    start: int
    tokens: torch.Tensor  # [n] ids at positions start .. start + n - 1
    taps: torch.Tensor  # [n, len(targets) x d] the target layers' taps, concatenated in config order
    target: torch.Tensor  # [n] the target's argmax at each row (its guess for the next position)
    anchors: torch.Tensor  # [A] positions p
    weights: torch.Tensor  # [A] loss weight of each anchor's block
    last_row: int  # the last position whose target argmax counts (the row before the final EOS)


@torch.no_grad()
def backbone_rows(model, seqs: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence (each fresh), (taps [T, len(targets) x d], the target's argmax [T]): one teacher-forced forward
    of them all."""
    rows, at = [], 0
    for ids in seqs:
        rows.append(SeqRows(slice(at, at + len(ids)), model.new_cache()))
        at += len(ids)
    out = model.forward_batch(StepBatch(torch.tensor([t for ids in seqs for t in ids]), rows))
    taps = torch.cat([out.taps[layer] for layer in model.cfg.dspark_target_layer_ids], dim=-1)
    return [(taps[r.rows], model.logits(out.hidden[r.rows]).float().argmax(-1)) for r in rows]


def example_of(
    task: str,
    ids: list[int],
    n_prompt: int,
    anchors_extra: list[int],
    rows: tuple[torch.Tensor, torch.Tensor],
    window: int,
    ended: bool = True,
    tap_dtype: torch.dtype = torch.float32,
) -> Example:
    """An ``Example`` of ``ids`` (a prompt of ``n_prompt`` tokens, then a completion) with its ``backbone_rows``:
    anchors at every completion position whose y is not the final token and at ``anchors_extra`` (prompt
    positions, weight 0 here: the caller sets it). ``ended``: the last token ends the completion (EOS, or the
    answer line's newline): nothing after it is drafted or counted; else it was cut off and the target's argmax
    after it still counts. ``tap_dtype``: how the taps are kept (training keeps many: bf16)."""
    taps, target = rows
    total = len(ids)
    last_row = total - 2 if ended else total - 1
    completion = list(range(n_prompt - 1, last_row))  # y = ids[p + 1] up to the row before the last counted one
    anchors = sorted(set(anchors_extra) | set(completion))
    start = max(0, anchors[0] - window + 1) if anchors else 0
    extra = set(anchors_extra) - set(completion)
    return Example(
        task=task,
        start=start,
        tokens=torch.tensor(ids[start:]),
        taps=taps[start:].to("cpu", tap_dtype),
        target=target[start:].cpu(),
        anchors=torch.tensor(anchors, dtype=torch.long),
        weights=torch.tensor([0.0 if p in extra else 1.0 for p in anchors]),
        last_row=last_row,
    )


def training_examples(model, tokenizer, cfg: DraftConfig, min_back: int, log=print) -> list[Example]:
    """``cfg.problems`` train-split problems (tasks drawn by the mix), each its prompt and ``cfg.continuation``,
    through the frozen backbone ``backbone_batch`` at a time."""
    rng = random.Random(f"draft/{cfg.seed}")
    tasks, shares = zip(*cfg.mix)
    count = lambda s: len(tokenizer.encode(s, add_bos=False))
    drawn, t0 = [], time.perf_counter()
    for i in range(cfg.problems):
        task = rng.choices(tasks, shares)[0]
        p = problem(task, "train", 10_000_000 + cfg.seed * 100_000 + i, count, min_back)
        a = prompt_ids(tokenizer, p.prompt)
        lo = max(1, len(a) - 4 * model.cfg.sliding_window)  # the prompt's tail: the turns a reply continues
        extra = rng.sample(range(lo, len(a) - 1), min(cfg.prompt_anchors, len(a) - 1 - lo))
        drawn.append((task, a, p.completion, extra))
    if cfg.continuation == "gold":
        completions = [(tokenizer.encode(c, add_bos=False) + [tokenizer.eos_id], True) for _, _, c, _ in drawn]
    elif cfg.continuation == "target":
        dtype = str(model.embed.weight.dtype).removeprefix("torch.")
        prompts = [a for _, a, _, _ in drawn]
        completions = target_continuations(cfg.init, cfg.device, dtype, prompts, cfg.continuation_tokens, tokenizer)
        log(f"target continuations: {len(completions)} problems, {time.perf_counter() - t0:.0f} s")
    else:
        raise ValueError(f"continuation must be gold or target, got {cfg.continuation!r}")
    out = []
    for lo in range(0, len(drawn), cfg.backbone_batch):
        hi = lo + cfg.backbone_batch
        todo = [(d[0], d[1] + c, len(d[1]), d[3], ended) for d, (c, ended) in zip(drawn[lo:hi], completions[lo:hi])]
        for (task, ids, n_prompt, extra, ended), rows in zip(todo, backbone_rows(model, [t[1] for t in todo])):
            ex = example_of(task, ids, n_prompt, extra, rows, model.cfg.sliding_window, ended, torch.bfloat16)
            ex.weights[ex.weights == 0] = cfg.prompt_weight
            out.append(ex)
        if len(out) // 50 != (len(out) - len(todo)) // 50:
            log(f"backbone pass: {len(out)}/{cfg.problems} problems, {time.perf_counter() - t0:.0f} s")
    return out


def target_continuations(
    init: str, device: str, dtype: str, prompts: list[list[int]], max_new: int, tokenizer
) -> list[tuple[list[int], bool]]:
    """The target's greedy outputs of ``prompts`` through the engine (drafts off) on ``device``, as (ids, ended):
    ended at EOS (kept as the last id: nothing after it is drafted) or cut off at ``max_new`` tokens."""
    import gc

    from ..engine.llm import LLM
    from ..engine.sampling_params import SamplingParams

    # eager: a one-off pass, not worth capturing every batch size's graph for
    llm = LLM(init, device=device, dtype=dtype, max_num_seqs=256, enable_prefix_caching=False, enforce_eager=True)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": a} for a in prompts],
            SamplingParams(temperature=0.0, max_tokens=max_new),
            use_tqdm=False,
        )
    finally:
        llm.engine.close()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    done = []
    for o in outs:
        ids = list(o.outputs[0].token_ids)
        ended = o.outputs[0].finish_reason == "stop"
        if ended and (not ids or ids[-1] != tokenizer.eos_id):
            ids.append(tokenizer.eos_id)
        done.append((ids, ended))
    return done


# ------------------------------------------------------------------------------------------------ the block forward
@contextmanager
def _block_attention(stage, ring_keys: torch.Tensor, ring_ok: torch.Tensor, block: int):
    """Within: ``stage.attn`` attends many blocks at once, each row its block's ring window (``ring_keys`` [A, W,
    D] with ``ring_ok`` [A, W]) plus its block's own rows, as ``DraftAttention`` does for one block. The stage's
    parameters and ``Block.forward`` schedule stay; only the key set differs, so the method is swapped, not the
    module (which would rename the parameters)."""
    attn = stage.attn

    def forward(x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        pos, a = ctx.positions, ring_keys.shape[0]
        _, q = attn.query(x, pos)
        own = attn.window_entry(x, pos, ctx.qat).view(a, block, -1)
        keys = torch.cat((ring_keys, own), dim=1).repeat_interleave(block, dim=0)  # [A x B, W + B, D]
        mask = torch.cat((ring_ok, ring_ok.new_ones(a, block)), dim=1).repeat_interleave(block, dim=0)
        none_k, none_mask = keys.new_zeros(0, keys.shape[-1]), mask.new_zeros(a * block, 0)
        o = sparse_attention_with_sink(q, none_k, none_mask, keys, mask, attn.attn_sink, attn.cfg.head_dim**-0.5)
        return attn.output(o, pos, x.dtype)

    attn.forward = forward
    try:
        yield
    finally:
        del attn.forward


def block_hidden(model, taps: torch.Tensor, tap_positions: torch.Tensor, anchor_rows, anchor_pos, y, qat: bool):
    """The drafter's collapsed stream [A, B, d] of A blocks. ``taps`` [R, len(targets) x d] at ``tap_positions`` [R]
    (rows of several sequences, concatenated); block j drafts after position ``anchor_pos[j]``, whose tap is row
    ``anchor_rows[j]`` (the W - 1 rows before it are its sequence's previous positions, or it starts the sequence);
    ``y`` [A] the token at p + 1."""
    cfg, draft = model.cfg, model.mtp
    b, n, w = cfg.dspark_block_size, cfg.hc_mult, cfg.sliding_window
    a = anchor_rows.shape[0]
    m = draft[0].main_norm(draft[0].main_proj(taps))
    back = torch.arange(w - 1, -1, -1)  # the ring in position order: p - W + 1 .. p
    ring_rows = anchor_rows[:, None] - back
    ring_ok = (anchor_pos[:, None] - back) >= 0
    ids = torch.full((a, b), cfg.dspark_noise_token_id, dtype=torch.long)
    ids[:, 0] = y
    ids = ids.flatten().to(taps.device)
    positions = (anchor_pos[:, None] + 1 + torch.arange(b)).flatten().to(taps.device)
    ctx = ForwardContext(tokens=ids, positions=positions, seqs=[SeqRows(slice(0, a * b), None)], qat=qat)
    x = model.embed(ids)[:, None, :].expand(-1, n, -1).contiguous()
    pre = torch.zeros(a * b, n, device=taps.device)
    pre[:, 0] = 1.0
    for stage in draft:
        ring = stage.attn.window_entry(m, tap_positions, qat)[ring_rows.clamp(min=0).to(taps.device)]
        with _block_attention(stage, ring, ring_ok.to(taps.device), b):
            x, pre, ctx = stage(x, pre, ctx)
    return collapse(x, pre).view(a, b, -1)


def _batch_tensors(examples: list[Example], device, b: int) -> dict:
    """The examples' rows concatenated and their blocks indexed into them: taps, positions, anchors' rows and
    positions, y, the teacher-forced Markov inputs, the targets with their validity, the blocks' weights."""
    taps, positions, rows, pos, prev, target, valid, weights, offset = [], [], [], [], [], [], [], [], 0
    for ex in examples:
        n = ex.tokens.shape[0]
        taps.append(ex.taps)
        positions.append(torch.arange(ex.start, ex.start + n))
        local = ex.anchors - ex.start
        rows.append(local + offset)
        pos.append(ex.anchors)
        idx = local[:, None] + 1 + torch.arange(b)  # rows p + 1 + i: prev_i's token and the target for draft i
        ok = (ex.anchors[:, None] + 1 + torch.arange(b)) <= ex.last_row
        prev.append(ex.tokens[idx.clamp(max=n - 1)])
        target.append(ex.target[idx.clamp(max=n - 1)])
        valid.append(ok)
        weights.append(ex.weights)
        offset += n
    cat = lambda xs: torch.cat(xs).to(device)
    return {
        "taps": cat(taps).float(),
        "positions": cat(positions),
        "rows": torch.cat(rows),
        "pos": torch.cat(pos),
        "y": torch.cat(prev)[:, 0],
        "prev": cat(prev),
        "target": cat(target),
        "valid": cat(valid),
        "weights": cat(weights),
    }


def draft_losses(model, examples: list[Example], qat: bool) -> dict:
    """The objective's two parts (module docstring) over every block of ``examples``: ``ce`` and ``conf_bce``, and
    the teacher-forced per-position agreement with the target's argmax."""
    t = _batch_tensors(examples, model.embed.weight.device, model.cfg.dspark_block_size)
    last = model.mtp[-1]
    h = block_hidden(model, t["taps"], t["positions"], t["rows"], t["pos"], t["y"], qat)
    e = last.markov_head.embed(t["prev"])  # [A, B, r]: E_m[prev_i]
    logits = model.head(last.norm(h)).float() + last.markov_head.head(e).float()
    w = t["weights"][:, None] * t["valid"]
    ce = F.cross_entropy(logits.flatten(0, 1), t["target"].flatten(), reduction="none").view_as(w)
    hit = (logits.argmax(-1) == t["target"]).float()
    kappa = last.confidence_head.proj(torch.cat((h.detach(), e.detach().to(h.dtype)), dim=-1))[..., 0].float()
    bce = F.binary_cross_entropy_with_logits(kappa, hit, reduction="none")
    ce_mean, bce_mean = (ce * w).sum() / w.sum(), (bce * w).sum() / w.sum()
    agree = (hit * w).sum(0) / w.sum(0).clamp(min=1e-9)
    return {"ce": ce_mean, "conf_bce": bce_mean, "agree": agree}


# ------------------------------------------------------------------------------------------------ acceptance
@torch.no_grad()
def greedy_continuation(model, tokenizer, ids: list[int], max_new: int) -> tuple[list[int], bool]:
    """The target's greedy continuation of ``ids`` (incremental decode on the reference path) up to EOS, the end
    of its first ``Answer:`` line (where the task is answered and the evaluation reads it; the model trained with
    retrieval drills goes on asking itself questions), or ``max_new`` tokens. Returns (ids, whether it ended)."""
    cache = model.new_cache()
    out = model.forward(torch.tensor(ids), cache)
    new = []
    while len(new) < max_new:
        tok = int(model.logits(out.hidden[-1:]).float().argmax(-1))
        new.append(tok)
        if tok == tokenizer.eos_id:
            return new, True
        text = tokenizer.decode(new)
        if "Answer:" in text and "\n" in text.split("Answer:", 1)[1]:
            return new, True
        out = model.forward(torch.tensor([tok]), cache)
    return new, False


@torch.no_grad()
def propose_blocks(model, taps, tap_positions, anchor_rows, anchor_pos, y, qat: bool):
    """Greedy drafts [A, B] and confidence logits [A, B] of A blocks, as ``DSpark.propose`` makes them: the Markov
    head fed each block's previous draft."""
    last = model.mtp[-1]
    h = block_hidden(model, taps, tap_positions, anchor_rows, anchor_pos, y, qat)
    base = model.head(last.norm(h)).float()
    prev, drafts, conf = y.to(h.device), [], []
    for i in range(h.shape[1]):
        e = last.markov_head.embed(prev)
        conf.append(last.confidence_head.proj(torch.cat((h[:, i], e.to(h.dtype)), dim=-1))[:, 0].float())
        prev = (base[:, i] + last.markov_head.head(e).float()).argmax(-1)
        drafts.append(prev)
    return torch.stack(drafts, 1), torch.stack(conf, 1)


def accepted_lengths(drafts: torch.Tensor, target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[A]: per block, the longest prefix of drafts equal to the target's argmax (counting only valid positions)."""
    match = (drafts == target) & valid
    return match.long().cumprod(1).sum(1)


@torch.no_grad()
def acceptance(model, tokenizer, n: int, max_new: int, min_back: int, tasks=TASKS, split: str = "eval") -> dict:
    """Per task, over the first ``n`` problems of ``split``: the target's greedy continuation, then at every
    committed position of it (from the prompt's last token up to the one before its final token) the
    drafter's block, accepted as greedy verification accepts it. Returns per task: ``mean_accepted`` drafts a block
    (of ``dspark_block_size``), ``mean_possible`` (a block near the end of the continuation can accept at most
    what is left of it), ``per_position`` (the share of blocks whose draft i was accepted, vLLM's
    per-position acceptance), ``blocks``, ``problems``, ``greedy_mismatch`` (rows where the full forward's argmax
    differed from the incremental continuation; 0 expected), and the confidence head's mean logit on accepted and
    rejected drafts."""
    count = lambda s: len(tokenizer.encode(s, add_bos=False))
    b = model.cfg.dspark_block_size
    out = {}
    for task in tasks:
        lengths, possible, per_pos, mismatch, conf_hit, conf_miss = [], [], torch.zeros(b), 0, [], []
        for i in range(n):
            p = problem(task, split, i, count, min_back)
            a = prompt_ids(tokenizer, p.prompt)
            cont, ended = greedy_continuation(model, tokenizer, a, max_new)
            rows = backbone_rows(model, [a + cont])[0]
            ex = example_of(task, a + cont, len(a), [], rows, model.cfg.sliding_window, ended)
            if ex.anchors.numel() == 0:
                continue
            rows = ex.tokens.shape[0]
            mismatch += int((ex.target[: rows - 1] != ex.tokens[1:])[len(a) - 1 - ex.start :].sum())
            t = _batch_tensors([ex], model.embed.weight.device, b)
            drafts, kappa = propose_blocks(model, t["taps"], t["positions"], t["rows"], t["pos"], t["y"], model.cfg.qat)
            acc = accepted_lengths(drafts, t["target"], t["valid"])
            lengths.append(acc.cpu())
            possible.append(t["valid"].sum(1).cpu())
            per_pos += (torch.arange(b)[None, :] < acc.cpu()[:, None]).float().sum(0)
            hit = (drafts == t["target"]) & t["valid"]
            conf_hit.append(kappa[hit].cpu())
            conf_miss.append(kappa[~hit & t["valid"]].cpu())
        lengths, possible = torch.cat(lengths).float(), torch.cat(possible).float()
        out[task] = {
            "problems": n,
            "blocks": int(lengths.numel()),
            "mean_accepted": float(lengths.mean()),
            "mean_possible": float(possible.mean()),
            "per_position": (per_pos / lengths.numel()).tolist(),
            "greedy_mismatch": mismatch,
            "conf_logit_accepted": float(torch.cat(conf_hit).mean()) if conf_hit else None,
            "conf_logit_rejected": float(torch.cat(conf_miss).mean()) if conf_miss else None,
        }
    all_len = sum(v["mean_accepted"] * v["blocks"] for v in out.values()) / max(
        1, sum(v["blocks"] for v in out.values())
    )
    out["all"] = {"mean_accepted": all_len, "task_mean": sum(out[t]["mean_accepted"] for t in tasks) / len(tasks)}
    return out


# ------------------------------------------------------------------------------------------------ the checkpoint
def _header(path: str) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size)), 8 + size


def backbone_digest(path: str) -> str:
    """SHA-256 over every non-DSpark tensor of a safetensors file: its name, dtype, shape and raw bytes, in name
    order. Equal digests: the backbone is the same bit for bit."""
    header, base = _header(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for name in sorted(k for k in header if k != "__metadata__" and not k.startswith(DRAFT_PREFIX)):
            meta = header[name]
            lo, hi = meta["data_offsets"]
            f.seek(base + lo)
            h.update(f"{name}|{meta['dtype']}|{meta['shape']}|".encode())
            h.update(f.read(hi - lo))
    return h.hexdigest()


def ship(model, src_dir: str, out_dir: str) -> dict:
    """Write ``src_dir``'s checkpoint to ``out_dir`` (may be the same) with the DSpark tensors taken from
    ``model`` (quantised as the release stores them) and every other tensor's stored bytes unchanged. Returns the
    backbone digests before and after (equal, or this raises)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ..models.checkpoint import SINGLE_FILE, _release_tensors, release_layout

    src = os.path.join(src_dir, SINGLE_FILE)
    before = backbone_digest(src)
    with safe_open(src, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    layout, sd = release_layout(model.cfg), model.state_dict()
    sd = {k: v.detach().cpu().float() for k, v in sd.items() if k.startswith(DRAFT_PREFIX)}
    for name, spec in layout.items():
        if name.startswith(DRAFT_PREFIX) and spec.quant != "scale":
            new = _release_tensors(name, spec, sd, model.cfg)
            for k, v in new.items():
                if k not in tensors or tensors[k].shape != v.shape or tensors[k].dtype != v.dtype:
                    raise ValueError(
                        f"{k}: the checkpoint holds {tuple(tensors.get(k, v).shape)}, the drafter makes "
                        f"{tuple(v.shape)} {v.dtype}"
                    )
                tensors[k] = v
    os.makedirs(out_dir, exist_ok=True)
    if os.path.abspath(out_dir) != os.path.abspath(src_dir):
        for fn in os.listdir(src_dir):
            if fn != SINGLE_FILE and os.path.isfile(os.path.join(src_dir, fn)):
                shutil.copyfile(os.path.join(src_dir, fn), os.path.join(out_dir, fn))
    tmp = os.path.join(out_dir, SINGLE_FILE + ".tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out_dir, SINGLE_FILE))
    after = backbone_digest(os.path.join(out_dir, SINGLE_FILE))
    if after != before:
        raise RuntimeError(f"the backbone changed while shipping the drafter: {before} -> {after}")
    return {"backbone_sha256_before": before, "backbone_sha256_after": after}


# ------------------------------------------------------------------------------------------------ the run
def draft_parameters(model) -> list[torch.nn.Parameter]:
    """The drafter's parameters to train, as they are (fine-tuning): the backbone frozen, and the stages' MoE
    selection biases frozen too (as the backbone was trained)."""
    for p in model.parameters():
        p.requires_grad_(False)
    train = []
    for name, p in model.mtp.named_parameters(prefix="mtp"):
        if not name.endswith(("gate.bias", "gate.bias_vl")):
            p.requires_grad_(True)
            train.append(p)
    return train


def fresh_draft(model, seed: int) -> list[torch.nn.Parameter]:
    """``draft_parameters`` after seeded fresh weights for the drafter (``checkpoint.dummy_tensor``'s init; the
    Markov head's output and the confidence head at zero, so training starts from the shared head's guess; its MoE
    selection biases at zero)."""
    from ..models.checkpoint import dummy_tensor

    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith(DRAFT_PREFIX):
                continue
            dummy_tensor(name, p.data, model.cfg, seed)
            if name.endswith(("markov_head.head.weight", "confidence_head.proj.weight", "gate.bias", "gate.bias_vl")):
                p.zero_()
    return draft_parameters(model)


def _save_state(path: str, model, opt, curve: list, step: int) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save({"mtp": model.mtp.state_dict(), "opt": opt.state_dict(), "curve": curve, "step": step}, path + ".tmp")
    os.replace(path + ".tmp", path)


def train_draft(
    cfg: DraftConfig,
    out_dir: str | None,
    resume: str = "",
    eval_only: bool = False,
    examples_path: str = "",
    pass_only: bool = False,
    log=print,
) -> dict:
    """Train (module docstring), then under ``out_dir``: draft_state.pt (resumable), checkpoint/ (``ship``),
    draft.json (this summary) and draft_loss.png, and the held-out ``acceptance`` of the shipped checkpoint.
    ``eval_only``: no training; with ``resume`` ship that state's drafter, else measure ``cfg.init``'s own.
    ``examples_path``: the backbone pass's output, read if it exists, else written there (``pass_only``: then
    stop); a pass depends only on the backbone, the seed and the problem settings."""
    from ..models.loader import load_model, resolve_config
    from ..models.presets import model_dir
    from .tasks import retrieval_distance

    torch.manual_seed(cfg.seed)
    lm = load_model(cfg.init)
    model, tokenizer = lm.model.to(cfg.device), lm.tokenizer
    if model.mtp is None:
        raise ValueError(f"{cfg.init!r} has no DSpark stages to train")
    min_back = retrieval_distance(resolve_config(cfg.init))
    params = []
    if not eval_only or resume:
        params = draft_parameters(model) if cfg.from_init else fresh_draft(model, cfg.seed)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95)) if params else None
    curve, step0, step, examples, backbone_s, t1 = [], 0, 0, [], 0.0, time.perf_counter()
    if resume:
        state = torch.load(resume, map_location=cfg.device)
        model.mtp.load_state_dict(state["mtp"])
        opt.load_state_dict(state["opt"])
        curve, step0 = state["curve"], state["step"]
        step = step0 - 1
    if not eval_only:
        model.train()
        t0 = time.perf_counter()
        if examples_path and os.path.exists(examples_path):
            examples = torch.load(examples_path, weights_only=False)
            log(f"backbone pass: {len(examples)} problems read from {examples_path}")
        else:
            examples = training_examples(model, tokenizer, cfg, min_back, log)
            if examples_path:
                torch.save(examples, examples_path)
        if pass_only:
            return {"examples": len(examples), "path": examples_path}
        backbone_s = time.perf_counter() - t0
        blocks = sum(int(e.anchors.numel()) for e in examples)
        log(f"backbone pass: {len(examples)} problems, {blocks} blocks, {backbone_s:.0f} s")
        rng = random.Random(f"draft-batches/{cfg.seed}/{step0}")
        # a resumed run starts its own schedule (warm-up, cosine over its steps or clock); its curve goes on
        order, t1, seconds0 = [], time.perf_counter(), curve[-1]["seconds"] if curve else 0.0
        for step in range(step0, step0 + cfg.steps):
            elapsed = time.perf_counter() - t1
            progress = max((step - step0) / cfg.steps, elapsed / cfg.time_limit if cfg.time_limit else 0.0)
            if progress >= 1:
                step -= 1
                break
            lr = cfg.lr * min(1.0, (step - step0 + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * progress))
            for g in opt.param_groups:
                g["lr"] = lr
            if len(order) < cfg.batch:
                more = list(range(len(examples)))
                rng.shuffle(more)
                order += more
            batch, order = [examples[i] for i in order[: cfg.batch]], order[cfg.batch :]
            out = draft_losses(model, batch, model.cfg.qat)
            opt.zero_grad(set_to_none=True)
            (out["ce"] + cfg.conf_weight * out["conf_bce"]).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            if step % cfg.log_every == 0:
                curve.append(
                    {
                        "step": step,
                        "ce": float(out["ce"].detach()),
                        "conf_bce": float(out["conf_bce"].detach()),
                        "agree": [round(float(a), 4) for a in out["agree"]],
                        "lr": lr,
                        "seconds": seconds0 + elapsed,
                    }
                )
                log(
                    f"step {step}  ce {curve[-1]['ce']:.3f}  conf {curve[-1]['conf_bce']:.3f}  agree "
                    + " ".join(f"{a:.2f}" for a in curve[-1]["agree"])
                    + f"  {seconds0 + elapsed:.0f} s"
                )
            if out_dir and cfg.save_every and (step + 1) % cfg.save_every == 0:
                _save_state(os.path.join(out_dir, "draft_state.pt"), model, opt, curve, step + 1)
    model.eval()
    summary = {
        "meta": run_meta(),
        "config": asdict(cfg),
        "init": model_dir(cfg.init),
        "resumed_from": resume or None,
        "backbone_pass_seconds": backbone_s,
        "train_seconds": (curve[-1]["seconds"] if curve else 0.0) if eval_only else time.perf_counter() - t1,
        "steps_run": 0 if eval_only else step + 1 - step0,
        "steps_total": step0 if eval_only else step + 1,
        "blocks": sum(int(e.anchors.numel()) for e in examples) if examples else None,
        "min_back": min_back,
        "curve": curve,
    }
    measured = model
    if out_dir and params:
        if not eval_only:
            _save_state(os.path.join(out_dir, "draft_state.pt"), model, opt, curve, step + 1)
        ckpt = os.path.join(out_dir, "checkpoint")
        summary["ship"] = ship(model.cpu(), model_dir(cfg.init), ckpt)
        log(f"shipped to {ckpt}: backbone sha256 {summary['ship']['backbone_sha256_after']} (unchanged)")
        measured = load_model(ckpt).model  # the stages as stored (FP8, MXFP4), reloaded
    if cfg.heldout_n:
        summary["acceptance"] = acceptance(measured.eval(), tokenizer, cfg.heldout_n, cfg.max_new, min_back)
        log("held-out acceptance: " + json.dumps(summary["acceptance"]))
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "draft.json"), "w") as f:
            json.dump(summary, f, indent=1)
        if curve:
            plot(curve, os.path.join(out_dir, "draft_loss.png"))
    return summary


def plot(curve: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [c["step"] for c in curve]
    ax.plot(steps, [c["ce"] for c in curve], label="draft cross entropy (vs the target's argmax)")
    ax.plot(steps, [c["conf_bce"] for c in curve], label="confidence head BCE")
    ax.set(xlabel="step", ylabel="nats", yscale="log", title="DSpark drafter, backbone frozen")
    ax.legend()
    for i in range(len(curve[0]["agree"]) if curve else 0):
        bx.plot(steps, [c["agree"][i] for c in curve], label=f"draft {i}")
    bx.set(xlabel="step", ylabel="share", title="teacher-forced agreement with the target's argmax")
    bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = DraftConfig()
    for name in ("init", "device"):
        p.add_argument(f"--{name.replace('_', '-')}", default=getattr(d, name))
    p.add_argument("--continuation", default=d.continuation, choices=("gold", "target"))
    for name in (
        "seed",
        "problems",
        "prompt_anchors",
        "continuation_tokens",
        "batch",
        "steps",
        "warmup",
        "heldout_n",
        "max_new",
        "log_every",
        "save_every",
    ):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    for name in ("prompt_weight", "conf_weight", "lr", "time_limit"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name))
    p.add_argument("--mix", default=",".join(f"{t}={w}" for t, w in d.mix))
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--from-init", action="store_true", help="fine-tune --init's own drafter, not fresh weights")
    p.add_argument("--resume", default="", help="a draft_state.pt to go on from (same data, same seed)")
    p.add_argument("--examples", default="", help="the backbone pass's output: read if present, else written")
    p.add_argument("--pass-only", action="store_true", help="only the backbone pass (to --examples)")
    p.add_argument(
        "--eval-only",
        action="store_true",
        help="no training: ship --resume's drafter (if given) and measure the held-out acceptance",
    )
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    from .train import parse_mix

    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        args = {
            k: v
            for k, v in vars(a).items()
            if k not in ("out", "mix", "threads", "resume", "eval_only", "examples", "pass_only")
        }
        cfg = DraftConfig(**args, mix=parse_mix(a.mix))
        if min(cfg.problems, cfg.batch, cfg.steps, cfg.warmup, cfg.continuation_tokens) < 1 or not cfg.lr > 0:
            raise ValueError("problems, batch, steps, warmup and continuation-tokens must be >= 1, and lr > 0")
        summary = train_draft(
            cfg, a.out, a.resume, a.eval_only, a.examples, a.pass_only, log=lambda s: print(s, flush=True)
        )
    except ValueError as e:
        print(f"dsserve.train.draft: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in summary.items() if k not in ("curve", "meta")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
