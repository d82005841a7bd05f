"""dsserve plan's arithmetic (issue 53.4) against dsserve info's parameter counts and the loader's shares."""

import pytest

from dsserve.distributed.layout import ParallelLayout
from dsserve.models.accounting import kv_bytes, param_counts
from dsserve.models.memory_plan import Machine, PlanOptions, parse_bytes, plan, weight_bytes
from dsserve.models.presets import preset

H200 = Machine(1, parse_bytes("141GiB"), parse_bytes("2TiB"))


@pytest.fixture(scope="module")
def flash():
    return preset("v41-flash")


def test_parse_bytes():
    assert parse_bytes("141GiB") == 141 * 2**30 and parse_bytes("2TiB") == 2 * 2**40 and parse_bytes("512M") == 2**29
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots")


def test_weights_equal_the_parameter_counts(flash):
    pc = param_counts(flash)
    w, engram_fp8, engram_bf16 = weight_bytes(
        flash, ParallelLayout(), PlanOptions(quantization=None, expert_format=None)
    )
    # everything dequantised to bf16: 2 bytes a parameter, kind by kind
    assert w["routed experts"] == 2 * pc.parts["routed_experts"]
    assert w["other weights"] == 2 * (pc.backbone - pc.parts["routed_experts"])
    assert w["DSpark"] == 2 * pc.draft
    assert engram_bf16 == 2 * pc.engram_tables
    assert engram_fp8 == pc.engram_tables * 33 // 32  # e4m3 + one e8m0 per 32
    # as stored: MXFP4 experts are 4 bits + one byte per 32 values = 0.53125 B a parameter
    w, _, _ = weight_bytes(flash, ParallelLayout(), PlanOptions())
    assert w["routed experts"] == pc.parts["routed_experts"] * 17 // 32


def test_expert_parallel_divides_the_experts_and_nothing_else(flash):
    one, _, _ = weight_bytes(flash, ParallelLayout(), PlanOptions())
    eight, _, _ = weight_bytes(flash, ParallelLayout(ep_size=8), PlanOptions())
    assert eight["routed experts"] * 8 == one["routed experts"]
    assert eight["dense FP8 projections"] == one["dense FP8 projections"]
    assert eight["other weights"] == one["other weights"]


def test_a_gpu_holds_its_rank_s_experts_under_tp_x_dep_and_eplb(flash):
    """Rank 0's layout is the engine's: EP over the DP ranks, each TP rank cutting its experts' intermediate
    (tp_worker.TPRank.layout), so TP x DP GPUs hold 1 / (TP x DP) of the experts each; EPLB's redundant slots add
    theirs (P / DP slots a DEP rank: dp_rank.build_rank_core's layout)."""
    one = weight_bytes(flash, ParallelLayout(), PlanOptions())[0]["routed experts"]
    for tp, dp in ((1, 8), (2, 4), (8, 1), (4, 2)):
        opts = PlanOptions(tensor_parallel_size=tp, data_parallel_size=dp, enable_expert_parallel=True)
        assert opts.layout() == ParallelLayout(tp_size=tp, ep_size=dp)
        assert plan(flash, H200, opts).weights["routed experts"] * tp * dp == one, (tp, dp)
    opts = PlanOptions(data_parallel_size=8, enable_expert_parallel=True, num_redundant_experts=32)
    per_expert = one // flash.n_routed_experts
    assert plan(flash, H200, opts).weights["routed experts"] == per_expert * (flash.n_routed_experts + 32) // 8


