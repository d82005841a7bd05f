"""A DEP rank built from a release checkpoint (``dp_rank.build_rank_core`` on a directory: ``-dp 2
--enable-expert-parallel``) reads only its share of the files: the routed experts of its slots, with
``--enable-eplb`` the experts of its redundant slots under the initial placement too. Each of two gloo ranks serves
its own requests in lockstep and gives the greedy tokens and fp64 logits (1e-9) of a single-process engine loaded
from the same files (with EPLB, through rebalances that move the experts read); its load report counts exactly the
bytes of its share, and ``dsserve plan``'s per-GPU routed experts are what rank 0 read of them."""

from dataclasses import replace

import pytest
import torch

from dsserve.distributed.dp_rank import build_rank_core, rank_args
from dsserve.distributed.groups import new_groups
from dsserve.distributed.layout import ParallelLayout
from dsserve.engine.args import EngineArgs
from dsserve.engine.core import EngineCore
from dsserve.engine.sampling_params import SamplingParams
from dsserve.models.checkpoint import save_checkpoint
from dsserve.models.checkpoint_files import CheckpointFiles
from dsserve.models.checkpoint_layout import model_name_for, release_layout
from dsserve.models.loader import load_model
from dsserve.models.memory_plan import Machine, PlanOptions, plan
from dsserve.models.tokenizer import TINY_DIR

