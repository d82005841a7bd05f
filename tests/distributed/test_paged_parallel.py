"""The engine's batched path (scheduler, paged KV cache, model runner, kernel ops on their torch references) under
TP2 and DEP2 on two gloo ranks, fp64, greedy: every rank's tokens equal the single-process oracle's and its logits lie
within 1e-9 of the reference forward's. DEP2 steps in lockstep (step_sync): a rank whose requests are done runs
idle_forward while the other still decodes, until neither holds a request."""

import torch
from tiny import tiny_model

from dsserve.distributed.expert_parallel import idle_forward, shard_expert_parallel
from dsserve.distributed.groups import new_groups
from dsserve.distributed.step_sync import StepSummary, StepSync
from dsserve.distributed.tensor_parallel import shard_tensor_parallel
from dsserve.engine.greedy import greedy_generate
from dsserve.engine.request import Request, RequestStatus
from dsserve.engine.runner import ModelRunner
from dsserve.engine.sampling_params import SamplingParams
from dsserve.engine.scheduler import Scheduler, SchedulerConfig, StepOutput
from dsserve.kernels.ops import OPS, KernelOps
from dsserve.kv.paged import KVLayout, PagedKVCache

MAX_NEW = 4
# TP2: both ranks serve these; DEP2: rank r serves RANK_PROMPTS[r] (rank 1 finishes first: it idles while 0 decodes)
PROMPTS = ((3, 5, 7, 11, 13), tuple(range(100, 140)), (9,) * 20)
RANK_PROMPTS = ((tuple(range(200, 236)), (4, 8, 15, 16, 23, 42)), ((77,) * 9,))
CHUNK = 7  # prefill chunks of 7 rows: several steps mix chunks and decodes


class Serving:
    """One rank's scheduler, paged KV cache and runner over its prompts, stepped from outside."""

    def __init__(self, model, prompts):
        model.kernel_ops = KernelOps(frozenset(OPS))
        layout = KVLayout.build(model.cfg, dtype=torch.float64)
        blocks = sum(-(-(len(p) + MAX_NEW) // layout.block_size) for p in prompts)
        self.kv = PagedKVCache(layout, blocks, len(prompts), dtype=torch.float64, device="cpu")
        config = SchedulerConfig(
            max_num_batched_tokens=64, max_num_seqs=len(prompts), long_prefill_token_threshold=CHUNK
        )
        self.sched = Scheduler(config, self.kv)
        self.runner = ModelRunner(model)
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
        self.reqs = [Request(str(i), list(p), params) for i, p in enumerate(prompts)]
        self.logits = {r.request_id: [] for r in self.reqs}
        for r in self.reqs:
            self.sched.add(r)

    def step(self, plan) -> None:
        sampling, logits = self.runner.execute(plan)
        for r, row in zip(sampling, logits):
            self.logits[r.request_id].append(row)
        # the scheduler owns request progress: it advances num_computed_tokens and appends the accepted tokens
        self.sched.update(plan, StepOutput({r.request_id: [int(row.argmax())] for r, row in zip(sampling, logits)}))
        for r in sampling:
            if len(r.output_token_ids) == MAX_NEW:
                self.sched.finish(r, RequestStatus.FINISHED_LENGTH)

    def result(self):
        return [(r.output_token_ids, torch.stack(self.logits[r.request_id])) for r in self.reqs]


@torch.no_grad()
def _tp2(rank: int) -> list:
    g = new_groups(2, 1)
    s = Serving(shard_tensor_parallel(tiny_model("tiny"), g.tp_rank, 2, g.tp), PROMPTS)
    while s.sched.has_unfinished():  # both ranks schedule the same plans: the same requests, a deterministic scheduler
        s.step(s.sched.schedule())
    return s.result()


@torch.no_grad()
def _dep2(rank: int) -> dict:
    g = new_groups(1, 2)
    model = shard_expert_parallel(tiny_model("tiny"), g.dp_rank, 2, g.ep)
    s, sync, idle = Serving(model, RANK_PROMPTS[g.dp_rank]), StepSync(g.ep), 0
    while True:
        plan = s.sched.schedule() if s.sched.has_unfinished() else None
        n = 0 if plan is None else plan.num_tokens
        summary = StepSummary(n, 0 if plan is None else len(plan.chunks), int(s.sched.has_unfinished()), 0)
        if StepSync.wave_done(sync.gather(summary)):
            break
        if n:
            s.step(plan)
        else:
            idle_forward(model)
            idle += 1
    return {"result": s.result(), "idle_steps": idle}


def _check(prompts, results):
    ref = tiny_model("tiny")
    with torch.no_grad():
        for p, (tokens, logits) in zip(prompts, results):
            want = greedy_generate(ref, list(p), MAX_NEW, bounded_replay=False)
            assert tokens == want
            oracle = ref.reference_logits(torch.tensor(list(p) + want[:-1]))[len(p) - 1 :]
            assert (logits - oracle).abs().max().item() < 1e-9


def test_tp2_paged_path(workers):
    out = workers.run(_tp2)
    _check(PROMPTS, out[0])
    for (t0, l0), (t1, l1) in zip(*out):
        assert t0 == t1 and torch.equal(l0, l1)


def test_dep2_paged_path_in_lockstep(workers):
    out = workers.run(_dep2)
    for rank, o in enumerate(out):
        _check(RANK_PROMPTS[rank], o["result"])
    assert out[0]["idle_steps"] == 0 and out[1]["idle_steps"] > 0  # rank 1 finished first and kept joining
