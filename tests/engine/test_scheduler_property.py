"""Property test: random arrivals, aborts, priorities and memory pressure never leak or lose anything.

The model is replaced by bookkeeping (rows advance the cache's token count), so thousands of steps run
in seconds; the real forward over the same scheduler is tested in test_paged_engine.py.
"""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsserve.engine.request import Request, RequestStatus
from dsserve.engine.sampling_params import SamplingParams
from dsserve.engine.scheduler import Scheduler, SchedulerConfig, StepOutput
from dsserve.kv.paged import KVLayout, PagedKVCache
from dsserve.models.presets import preset

LAYOUT = KVLayout.build(preset("tiny"), block_size=16)

request = st.tuples(st.integers(1, 60), st.integers(1, 12), st.integers(0, 3))  # prompt, max_tokens, priority
event = st.one_of(
    st.tuples(st.just("add"), request),
    st.tuples(st.just("abort"), st.integers(0, 40)),
    st.tuples(st.just("step"), st.integers(1, 3)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    events=st.lists(event, min_size=1, max_size=60),
    blocks=st.integers(8, 24),
    seqs=st.integers(1, 6),
    budget=st.integers(1, 48),
    chunk=st.integers(0, 20),
    policy=st.sampled_from(["fcfs", "priority"]),
    prefix=st.booleans(),
    replay=st.booleans(),
)
def test_random_traffic_keeps_invariants(events, blocks, seqs, budget, chunk, policy, prefix, replay):
    kv = PagedKVCache(LAYOUT, blocks, seqs, prefix_caching=prefix)
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=seqs,
            policy=policy,
            long_prefill_token_threshold=chunk,
            enable_prefix_caching=prefix,
            swa_bounded_replay=replay,
            replay_window=8,
        ),
        kv,
    )
    reqs: list[Request] = []

    def step():
        plan = sched.schedule()
        seen = set()
        for c in plan.chunks:
            r = c.request
            assert r.status == RequestStatus.RUNNING and r.request_id not in seen and c.num_tokens > 0
            seen.add(r.request_id)
            assert len(r.kv.block_table) * LAYOUT.block_size >= r.num_computed_tokens + c.num_tokens
            r.kv.num_tokens += c.num_tokens  # what the model's forward does to the cache
        assert plan.num_tokens <= budget and len(sched.running) <= seqs
        sched.register_full_blocks([c.request for c in plan.chunks])
        for r in sched.update(plan, StepOutput({c.request.request_id: [5] for c in plan.chunks if c.samples})):
            if len(r.output_token_ids) == r.params.max_tokens:
                sched.finish(r, RequestStatus.FINISHED_LENGTH)
        sched.check()

    for kind, arg in events:
        if kind == "add":
            p, m, prio = arg
            if -(-(p + m) // LAYOUT.block_size) > blocks:
                continue  # the engine rejects these at add_request
            r = Request(str(len(reqs)), [7] * p, SamplingParams(max_tokens=m), priority=prio)  # shared prefixes
            reqs.append(r)
            sched.add(r)
        elif kind == "abort" and reqs:
            sched.abort(reqs[arg % len(reqs)].request_id)
        else:
            for _ in range(arg):
                step()
    for _ in range(10_000):  # drain: everything not aborted finishes with all its tokens
        if not sched.has_unfinished():
            break
        step()
    assert not sched.has_unfinished()
    assert kv.blocks.num_free == blocks and kv.slots.num_free == seqs
    if prefix:  # every cached hash points at a block whose registration is still current
        for h, b in kv.prefix._block_of.items():
            assert kv.prefix._hash_of[b] == h
    for r in reqs:
        assert r.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)
        if r.status == RequestStatus.FINISHED_LENGTH:
            assert len(r.output_token_ids) == r.params.max_tokens


def test_update_applies_a_step_to_each_request_once():
    """``Scheduler.update`` is what moves progress: a chunk's rows into the cache count, the step's accepted tokens
    (several for one request, as a verify step will give) are appended in order, and a request aborted while the
    step ran is left as the abort left it."""
    kv = PagedKVCache(LAYOUT, 16, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4), kv)
    a, b, c = (Request(n, [7] * k, SamplingParams(max_tokens=8)) for n, k in (("a", 5), ("b", 9), ("c", 3)))
    for r in (a, b, c):
        sched.add(r)
    plan = sched.schedule()
    assert [(ch.request.request_id, ch.num_tokens) for ch in plan.chunks] == [("a", 5), ("b", 9), ("c", 3)]
    sched.abort("c")
    given = sched.update(plan, StepOutput({"a": [11, 12, 13], "b": [21], "c": [31]}))
    assert given == [a, b]
    assert (a.num_computed_tokens, a.output_token_ids) == (5, [11, 12, 13])
    assert (b.num_computed_tokens, b.output_token_ids) == (9, [21])
    assert (c.num_computed_tokens, c.output_token_ids) == (0, [])
    plan = sched.schedule()  # a's three new tokens are pending; b's one
    assert [(ch.request.request_id, ch.num_tokens) for ch in plan.chunks] == [("a", 3), ("b", 1)]
    assert sched.update(plan, StepOutput()) == [] and (a.num_computed_tokens, b.num_computed_tokens) == (8, 10)
