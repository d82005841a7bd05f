"""The node's shared Engram tables (layers.engram_store): one table filled once and mapped by every process of the
group, read-only, equal to a private copy; its names gone after seal, on a fill that fails, on a short /dev/shm,
and when the owner is killed (multiprocessing's resource tracker). The DP engine over it: tests/distributed/
test_engram_shared.py."""

import errno
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from dsserve.layers import engram_store
from dsserve.layers.engram_store import ENV, EngramStore, SharedTable, host_memory, spawning
from dsserve.layers.engram_table import EngramTable, HostMemory

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (Linux)")


def mapped_inodes(pid: int | str = "self") -> dict[str, int]:
    """/dev/shm path -> inode of every shared-memory file ``pid`` maps (names removed since: ' (deleted)')."""
    out = {}
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                out[parts[5].strip()] = int(parts[4])
    return out


@pytest.fixture
def store():
    s = EngramStore.for_children()
    yield s
    s.seal()


def test_the_first_fills_the_others_map_the_same_pages(store):
    calls = []

    def fill(buf):
        calls.append(1)
        buf.copy_(torch.arange(buf.numel()) % 251)

    peer = EngramStore(store.prefix)  # a rank of the group: no owner rights
    a = store.table("layers.1.engram", 4096 * 3, fill)
    b = peer.table("layers.1.engram", 4096 * 3, fill)
    assert calls == [1] and a.created and not b.created and a.name == b.name
    assert torch.equal(a.tensor, b.tensor) and int(b.tensor[300]) == 300 % 251
    assert a.tensor.data_ptr() != b.tensor.data_ptr()  # two mappings ...
    inodes = mapped_inodes()
    assert inodes["/dev/shm/" + a.name] == os.stat("/dev/shm/" + a.name).st_ino  # ... of one file
    assert store.files() == sorted(f"/dev/shm/{n}" for n in (a.name, store.prefix + ".lock"))
    store.seal()
    assert store.files() == [] and not peer.files()
    assert int(b.tensor[300]) == 300 % 251  # the pages outlive their name
    assert any(p.endswith(" (deleted)") for p in mapped_inodes())
    assert peer.table("layers.4.engram", 64, fill) is None and calls == [1]  # sealed: the caller keeps its own


@pytest.mark.parametrize("fmt", ["float", "bf16", "fp8"])
def test_a_shared_table_gathers_as_a_private_one(store, fmt):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 64, generator=g, dtype=torch.float64) * 0.1
    rows = torch.randint(0, 300, (7, 5), generator=g)
    private = EngramTable.from_weight(w, fmt)
    shared = EngramTable.from_weight(w, fmt, store=store, key="layers.1.engram")
    again = EngramTable.from_weight(torch.zeros_like(w), fmt, store=EngramStore(store.prefix), key="layers.1.engram")
    assert isinstance(private.memory, HostMemory) and isinstance(shared.memory, SharedTable)
    assert shared.memory.created and not again.memory.created  # mapped: the zeros were never converted
    for t in (shared, again):
        assert torch.equal(t.gather(rows, "cpu", torch.float64), private.gather(rows, "cpu", torch.float64))


def test_host_memory_without_a_store_or_key_is_private(store):
    mem = host_memory(64, lambda b: b.fill_(7), store, None)
    assert isinstance(mem, HostMemory) and int(mem.tensor.sum()) == 7 * 64 and store.files()[-1].endswith(".lock")


def test_a_fill_that_fails_leaves_no_name_and_the_next_process_fills(store):
    def broken(buf):
        raise RuntimeError("read error")

    with pytest.raises(RuntimeError, match="read error"):
        store.table("layers.1.engram", 4096, broken)
    assert [os.path.basename(p) for p in store.files()] == [store.prefix + ".lock"]
    t = EngramStore(store.prefix).table("layers.1.engram", 4096, lambda b: b.fill_(1))
    assert t.created and int(t.tensor.sum()) == 4096


def test_a_short_dev_shm_keeps_a_private_copy_with_a_warning(store, monkeypatch, caplog):
    def full(fd, offset, n):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(engram_store.os, "posix_fallocate", full)
    w = torch.ones(16, 32, dtype=torch.float64)
    t = EngramTable.from_weight(w, "float", store=store, key="layers.1.engram")
    assert isinstance(t.memory, HostMemory) and torch.equal(t.data, w)
    assert [os.path.basename(p) for p in store.files()] == [store.prefix + ".lock"]
    assert "not shared" in caplog.text and "--shm-size" in caplog.text


def test_spawning_exports_the_store_only_while_spawning(store, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    with spawning(store):
        assert os.environ[ENV] == store.prefix and EngramStore.inherited().prefix == store.prefix
        assert EngramStore.for_children() is None  # a rank passes its group's store on; it owns none
    assert ENV not in os.environ and EngramStore.inherited() is None
    monkeypatch.setenv(ENV, "private")
    assert EngramStore.inherited() is None and EngramStore.for_children() is None


OWNER = """
import multiprocessing as mp, os, sys, time
from dsserve.layers.engram_store import EngramStore, spawning

def rank(prefix):
    EngramStore(prefix).table("layers.4.engram", 1 << 16, lambda b: b.fill_(4))
    print("rank", flush=True)
    while os.getppid() != 1 and os.path.exists(f"/proc/{os.getppid()}"):
        time.sleep(0.05)

if __name__ == "__main__":
    s = EngramStore.for_children()
    s.table("layers.1.engram", 1 << 16, lambda b: b.fill_(1))
    with spawning(s):
        p = mp.get_context("spawn").Process(target=rank, args=(s.prefix,), daemon=True)
        p.start()
    while len(s.files()) < 3:
        time.sleep(0.05)
    print(s.prefix, p.pid, flush=True)
    time.sleep(600)
"""


def test_a_killed_owner_leaves_no_name(tmp_path):
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    err = open(tmp_path / "stderr", "w")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        line = proc.stdout.readline().split()
        while line == ["rank"]:
            line = proc.stdout.readline().split()
        prefix, child = line[0], int(line[1])
        assert len(EngramStore(prefix).files()) == 3  # the lock and two tables, one by each process
        os.kill(proc.pid, signal.SIGKILL)  # no seal, no atexit: the child follows, the tracker unlinks
        deadline = time.monotonic() + 30
        while EngramStore(prefix).files() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert EngramStore(prefix).files() == []
        assert "leaked shared_memory objects" in (tmp_path / "stderr").read_text()  # the tracker's unlinking

        def child_alive() -> bool:  # gone, or a zombie (no one reaps it here), once it saw its parent die
            try:
                with open(f"/proc/{child}/stat") as f:
                    return f.read().split()[2] != "Z"
            except FileNotFoundError:
                return False

        # the tracker may unlink before the child's next look at its parent (every 50 ms): wait for it, bounded
        while child_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not child_alive()
    finally:
        proc.kill()
        proc.wait()
        err.close()