MAX_NEW = 16  # enough steps for an EPLB rebalance to move every layer (one layer a step boundary)
# The experts each rank holds, in its local order (tiny: 8 routed experts, its drafter 4), written out as the
# placements define them: contiguous halves; with EPLB (2 redundant slots each) slot s holds expert s % E and rank r
# slots [r * P / 2, (r + 1) * P / 2).
SLOTS = {
    "ep": {"layers": ([0, 1, 2, 3], [4, 5, 6, 7]), "mtp": ([0, 1], [2, 3])},
    "eplb": {"layers": ([0, 1, 2, 3, 4], [5, 6, 7, 0, 1]), "mtp": ([0, 1, 2], [3, 0, 1])},
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tiny model written by the project's writer: FP8 dense weights, MXFP4 experts, FP8 Engram tables."""
    src = load_model("tiny", seed=7)
    out = tmp_path_factory.mktemp("tiny-release-dep")
    save_checkpoint(src.model, src.cfg, str(out), tokenizer_dir=TINY_DIR, max_shard_bytes=8 << 20)
    return src.cfg, str(out)


def engine_args(path: str, eplb: bool) -> EngineArgs:
    args = EngineArgs(model=path, dtype="float64", device="cpu", max_num_seqs=4, max_num_batched_tokens=32, seed=0)
    if eplb:  # the files are read for the initial placement; a rebalance due every 2 steps then moves experts
        args = replace(
            args,
            enable_eplb=True,
            num_redundant_experts=2,
            num_redundant_draft_experts=2,
            eplb_window_size=3,
            eplb_step_interval=2,
            eplb_min_gain=0.0,
        )
    return args


def prompts(rank: int) -> list[tuple[str, list[int]]]:
    """Rank 0 serves three requests (one of 40 tokens: chunked prefill), rank 1 one (then idle forwards)."""
    g = torch.Generator().manual_seed(11 + rank)
    return [
        (f"r{rank}-{i}", torch.randint(3, 8000, (n,), generator=g).tolist())
        for i, n in enumerate((40, 9, 23)[: 3 - 2 * rank])
    ]


def serve(core: EngineCore, reqs) -> dict:
    """The requests added at once and stepped to the end (with lockstep: until the wave ends on both ranks); the
    sampled rows' logits recorded at the runner."""
    logits, tokens = {}, {}
    execute = core.runner.execute

    def recording(plan):
        sampling, rows = execute(plan)
        for r, row in zip(sampling, rows):
            logits.setdefault(r.request_id, []).append(row.clone())
        return sampling, rows

    core.runner.execute = recording
    for rid, prompt in reqs:
        core.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    lock = core.lockstep
    if lock is not None:  # what the rank loop does when the front end announces the requests
        lock.seen, lock.awake = lock.seen + 1, True
    while lock.awake if lock is not None else core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    return {"tokens": tokens, "logits": {k: torch.stack(v) for k, v in logits.items()}}


@torch.no_grad()
def _dep2_from_files(rank: int, path: str, eplb: bool) -> dict:
    g = new_groups(1, 2)
    args = engine_args(path, eplb)
    core = build_rank_core(args, g.dp_rank, 2, g.ep)
    ffn, draft = core.model.layers[0].ffn, core.model.mtp[0].ffn
    held = {  # the logical expert of each of this rank's slots, as the MoE layers route to them
        "layers": [ffn.replicas.phy2log[s] for s in ffn.dispatcher.placement.owned[rank]] if eplb else None,
        "rows": ffn.experts["w1"].shape[0],
        "draft_rows": draft.experts["w1"].shape[0],
    }
    dep = serve(core, prompts(rank))
    ref = EngineCore(rank_args(args, expert_parallel=True))  # the same files, whole, in one process
    return {
        "dep": dep,
        "ref": serve(ref, prompts(rank)),
        "kind": type(ffn).__name__,
        "held": held,
        "eplb": core.lockstep.eplb is not None,
        "switched": 0 if core.lockstep.eplb is None else len(core.lockstep.eplb.models[0].switched),
        "idle": core.lockstep.idle_steps,
        "bytes_read": core.load_report.bytes_read,
        "routed_bytes": core.load_report.routed_expert_bytes,
        "ref_bytes_read": ref.load_report.bytes_read,
    }


def share_bytes(cfg, slots: dict, rank: int) -> tuple[int, int]:
    """(all bytes, routed-expert bytes) rank ``rank`` reads: every release tensor but the routed experts (scales
    with their weight) whole, and each expert of its slots once per slot."""
    total = routed = 0
    for name, spec in release_layout(cfg).items():
        mname, e = model_name_for(spec.owner or name)
        if e is None:
            total += spec.nbytes
            continue
        n = slots["layers" if mname.startswith("layers.") else "mtp"][rank].count(e) * spec.nbytes
        total += n
        routed += n if mname.startswith("layers.") else 0
    return total, routed


@pytest.fixture(scope="module", params=["ep", "eplb"])
def served(request, workers, saved):
    cfg, path = saved
    return request.param, cfg, workers.run(_dep2_from_files, path, request.param == "eplb")


def test_dep2_from_files_equals_the_single_process_engine(served):
    how, cfg, out = served
    for rank, o in enumerate(out):
        dep, ref = o["dep"], o["ref"]
        assert o["kind"] == "ExpertParallelMoE" and o["eplb"] == (how == "eplb")
        assert dep["tokens"] == ref["tokens"] and sorted(dep["tokens"]) == sorted(r for r, _ in prompts(rank))
        for rid, want in ref["logits"].items():
            assert dep["logits"][rid].shape == want.shape
            assert (dep["logits"][rid] - want).abs().max().item() < 1e-9, (how, rank, rid)
    assert out[1]["idle"] > 0  # rank 1 joined rank 0's longer work with idle forwards
    if how == "eplb":  # experts read from the files moved between the ranks mid-run
        assert out[0]["switched"] > 0


def test_each_dep_rank_reads_only_the_experts_of_its_slots(served):
    how, cfg, out = served
    slots = SLOTS[how]
    whole = sum(s.nbytes for s in release_layout(cfg).values())
    for rank, o in enumerate(out):
        assert o["ref_bytes_read"] == whole
        total, routed = share_bytes(cfg, slots, rank)
        assert (o["bytes_read"], o["routed_bytes"]) == (total, routed), (how, rank)
        assert o["held"]["rows"] == len(slots["layers"][rank]) and o["held"]["draft_rows"] == len(slots["mtp"][rank])
        if how == "eplb":
            assert o["held"]["layers"] == slots["layers"][rank]
    if how == "ep":  # the halves: each rank half of the routed experts' bytes
        every = {"layers": ([*range(cfg.n_routed_experts)],), "mtp": ([*range(cfg.dspark_n_routed_experts)],)}
        assert 2 * out[0]["routed_bytes"] == 2 * out[1]["routed_bytes"] == share_bytes(cfg, every, 0)[1]


def test_plan_counts_the_routed_expert_bytes_rank_0_reads(served):
    """``dsserve plan``'s per-GPU routed experts (MXFP4 as stored) are the bytes rank 0 read of them (every rank of
    a DEP layout holds as many slots)."""
    how, cfg, out = served
    redundant = 2 if how == "eplb" else 0
    opts = PlanOptions(data_parallel_size=2, enable_expert_parallel=True, num_redundant_experts=redundant)
    weights = plan(cfg, Machine(2, 80 << 30, 1 << 40), opts).weights
    assert weights["routed experts"] == out[0]["routed_bytes"] == out[1]["routed_bytes"]


def test_a_gpu_rank_plans_for_its_share_of_a_checkpoint(saved, monkeypatch):
    """The start-up check on a GPU (``core.choose_forms``) counts the weights a DEP rank reads, not the whole
    model's: on a GPU that holds half the experts a rank of 2 starts where a lone engine is refused."""
    from dsserve.engine.args import EngineArgsError
    from dsserve.engine.core import choose_forms
    from dsserve.models.memory_plan import weight_bytes

    cfg, path = saved
    layout = ParallelLayout(ep_rank=1, ep_size=2)
    forms = PlanOptions(quantization="fp8", expert_format="mxfp4")
    whole, share = (sum(weight_bytes(cfg, lay, forms)[0].values()) for lay in (ParallelLayout(), layout))
    assert share < whole
    total = int((share + whole) / 2 / 0.9)  # the budget (0.9 of it) lies between the two
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total, total))
    args = EngineArgs(model=path, device="cuda", engram_tables="host-fp8", enforce_eager=True, max_num_seqs=1)
    monkeypatch.setattr("dsserve.models.memory_plan.activation_bytes", lambda cfg, opts: 0)
    got = choose_forms(args, torch.device("cuda"), None, path, layout)
    assert (got.quantization, got.expert_format) == ("fp8", "mxfp4")
    with pytest.raises(EngineArgsError, match="does not fit this GPU"):
        choose_forms(args, torch.device("cuda"), None, path)


