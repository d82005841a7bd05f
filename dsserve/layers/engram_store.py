"""One host copy of the Engram tables per node, shared by every process of an engine group (spec parallel 3.4).

The release's host tables are ~200 GB; DP ranks and TP workers are separate processes, and each used to build its
own copy. An ``EngramStore`` is the node's shared copy: the process that spawns the group (the DP front end, or TP
rank 0 of a lone engine) owns it; every process that loads the model puts its tables there by name, and the first
one to need a table fills it while the others wait, then map the same pages read-only.

Design, and why:

* **Files in /dev/shm, created by whoever loads first.** Every rank already builds its model itself (a checkpoint's
  reader, a preset's seeded weights), so a table is made where the load happens, once: ``table(key, nbytes,
  fill)`` takes the store's lock (``flock`` on ``<prefix>.lock``), maps ``<prefix>-<key>`` if it exists, else
  fills ``<key>.part`` and renames it into place (a half-written table never has the final name; a filler that
  dies releases the lock and the next process fills it again). A handover at spawn (``share_memory_()`` storages
  sent to the children) would instead need the front end to load the tables before any rank exists, and TP rank 0
  spawns its workers before it loads anything.
* **Names removed as soon as the group is up.** When every process holds its mapping (the DP ranks reported
  ready; TP: rank 0 passed the KV-sizing collective, which follows every rank's load) the owner ``seal()``\\ s the
  store: it unlinks every name. The pages then live exactly as long as some process maps them, so neither a clean
  exit nor a SIGKILL of every process can leak them. Before that, the names are removed by the owner's ``seal()``
  at close or exit (a rank that dies makes the group fail-stop, whose stop seals), and, if the owner itself is
  killed, by multiprocessing's resource tracker (a separate process that unlinks registered shared-memory names
  once every process of the group has exited; spawned children share their parent's tracker).
* **Prefaulted, read-only where possible.** ``MAP_SHARED | MAP_POPULATE``: every process maps every page at start
  (what pinning does on CUDA anyway), so the RSS and PSS of a rank count the whole table. Without CUDA the mapping
  is ``PROT_READ``: a stray write faults instead of corrupting every rank's table. With CUDA it is registered as
  pinned memory exactly as a private table is (``cudaHostRegister``, flags 0), so ``device_gather`` reads it in
  place as before; that needs a writable mapping (a read-only one needs ``cudaHostRegisterReadOnly``, which not
  every platform supports, and a failed registration leaves a CUDA error for the next launch check to find), so
  the write protection is given up there. Where registration fails anyway, ``pinned`` is False and the rows are
  gathered on the host into the table's pinned staging buffer: the H2D copy stays asynchronous.
* **/dev/shm must hold the tables** (a container's default is 64 MiB: ``docker run --shm-size`` or ``--ipc=host``).
  Its room is taken with ``posix_fallocate`` before the fill, so a short /dev/shm is an error naming it, never a
  SIGBUS mid-fill; the table is then this process's private copy, with a warning. ``DSSERVE_ENGRAM_STORE=private``
  in the environment keeps every copy private (the measurement baseline).

Contract: every process of one store loads the same model with the same arguments, so a key (the table's module
name, layout, dtype and shape) names the same bytes in all of them. A store is never shared between engines: its
prefix holds the owner's pid and a random token, and it reaches the children through the environment only while
they are spawned (``spawning``), so another engine built later in the owner's process keeps its own copy.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import glob
import logging
import mmap
import os
import re
import secrets
import warnings
from typing import Callable

import torch

log = logging.getLogger("dsserve")
ENV = "DSSERVE_ENGRAM_STORE"  # a store's prefix, set for the processes the owner spawns; "private": no sharing
PRIVATE = "private"
SHM_DIR = "/dev/shm"
_KEY = re.compile(r"[^A-Za-z0-9_.-]+")


class StoreFull(OSError):
    """/dev/shm has no room for a table."""


class SharedTable:
    """One table's pages in a store (``tensor``: uint8 [nbytes]; read-only without CUDA); the ``HostMemory``
    interface (``pinned``, ``huge_pages``) plus ``name`` (its file under /dev/shm while the store is not sealed) and
    ``created`` (this process filled it)."""

    def __init__(self, fd: int, nbytes: int, name: str, created: bool, huge_pages: bool, cuda: bool):
        self.name, self.created, self.nbytes = name, created, nbytes
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if cuda else 0)
        self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=prot)
        self.huge_pages, self.huge_pages_reason = _advise_huge_pages(self._map, huge_pages)
        with warnings.catch_warnings():  # torch warns of a read-only buffer: by design, the mapping refuses writes
            warnings.simplefilter("ignore", UserWarning)
            self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.pinned = False
        if cuda:
            err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0)
            self.pinned = int(err) == 0

    def __del__(self):
        if getattr(self, "pinned", False):
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())


def _advise_huge_pages(m: mmap.mmap, wanted: bool) -> tuple[bool, str | None]:
    if not wanted:
        return False, "not requested"
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False, "this OS/Python has no MADV_HUGEPAGE"
    try:  # advice only: shared memory gets huge pages where /sys/kernel/mm/transparent_hugepage/shmem_enabled allows
        m.madvise(mmap.MADV_HUGEPAGE)
        return True, None
    except OSError as e:
        return False, f"madvise(MADV_HUGEPAGE) failed: {e}"


def _track(name: str, on: bool) -> None:
    """Register (or forget) a /dev/shm name with multiprocessing's resource tracker, which unlinks what is still
    registered once every process of the group has exited."""
    from multiprocessing import resource_tracker

    (resource_tracker.register if on else resource_tracker.unregister)("/" + name, "shared_memory")


class EngramStore:
    """The node's shared Engram tables under ``/dev/shm/<prefix>-*`` (module docstring). ``owner``: this process
    created it and removes its names (``seal``)."""

    def __init__(self, prefix: str, owner: bool = False):
        self.prefix, self.owner = prefix, owner
        self.sealed = False
        self.tables: list[SharedTable] = []  # this process's mappings, in the order it took them
        self._warned = False

    # ------------------------------------------------------------------ who holds a store
    @classmethod
    def for_children(cls) -> "EngramStore | None":
        """A new store for the processes this one is about to spawn (pass it to ``spawning``); None where they
        inherit one already (this process is itself a rank of a store), where /dev/shm is missing, or with
        ``DSSERVE_ENGRAM_STORE=private``."""
        if os.environ.get(ENV) or not os.path.isdir(SHM_DIR):
            return None
        store = cls(f"dsserve-engram-{os.getpid()}-{secrets.token_hex(4)}", owner=True)
        _track(store._lock_name, True)
        try:
            os.close(os.open(store._path(store._lock_name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
        except OSError as e:  # e.g. a read-only /dev/shm: every rank keeps its own copy, as before
            _track(store._lock_name, False)
            log.warning("Engram tables: no shared copy for the ranks of this node (%s: %s)", SHM_DIR, e)
            return None
        atexit.register(store.seal)
        return store

    @classmethod
    def inherited(cls) -> "EngramStore | None":
        """The store of the group this process was spawned into (None: none, or ``private``)."""
        prefix = os.environ.get(ENV)
        return cls(prefix) if prefix and prefix != PRIVATE else None

    # ------------------------------------------------------------------ tables
    def table(
        self, key: str, nbytes: int, fill: Callable[[torch.Tensor], None], huge_pages: bool = False
    ) -> SharedTable | None:
        """The shared pages of ``key`` (``nbytes``): mapped if a process of the group made them, else made here by
        ``fill(uint8 tensor [nbytes])`` and published. None (and a warning, once) where they cannot be shared: the
        store is sealed, or /dev/shm has no room; the caller then keeps a private copy."""
        name, cuda = self._name(key), torch.cuda.is_available()
        try:
            lock = os.open(self._path(self._lock_name), os.O_RDWR)
        except FileNotFoundError:
            return self._unshared(key, "the store's names were already removed (its group is up)")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            created = not os.path.exists(self._path(name))
            if created:
                self._fill(name, nbytes, fill, huge_pages)
            fd = os.open(self._path(name), os.O_RDWR if cuda else os.O_RDONLY)
        except StoreFull as e:
            return self._unshared(key, str(e))
        finally:
            os.close(lock)  # releases the lock
        try:
            if os.fstat(fd).st_size != nbytes:
                raise ValueError(
                    f"Engram store {self.prefix}: {key} has {os.fstat(fd).st_size} bytes, expected {nbytes}"
                )
            t = SharedTable(fd, nbytes, name, created, huge_pages, cuda)
        finally:
            os.close(fd)  # the mapping keeps the pages
        self.tables.append(t)
        return t

    def has(self, key: str) -> bool:
        """Whether a process of the group has published ``key`` (and the store is not sealed)."""
        return os.path.exists(self._path(self._name(key)))

    def _name(self, key: str) -> str:
        return f"{self.prefix}-{_KEY.sub('_', key)}"

    def _fill(self, name: str, nbytes: int, fill, huge_pages: bool) -> None:
        part = name + ".part"
        _track(name, True)  # before it exists: a killed owner's tracker then finds it whatever step we died in
        _track(part, True)
        fd = os.open(self._path(part), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            m = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            _advise_huge_pages(m, huge_pages)
            try:  # the room, taken now: a short tmpfs fails here, not with SIGBUS on a write
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                st = os.statvfs(SHM_DIR)
                raise StoreFull(
                    e.errno,
                    f"{SHM_DIR} cannot hold {nbytes / 2**20:.1f} MiB more ({st.f_bavail * st.f_frsize / 2**20:.1f} MiB "
                    "free): give it more room (docker run --shm-size=..., or --ipc=host)",
                ) from None
            fill(torch.frombuffer(m, dtype=torch.uint8))
            del m  # unmapped once fill's views are gone (the read-only mapping is made afresh)
            os.rename(self._path(part), self._path(name))
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(part))
            _track(name, False)
            raise
        finally:
            os.close(fd)
            _track(part, False)

    def _unshared(self, key: str, why: str) -> None:
        if not self._warned:
            log.warning("Engram tables: %s not shared with the other ranks of this node (%s); private copy", key, why)
            self._warned = True
        return None

    # ------------------------------------------------------------------ names
    @property
    def _lock_name(self) -> str:
        return self.prefix + ".lock"

    @staticmethod
    def _path(name: str) -> str:
        return os.path.join(SHM_DIR, name)

    def files(self) -> list[str]:
        """This store's names under /dev/shm (empty once sealed)."""
        return sorted(glob.glob(self._path(self.prefix) + "[-.]*"))

    def seal(self) -> None:
        """The owner's: unlink every name (the lock included); mapped pages stay until their last process unmaps
        them. Idempotent; a store's processes take no new table afterwards (they keep private copies)."""
        if not self.owner or self.sealed:
            return
        self.sealed = True
        for path in self.files():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            _track(os.path.basename(path), False)
        atexit.unregister(self.seal)


@contextlib.contextmanager
def spawning(store: EngramStore | None):
    """Within: processes spawned from here inherit ``store`` (through the environment); None: nothing changes."""
    if store is None:
        yield
        return
    before = os.environ.get(ENV)
    os.environ[ENV] = store.prefix
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before


def host_memory(
    nbytes: int,
    fill: Callable[[torch.Tensor], None],
    store: EngramStore | None = None,
    key: str | None = None,
    huge_pages: bool = False,
):
    """``nbytes`` of host memory holding what ``fill(uint8 tensor [nbytes])`` writes: the store's shared table of
    ``key`` (filled only where no process of the group has filled it), else a private ``HostMemory``, filled."""
    if store is not None and key is not None:
        shared = store.table(key, nbytes, fill, huge_pages)
        if shared is not None:
            return shared
    from .engram_table import allocate_host

    mem = allocate_host(nbytes, huge_pages)
    fill(mem.tensor)
    return mem
