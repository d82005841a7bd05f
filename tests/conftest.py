import os

import pytest
import torch
from hypothesis import settings

# Tests are deterministic: every @given draws the same examples on every run (a test's own @settings keeps its
# max_examples and inherits this), and no example database, so a run depends on the code alone, not on .hypothesis/.
settings.register_profile("dsserve", derandomize=True, database=None)
settings.load_profile("dsserve")

# Without a GPU the Triton kernels run in Triton's CPU interpreter; it is chosen when a kernel is decorated,
# so this must be set before any dsserve.kernels module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Two cores in CI: one intra-op thread avoids oversubscription when pytest and torch both want them.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_models():
    """Seeded random tiny models in fp64 (QAT on), built once per session: {"tiny": model, "tiny-v4": model}."""
    from dsserve.models.checkpoint import dummy_weights
    from dsserve.models.model import DeepseekForCausalLM
    from dsserve.models.presets import preset

    out = {}
    for name in ("tiny", "tiny-v4"):
        cfg = preset(name)
        m = DeepseekForCausalLM(cfg).eval()
        dummy_weights(m, cfg, seed=0)
        out[name] = m.double()
    return out


def pytest_configure(config):
    config.addinivalue_line("markers", "interpreter: runs Triton kernels on CPU tensors (skipped where CUDA compiles)")


def pytest_collection_modifyitems(config, items):
    """On a GPU machine the kernels compile for CUDA, so the interpreter tests (CPU tensors) cannot run there;
    the GPU tests beside them cover the same kernels."""
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return
    skip = pytest.mark.skip(reason="a CPU-interpreter kernel test; this machine compiles kernels for CUDA")
    # A lent GPU's minutes are few: DSSERVE_TESTS_GPU_ONLY=1 runs only the tests that need CUDA (CI runs the rest).
    gpu_only = os.environ.get("DSSERVE_TESTS_GPU_ONLY") == "1"
    cpu_test = pytest.mark.skip(reason="DSSERVE_TESTS_GPU_ONLY=1: a test that runs on the CPU")
    for item in items:
        gpu = any(m.name == "skipif" and "CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers())
        gpu = gpu or "cuda" in item.name  # a test parametrised by device: its "cuda" case
        if gpu_only and not (gpu or "gpu" in item.name):
            item.add_marker(cpu_test)
            continue
        interpreted = (
            "tests/kernels/" in item.nodeid or "interpreted" in item.name or item.get_closest_marker("interpreter")
        )
        if not gpu and interpreted:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seeded_torch():
    """Every test starts from torch's seed 0 (the CPU's and CUDA's generators), so a test that draws from the global
    generator sees the same numbers whatever ran before it in its process (xdist's order, a GPU run's subset)."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _gpu_kv_cache_share(monkeypatch):
    """Test processes share one GPU (xdist workers): an engine built without a KV size gets 2 GiB of KV cache, not
    --gpu-memory-utilization's share of the whole card, which the first worker would take from the others. The
    sizing itself is tested with faked memory (tests/models/test_memory_plan.py) and on the H200 by
    benchmarks/gpu_start_h200.py."""
    if not torch.cuda.is_available():
        return
    from dsserve.engine import core

    sized = core.kv_cache_budget

    def budget(args, device=torch.device("cpu"), cfg=None, graphs=False):
        explicit = args.kv_cache_memory_bytes or args.kv_cache_memory or args.kv_cache_memory_fraction
        if device.type == "cuda" and not explicit:
            return 2 << 30
        return sized(args, device, cfg, graphs)

    monkeypatch.setattr(core, "kv_cache_budget", budget)
