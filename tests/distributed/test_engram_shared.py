"""Host Engram tables shared by the processes of one engine group (layers.engram_store; spec parallel 3.4), on the
tiny model (two Engram layers) in fp64 on gloo: under DP2 both ranks map the same pages of each table (the same
shared-memory inode, each rank's proportional share half the table), the greedy tokens and logprobs equal a
single-process engine's, and no shared-memory name outlives the start (sealed once the ranks are ready), a rank
that fails while starting, or a killed rank. A TP2 engine's worker maps rank 0's pages."""

import glob
import os
import signal

import pytest
from engines import PARAMS, prompt, run, same_outputs

from dsserve.distributed.dp_client import DPClient, EngineDeadError
from dsserve.engine.args import EngineArgs
from dsserve.engine.core import EngineCore
from dsserve.layers.engram_hash import engram_rows_per_layer
from dsserve.layers.engram_table import HostMemory
from dsserve.models.presets import preset

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (Linux)")
ARGS = dict(
    model="tiny",
    dtype="float64",
    device="cpu",
    engram_tables="host",
    max_num_seqs=8,
    max_num_batched_tokens=40,
    long_prefill_token_threshold=12,
    block_size=16,
    max_model_len=256,
    seed=0,
)
PAGE = os.sysconf("SC_PAGE_SIZE")
CFG = preset("tiny")
TABLE_BYTES = {f"layers.{i}.engram": n * CFG.engram_head_dim * 8 for i, n in engram_rows_per_layer(CFG).items()}


def our_names() -> list[str]:
    """This process's stores' names under /dev/shm (its pid is in every prefix it owns)."""
    return glob.glob(f"/dev/shm/dsserve-engram-{os.getpid()}-*")


def shared_tables(pid: int) -> dict[str, dict]:
    """The Engram store mappings of ``pid``: table key -> inode, Rss and Pss (kB), from /proc/<pid>/smaps."""
    out, cur = {}, None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):  # a mapping's header
                cur = None
                if len(parts) == 6 and parts[5].startswith("/dev/shm/dsserve-engram-"):
                    key = next(k for k in TABLE_BYTES if f"-{k}." in parts[5])
                    cur = out[key] = {"inode": int(parts[4]), "file": parts[5].strip()}
            elif cur is not None and parts[0] in ("Rss:", "Pss:"):
                cur[parts[0][:-1].lower()] = int(parts[1]) * 1024
    return out


@pytest.fixture(scope="module")
def single():
    return EngineCore(EngineArgs(**ARGS))


@pytest.fixture(scope="module")
def client():
    c = DPClient(EngineArgs(**ARGS, data_parallel_size=2))
    yield c
    c.close()


def test_both_ranks_map_one_copy_of_each_table(client):
    a, b = (shared_tables(pid) for pid in client.pids)
    assert a.keys() == b.keys() == TABLE_BYTES.keys()
    for key, size in TABLE_BYTES.items():
        assert a[key]["inode"] == b[key]["inode"]  # one tmpfs file: the same pages
        assert a[key]["file"].endswith("(deleted)")  # its name already gone: nothing can leak it
        for m in (a[key], b[key]):  # prefaulted: each rank maps all of it, and its proportional share is half
            assert m["rss"] == -(-size // PAGE) * PAGE and abs(m["pss"] - m["rss"] / 2) <= PAGE
    assert our_names() == [] and client.engram_store.sealed


def test_outputs_equal_a_single_process_engine(client, single):
    reqs = {f"r{i}": prompt(i, n) for i, n in enumerate((5, 40, 23, 64, 11, 30))}
    same_outputs(run(client, reqs), run(single, reqs), 1e-9)
    assert all(n > 0 for n in client.router.routed)  # both ranks served
    assert all(isinstance(t.memory, HostMemory) for t in _tables(single))  # an engine of the front end: private


def test_a_killed_rank_leaves_no_name_and_no_mapping(client):
    pids = client.pids
    os.kill(pids[1], signal.SIGKILL)
    client.add_request("late", prompt(0, 8), PARAMS)
    with pytest.raises(EngineDeadError):
        for _ in range(2000):
            client.step()
    client.close()
    assert not any(os.path.exists(f"/proc/{p}/maps") for p in pids) and our_names() == []


def test_a_rank_failing_while_it_starts_leaves_no_name():
    # each rank puts its tables in the store, then fails sizing its KV cache (too small for one sequence)
    with pytest.raises(EngineDeadError, match="DP rank"):
        DPClient(EngineArgs(**{**ARGS, "kv_cache_memory_bytes": 1024}, data_parallel_size=2))
    assert our_names() == []


def test_a_tp_worker_maps_rank0s_tables(single):
    core = EngineCore(EngineArgs(**ARGS, tensor_parallel_size=2))
    try:
        mine = shared_tables(os.getpid())
        (worker,) = core.tp.procs.pids.values()
        theirs = shared_tables(worker)
        assert mine.keys() == theirs.keys() == TABLE_BYTES.keys()
        assert all(mine[k]["inode"] == theirs[k]["inode"] for k in mine) and our_names() == []
        reqs = {f"t{i}": prompt(i, n) for i, n in enumerate((9, 33))}
        same_outputs(run(core, reqs), run(single, reqs), 1e-9)
    finally:
        core.close()
    after = shared_tables(os.getpid())  # the worker is gone: this process holds the pages alone
    assert (
        our_names() == [] and after.keys() == TABLE_BYTES.keys() and all(m["pss"] == m["rss"] for m in after.values())
    )


def _tables(core):
    return [b.engram.table for b in core.model.layers if b.engram is not None]