@torch.no_grad()
def _eplb_rank_packed(rank: int, path: str) -> dict:
    """The GPU's forms (stored FP8 linears, stored MXFP4 experts, nothing dense) of an EPLB rank from the files."""
    from dsserve.distributed.eplb import EplbConfig
    from dsserve.models.loader import resolve_config
    from dsserve.models.release_loader import load_release

    g = new_groups(1, 2)
    layout = EplbConfig(num_redundant_experts=2, num_redundant_draft_experts=2).layout(g.dp_rank, 2)
    forms = {"quantization": "fp8", "expert_format": "mxfp4", "keep_dense": False}
    net, report = load_release(resolve_config(path), path, layout=layout, ep_group=g.ep, **forms)
    ffn = net.layers[3].ffn
    return {"w2": ffn.packed.w2, "s2": ffn.packed.s2, "routed": report.routed_expert_bytes, "dense": len(ffn.experts)}


def test_an_eplb_rank_keeps_the_stored_mxfp4_bytes_of_its_slots(workers, saved):
    cfg, path = saved
    out = workers.run(_eplb_rank_packed, path)
    with CheckpointFiles(path) as files:
        for rank, o in enumerate(out):
            assert o["dense"] == 0 and o["routed"] == share_bytes(cfg, SLOTS["eplb"], rank)[1]
            for i, e in enumerate(SLOTS["eplb"]["layers"][rank]):
                name = f"layers.3.ffn.experts.{e}.w2"
                assert torch.equal(o["w2"][i], files.read(f"{name}.weight").view(torch.uint8)), (rank, e)
                assert torch.equal(o["s2"][i], files.read(f"{name}.scale").view(torch.uint8)), (rank, e)
