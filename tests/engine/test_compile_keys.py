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
    core = EngineCore(EngineArgs(model="tiny", load_format="dummy", dtype="bfloat16", device="cpu",
                                 attention_backend="paged", enable_prefix_caching=True, swa_bounded_replay=replay,
                                 max_model_len=1024, kv_cache_memory=8 << 20, max_num_seqs=2,
                                 max_num_batched_tokens=512))
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
