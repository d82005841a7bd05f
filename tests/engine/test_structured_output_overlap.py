"""Grammar masks overlapped with the forward under asynchronous scheduling: a decode step with constrained rows is
launched ahead of the host's read of the previous tokens and sampled after it (the grammars accept those tokens,
then their masks are filled and applied). Outputs are the synchronous engine's and those of the async engine that
holds constrained requests back (``grammar_ahead=False``), request by request, for json_schema, json_object and
tool_choice=required requests mixed with unconstrained ones, greedy and seeded.

The engines run the tiny model in fp64 on the paged backend (the async one in fixed-shape decode steps, run eagerly
on the CPU), as tests/engine/test_async_scheduling.py, so their logits agree to ~1e-12 and so do their tokens."""

import json

import pytest
import torch

from dsserve.engine.args import EngineArgs
from dsserve.engine.core import EngineCore
from dsserve.engine.sampling_params import SamplingParams

pytest.importorskip("xgrammar")
SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "n": {"enum": [1, 2, 3]}, "ok": {"type": "boolean"}},
    "required": ["city", "n", "ok"],
    "additionalProperties": False,
}
PROMPTS = ["The weather today:", "Write JSON.", "Stock check for the north warehouse, please", "Hi"]


def _core(async_on: bool) -> EngineCore:
    return EngineCore(
        EngineArgs(
            model="tiny",
            dtype="float64",
            device="cpu",
            attention_backend="paged",
            max_num_seqs=8,
            max_num_batched_tokens=64,
            async_scheduling=async_on,
            kv_cache_memory=64 << 20,
            reference_ops="all",
        )
    )


def _required_tag(dialect: str) -> str:
    from dsserve.server import tool_calls as tc

    tool = {"type": "function", "function": {"name": "stock", "parameters": SCHEMA}}
    return tc.plan_tools([tool], "required", False, thinking=False, dialect=dialect, grammar=True).structural_tag


def _mixed() -> list[SamplingParams]:
    schema, obj, tag = json.dumps(SCHEMA), json.dumps({"type": "object"}), _required_tag("v4")
    return [
        SamplingParams(temperature=0, max_tokens=60, json_schema=schema),
        SamplingParams(temperature=1.0, seed=1, max_tokens=60, json_schema=schema),
        SamplingParams(temperature=0, max_tokens=24, json_schema=obj),  # json_object: may end by length
        SamplingParams(temperature=1.0, seed=2, max_tokens=24, json_schema=obj),
        SamplingParams(temperature=0, max_tokens=120, structural_tag=tag),  # tool_choice=required
        SamplingParams(temperature=1.0, seed=3, max_tokens=120, structural_tag=_required_tag("v4.1")),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),  # unconstrained
        SamplingParams(temperature=0.9, top_k=9, seed=4, max_tokens=30, ignore_eos=True),
    ]


def _run(core: EngineCore, params: list[SamplingParams], late: int = 2) -> dict:
    """All but the last ``late`` requests at once; those arrive while the others decode (steps then wait for the
    read), one of them also constrained."""
    first = len(params) - late
    for k in range(first):
        core.add_request(str(k), PROMPTS[k % len(PROMPTS)], params[k])
    done, added = {}, False
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                done[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].finish_reason, out.outputs[0].text)
        if not added and done:
            for k in range(first, len(params)):
                core.add_request(str(k), PROMPTS[k % len(PROMPTS)], params[k])
            added = True
        core.scheduler.check()
    assert core.kv.blocks.num_free == core.kv.blocks.num_blocks  # nothing leaked, dropped ahead rows included
    return done


@pytest.fixture(scope="module")
def cores():
    return _core(False), _core(True)


