"""The launches' compile keys (kernels.launch_census, the interpreter): what a GPU would compile, found on the CPU.

A key first met while serving stalls that step for Triton's compile (0.5-5 s on the H200). A live replay-off server
compiled the entry-rows gather once per new context (its table width was a constexpr), 70 times in two minutes
(benchmarks/results/agentx-replay-off-compiles-h200); the census sees the same on the tiny model."""

import pytest
import torch

from dsserve.engine.args import EngineArgs
from dsserve.engine.core import EngineCore
from dsserve.engine.sampling_params import SamplingParams
from dsserve.kernels.entry_rows import entry_rows
from dsserve.kernels.launch_census import CensusOps, LaunchCensus

pytest.importorskip("triton.runtime.interpreter")
pytestmark = pytest.mark.interpreter  # the census runs the kernels on CPU tensors


def test_keys_follow_tritons_specialisation():
    """Ints specialise as 1 / a multiple of 16 / neither, unless do_not_specialize; constexprs by value."""
    census = LaunchCensus()
    tables, seq = torch.zeros(2, 9, dtype=torch.int32), torch.zeros(40, dtype=torch.int32)

    def call(t, k):
        with census.recording():
            entry_rows(torch.zeros(t, k, dtype=torch.long), torch.ones(t, k, dtype=torch.bool), tables, seq[:t], 4)

    call(17, 300)
    before = census.snapshot()
    call(5, 301)  # t is not specialised; K neither a multiple of 16 nor 1, as 300 was
    call(32, 299)
    assert census.new_since(before) == {} and census.launches == 3
    call(5, 304)  # K a multiple of 16: its own kernel
    call(5, 600)  # BLOCK_K 1024: another
    assert census.new_since(before) == {"_entry_rows_kernel": 2}
    assert census.errors == []


@pytest.mark.parametrize("replay", [False, True])
def test_a_hit_at_a_new_context_needs_no_new_kernel(replay):
    """Two prefix hits of the same new rows (20 tokens after whole cached blocks), the second at a context whose
    block tables are wider than any step's before, in the same power-of-two range of entries: the second needs no
    compile key the first and the cold prompts did not. Replay off runs these steps eagerly on the GPU too; with
    replay the encoder rows are eager past the row graphs."""
    core = EngineCore(
        EngineArgs(
            model="tiny",
            load_format="dummy",
            dtype="bfloat16",
            device="cpu",
            attention_backend="paged",
            enable_prefix_caching=True,
            swa_bounded_replay=replay,
            max_model_len=1024,
            kv_cache_memory=8 << 20,
            max_num_seqs=2,
            max_num_batched_tokens=512,
        )
    )
    census = LaunchCensus()
    core.model.kernel_ops = CensusOps(census=census)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    block = core.kv.layout.block_size

    def run(name, prompt):
        core.add_request(name, prompt, params)
        while core.has_unfinished_requests():
            core.step()

    def prompt(n):
        return torch.randint(0, 8000, (n,), generator=g).tolist()

    first, second = prompt(5 * block), prompt(7 * block)  # 320 and 448 tokens: 340 and 468 after the hits
    run("cold-1", first)
    run("hit-1", first + prompt(20))
    run("cold-2", second)
    before = census.snapshot()
    run("hit-2", second + prompt(20))
    assert core.stats.prefix_hit_tokens == 5 * block + 7 * block  # both hits found their whole blocks
    assert census.errors == [] and census.launches > 1000
    assert census.new_since(before) == {}


def test_counts_that_change_every_step_do_not_split_kernels():
    """The scores' row stride of the row top-k, the index scores' n_max (the longest row's entry count) and the row
    counts of the SwiGLU, Engram and window-rows kernels change every step: an odd one must not compile a kernel of
    its own (on a bare H200 such pairs were 22 of 216 kernels, and an odd n_max compiled the index scores and the
    top-k in live traffic: benchmarks/results/agentx-shared-outputs-h200)."""
    from dsserve.kernels import indexer as ix
    from dsserve.kernels.engram_gather import engram_gather
    from dsserve.kernels.engram_rows import engram_rows
    from dsserve.kernels.row_topk import row_topk
    from dsserve.kernels.swiglu import swiglu
    from dsserve.kernels.window_rows import window_rows

    g = torch.Generator().manual_seed(0)
    pool = ix._row_format("fp4", 128).pack(torch.randn(64, 128, generator=g))
    table = torch.arange(8, dtype=torch.int32).view(1, 8)  # one sequence: 8 blocks of 8 entries

    def launches(n):
        t = 5 if n % 2 else 4  # row counts off 16 and not
        q, w = torch.randn(t, 32, 128, generator=g), torch.randn(t, 32, generator=g)
        nv = torch.full((t,), n - 3, dtype=torch.int32)
        ix.index_scores(q, w, pool, "fp4", table, torch.zeros(t, dtype=torch.long), 8, nv, n)
        row_topk(torch.randn(t, n, generator=g), 8)
        swiglu(torch.randn(n, 64, generator=g).bfloat16(), 7.0)
        window_rows(
            torch.arange(16),
            torch.zeros(n, 16, dtype=torch.long),
            torch.ones(n, 16, dtype=torch.long),
            torch.zeros(n, 16, dtype=torch.int32),
        )
        engram_gather(torch.randn(9, 32, generator=g), torch.zeros(n, dtype=torch.long), "float", 32, torch.float32)
        primes = torch.full((2, 4), 7, dtype=torch.long)
        engram_rows(torch.zeros(n, 3, dtype=torch.long), torch.ones(3, dtype=torch.long), primes, primes * 0, 0)

    census = LaunchCensus()
    with census.recording():
        launches(48)
    before = census.snapshot()
    with census.recording():
        for n in (50, 51, 33, 64):
            launches(n)
    assert census.new_since(before) == {} and census.errors == []