def test_one_gpu_does_not_fit_and_dep8_does(flash):
    p = plan(flash, H200, PlanOptions())
    assert not p.fits and "by 181.32 GiB" in p.problems[0]
    assert p.engram_where == "host-fp8"  # 189 GiB of tables never fit beside the weights
    p8 = plan(flash, Machine(8, H200.gpu_memory, H200.host_memory), PlanOptions(8 // 8, 8, True))
    assert p8.fits and 40 < p8.weight_bytes / 2**30 < 50  # spec parallel 2: DEP8 ~47 GB/GPU
    kv = kv_bytes(flash)
    assert p8.kv_tokens == int(p8.kv_bytes // kv.global_per_token) and kv.global_per_token == 890
    assert p8.kv_bytes == p8.budget - p8.weight_bytes - p8.activation - p8.graph_pool


def test_tp_replicates_the_kv_and_says_what_it_costs(flash):
    p = plan(flash, Machine(4, H200.gpu_memory, H200.host_memory), PlanOptions(tensor_parallel_size=4))
    assert p.fits and 70 < p.weight_bytes / 2**30 < 80  # spec parallel 2: TP4 ~77 GB/GPU
    assert p.tp_duplicate_bytes == 3 * p.kv_bytes
    assert any("replicates the global KV" in line for line in p.lines())


def test_gpu_count_must_match_the_layout(flash):
    p = plan(flash, Machine(2, H200.gpu_memory, H200.host_memory), PlanOptions(tensor_parallel_size=4))
    assert any("--gpus is 2" in q for q in p.problems)


def test_host_memory_short_for_the_tables(flash):
    p = plan(flash, Machine(8, H200.gpu_memory, parse_bytes("128GiB")), PlanOptions(1, 8, True))
    assert not p.fits and any(q.startswith("host: the Engram tables take") for q in p.problems)


def test_the_dp_ranks_of_a_node_hold_one_copy_of_the_tables(flash):
    """Spec parallel 3.4: the host tables are one copy per node (layers.engram_store), not one per DP rank."""
    one = plan(flash, H200, PlanOptions(engram_tables="host-fp8"))
    dep8 = plan(flash, Machine(8, H200.gpu_memory, parse_bytes("1TiB")), PlanOptions(1, 8, True))
    assert dep8.engram_where == "host-fp8" and dep8.host_bytes == dep8.engram_bytes == one.host_bytes
    assert 180 < dep8.host_bytes / 2**30 < 200 and not any(q.startswith("host:") for q in dep8.problems)
    assert any("per node (one copy for every rank)" in line for line in dep8.lines())


# ------------------------------------------------------------------ issue 62: --gpu-memory-utilization sizes the KV
def test_gpu_kv_budget_is_what_the_utilisation_leaves():
    from dsserve.models.memory_plan import gpu_kv_budget

    gib = 2**30
    # 141 GiB GPU, 50 GiB in use after the weights: 0.9 x 141 - 50 - 2 - 2 = 72.9 GiB
    assert gpu_kv_budget(141 * gib, 91 * gib, 0.9, 2 * gib, 2 * gib) == int(0.9 * 141 * gib) - 54 * gib
    with pytest.raises(ValueError, match=r"no GPU memory left.*short\): raise --gpu-memory-utilization"):
        gpu_kv_budget(80 * gib, 10 * gib, 0.9, 2 * gib, 2 * gib)


def test_engine_kv_budget_with_fake_free_memory(monkeypatch):
    import torch

    from dsserve.engine.args import EngineArgs, EngineArgsError
    from dsserve.engine.core import CPU_KV_CACHE_MEMORY, kv_cache_budget
    from dsserve.models.memory_plan import GRAPH_POOL_BYTES, activation_bytes

    gib, cfg = 2**30, preset("tiny")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * gib, 141 * gib))
    cuda = torch.device("cuda")
    act = activation_bytes(cfg, PlanOptions())
    assert kv_cache_budget(EngineArgs(), cuda, cfg, graphs=True) == int(0.9 * 141 * gib) - 41 * gib - act - (
        GRAPH_POOL_BYTES
    )
    assert kv_cache_budget(EngineArgs(gpu_memory_utilization=0.5), cuda, cfg) == int(0.5 * 141 * gib) - 41 * gib - act
    assert kv_cache_budget(EngineArgs(kv_cache_memory_bytes=3 * gib), cuda, cfg) == 3 * gib
    assert kv_cache_budget(EngineArgs(kv_cache_memory=3 * gib), cuda, cfg) == 3 * gib  # the old name, an alias
    with pytest.raises(EngineArgsError, match="raise --gpu-memory-utilization"):
        kv_cache_budget(EngineArgs(gpu_memory_utilization=0.2), cuda, cfg)
    assert kv_cache_budget(EngineArgs(), torch.device("cpu"), cfg) == CPU_KV_CACHE_MEMORY  # the CPU stays small
    with pytest.raises(EngineArgsError, match="same setting"):
        EngineArgs(kv_cache_memory=1 << 20, kv_cache_memory_bytes=2 << 20)
    with pytest.raises(EngineArgsError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        EngineArgs(gpu_memory_utilization=1.5)


# ------------------------------------------------------------------ issue 53.5: defaults follow the checkpoint
def test_a_checkpoint_runs_as_stored_on_a_gpu_and_dense_on_the_cpu():
    from dsserve.models.memory_plan import choose_forms

    tiny, gib = preset("tiny"), 2**30
    big = Machine(1, 141 * gib, 2 * 2**40)
    q, ef, et, why = choose_forms(tiny, True, True, None, None, "auto", big, PlanOptions())
    assert (q, ef, et) == ("fp8", "mxfp4", "device") and "kept as stored" in why[0]
    # a GPU too small for the tables beside the weights with half the budget left: host memory, FP8 as stored
    small = Machine(1, 2 * 2**20 + PlanOptions().graph_pool + 2 * gib, 2 * 2**40)
    q, ef, et, why = choose_forms(tiny, True, True, None, None, "auto", small, PlanOptions(max_num_batched_tokens=16))
    assert et == "host-fp8" and "do not fit beside" in why[-1]
    # flags override; "none" asks for the dequantised form
    assert choose_forms(tiny, True, True, "none", "fp8", "host", big, PlanOptions())[:3] == (None, "fp8", "host")
    # the CPU's reference path and dummy weights stay dense, as before
    assert choose_forms(tiny, True, False, None, None, "auto")[:3] == (None, None, "device")
    assert choose_forms(tiny, False, True, None, None, "auto", big, PlanOptions())[:2] == (None, None)
    # an unquantised checkpoint (issue 52.5) stays plain; its tables go to host memory as floats when short
    plain = tiny.with_options(quantized=False)
    q, ef, et, _ = choose_forms(plain, True, True, None, None, "auto", small, PlanOptions(max_num_batched_tokens=16))
    assert (q, ef, et) == (None, None, "host")


def test_a_sized_kv_cache_stops_at_two_million_blocks_or_the_longest_need(flash):
    from dsserve.models.memory_plan import KV_BLOCK_TOKENS, MAX_SIZED_KV_BLOCKS

    tiny = plan(preset("tiny"), H200, PlanOptions())
    assert tiny.kv_capped and tiny.kv_tokens == MAX_SIZED_KV_BLOCKS * KV_BLOCK_TOKENS
    dep8 = plan(flash, Machine(8, H200.gpu_memory, H200.host_memory), PlanOptions(1, 8, True))
    assert not dep8.kv_capped  # the release's 76 GiB are 1.4 M blocks: all of it goes to the KV cache


def test_the_engine_refuses_a_model_that_cannot_fit_before_loading_anything(monkeypatch, caplog):
    """EngineCore's first step on a GPU (faked: only mem_get_info is asked) plans and fails fast, naming the fix."""
    import torch

    from dsserve.engine.args import EngineArgs, EngineArgsError
    from dsserve.engine.core import choose_forms

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (139 * gib, 141 * gib))
    with pytest.raises(EngineArgsError, match=r"v41-flash does not fit this GPU: .* by \d+\.\d+ GiB: use more GPUs"):
        choose_forms(EngineArgs(model="v41-flash", dtype="bfloat16"), torch.device("cuda"))
    args = choose_forms(EngineArgs(model="tiny", dtype="bfloat16"), torch.device("cuda"))
    assert (args.quantization, args.expert_format, args.engram_tables) == (None, None, "device")  # dummy weights
    args = choose_forms(EngineArgs(model="tiny-trained", dtype="bfloat16"), torch.device("cuda"))
    assert (args.quantization, args.expert_format, args.engram_tables) == ("fp8", "mxfp4", "device")
    for dtype in ("auto", "half"):  # the default and a vLLM spelling: the plan counts what the GPU will hold
        args = choose_forms(EngineArgs(model="tiny-trained", dtype=dtype), torch.device("cuda"))
        assert (args.quantization, args.expert_format) == ("fp8", "mxfp4")
    args = choose_forms(EngineArgs(model="tiny-trained"), torch.device("cpu"))
    assert (args.quantization, args.expert_format, args.engram_tables) == (None, None, "device")
