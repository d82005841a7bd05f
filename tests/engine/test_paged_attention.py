"""The batched paged attention path (the one the kernels plug into) against the per-sequence reference path.

With every op on its torch reference the path is exact in fp64. With the Triton kernels (the interpreter on
the CPU, compiled on a GPU) the greedy tokens equal the reference forward's on the same device.
"""
import pytest
import torch

from dsserve.engine.greedy import greedy_generate
from dsserve.kernels.ops import OPS, KernelOps
from dsserve.models.checkpoint import dummy_weights
from dsserve.models.model import DeepseekForCausalLM
from dsserve.models.presets import preset
from test_paged_engine import make_prompts, run_engine

import test_paged_engine


def _tiny(dtype, device="cpu"):
    cfg = preset("tiny")
    m = DeepseekForCausalLM(cfg).eval()
    dummy_weights(m, cfg, seed=0)
    return m.to(dtype).to(device)


def _engine(model, prompts, chunk, ops, dtype, device, max_new, **kw):
    model.kernel_ops = ops
    old = test_paged_engine.N_REQ, test_paged_engine.MAX_NEW
    test_paged_engine.N_REQ, test_paged_engine.MAX_NEW = len(prompts), max_new
    try:
        return run_engine(model, prompts, chunk, dtype=dtype, device=device, **kw)
    finally:
        model.kernel_ops = None
        test_paged_engine.N_REQ, test_paged_engine.MAX_NEW = old


@pytest.mark.parametrize("chunk", [7, 0])
def test_paged_path_with_reference_ops_is_exact(tiny_models, chunk):
    """Ragged batches of prefill chunks (some longer than the window) and decodes, fp64: the paged path with
    torch references equals the oracle, including the window ring, top-k, candidate pool and reuse."""
    m = tiny_models["tiny"]
    prompts = [make_prompts(m.cfg, seed=1)[i] for i in (2, 5, 11, 13)]
    conts = [greedy_generate(m, p, 5, bounded_replay=False) for p in prompts]
    with torch.no_grad():
        ref = [m.reference_logits(torch.tensor(p + c[:-1]))[len(p) - 1:] for p, c in zip(prompts, conts)]
    reqs, _, logits = _engine(m, prompts, chunk, KernelOps(frozenset(OPS)), torch.float64, "cpu", 5)
    assert [r.output_token_ids for r in reqs] == conts
    assert max(float((g - r).abs().max()) for g, r in zip(logits, ref)) < 1e-9


def test_paged_path_exact_mode_prefix_window_in_blocks(tiny_models):
    """Exact-mode prefix caching keeps window rows in the blocks: the paged path reads them there."""
    m = tiny_models["tiny"]
    prompts = [make_prompts(m.cfg, seed=2)[i] for i in (4, 11)]
    conts = [greedy_generate(m, p, 4, bounded_replay=False) for p in prompts]
    reqs, _, _ = _engine(m, prompts, 16, KernelOps(frozenset(OPS)), torch.float64, "cpu", 4, window_in_blocks=True)
    assert [r.output_token_ids for r in reqs] == conts


def _kernels_vs_reference(device, prompt_ids, max_new, chunk=0):
    m = _tiny(torch.float32, device)
    prompts = [make_prompts(m.cfg, seed=3)[i] for i in prompt_ids]
    conts = [greedy_generate(m, p, max_new, bounded_replay=False) for p in prompts]
    reqs, _, _ = _engine(m, prompts, chunk, KernelOps(), torch.float32, device, max_new)
    return [r.output_token_ids for r in reqs], conts


def test_paged_path_with_triton_kernels_interpreted():
    """One 40-token prompt (past the 32-row window, 20 ratio-2 entries > top-16) and two decodes: the
    interpreter runs a program at a time, so this is kept small."""
    got, expected = _kernels_vs_reference("cpu", [14], 3)
    assert got == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("chunk", [0, 7])
def test_paged_path_with_triton_kernels_on_gpu(chunk):
    got, expected = _kernels_vs_reference("cuda", range(16), 10, chunk)
    assert got == expected