def test_overlapped_masks_give_the_same_tokens(cores):
    sync, asyn = cores
    params = _mixed()
    params.insert(6, SamplingParams(temperature=0, max_tokens=60, json_schema=json.dumps(SCHEMA)))  # arrives late
    want = _run(sync, params)
    asyn.grammar_ahead = False
    held, before = _run(asyn, params), asyn.stats.ahead_steps
    asyn.grammar_ahead = True
    got = _run(asyn, params)
    assert got == held == want and len(want) == len(params)
    assert asyn.stats.ahead_steps - before > 0  # the overlapped run went ahead (with constrained rows: below)
    for k in (0, 1, 6):  # the schema's JSON, then EOS
        tokens, reason, text = want[str(k)]
        assert reason == "stop" and set(json.loads(text)) == {"city", "n", "ok"}
    assert want[str(7)][1] == "length" and len(want[str(7)][0]) == 40


def test_constrained_requests_run_ahead(cores):
    """A batch of only constrained requests, nothing waiting: held back, no step runs ahead; overlapped, every
    decode step after the first is launched ahead, and the tokens are the same."""
    _, asyn = cores
    params = [p for p in _mixed() if p.grammar is not None]
    counts, outs = {}, {}
    for ahead in (False, True):
        asyn.grammar_ahead = ahead
        before = asyn.stats.ahead_steps
        outs[ahead] = _run(asyn, params, late=0)
        counts[ahead] = asyn.stats.ahead_steps - before
    assert outs[True] == outs[False]
    decode_steps = max(len(t) for t, _, _ in outs[True].values()) - 1
    assert counts[False] == 0 and counts[True] >= decode_steps // 2, (counts, decode_steps)


def test_mask_fill_then_apply(cores):
    """GrammarMask.fill writes only constrained rows (not one whose grammar has terminated), apply sets -inf on
    exactly the tokens a row's bitmask clears, and the sampler given no mask fills the same one itself."""
    from dsserve.engine.sampler import Sampler
    from dsserve.engine.structured_output import GrammarMask

    core = cores[0]
    vocab = core.cfg.vocab_size
    g = [core.grammars.grammar("json_schema", json.dumps(SCHEMA)) for _ in range(3)]

    class Row:
        def __init__(self, grammar, params=SamplingParams(temperature=0)):
            self.params, self.grammar, self.prompt_token_ids, self.output_token_ids = params, grammar, (), ()
            self.generator = None

    for tok in core.tokenizer.encode('{"city": "Rome", "n": 2, "ok": true}', add_bos=False):
        g[2].accept(tok)
    g[2].accept(core.tokenizer.eos_id)
    assert g[2].matcher.is_terminated()
    rows = [Row(g[0]), Row(None), Row(g[2]), Row(g[1])]
    mask = GrammarMask.fill(rows, vocab)
    assert mask.rows == [0, 3]
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    masked = logits.clone()
    mask.apply(masked)
    allowed = masked[0].isfinite()
    assert 0 < int(allowed.sum()) < vocab and torch.equal(masked[0].isfinite(), masked[3].isfinite())
    assert torch.equal(masked[1:3], logits[1:3]) and torch.equal(masked[0][allowed], logits[0][allowed])
    first = core.tokenizer.decode([int(masked[0].argmax())])
    assert first.startswith("{")
    sampler = Sampler(eos_token_id=core.tokenizer.eos_id)
    assert torch.equal(sampler(logits, rows).sampled_token_ids, sampler(logits, rows, mask).sampled_token_ids)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlap_on_gpu_graphs():
    """CUDA graphs, the same engine both ways: overlapped constrained steps (the mask uploaded and applied on the
    device) give the tokens of the engine holding them back, and run ahead."""
    core = EngineCore(
        EngineArgs(
            model="tiny",
            dtype="bfloat16",
            device="cuda",
            max_num_seqs=8,
            max_num_batched_tokens=64,
            async_scheduling=True,
            kv_cache_memory=64 << 20,
        )
    )
    outs, ahead = {}, {}
    for on in (False, True):
        core.grammar_ahead, before = on, core.stats.ahead_steps
        outs[on], ahead[on] = _run(core, _mixed()), core.stats.ahead_steps - before
    assert outs[True] == outs[False] and ahead[True] > ahead[False]
