"""V4 in a bf16 model with kernel ops runs the batched paged attention path (its raw bf16 rows read by the kernels,
or on the CPU by their references): its greedy tokens' logprobs are as close to an fp32 oracle on the same weights
as the per-sequence torch path's. bf16 with QAT is noisy here (both paths: median error ~0.04, max ~1 in logprob on
the CPU), so the check is relative; a wrong row read moves the logprobs by far more. (fp64 exactness of the same
path: test_paged_attention.py::test_v4_paged_path_is_exact.)"""

import pytest
import torch
from oracle_logprobs import logprob_errors

import dsserve.layers.attention_paged as AP
from dsserve import LLM
from dsserve.kv.paged_batch import PagedBatch


def _errors(device: str, paged: bool, monkeypatch, graphs: bool = False) -> tuple[list[float], int]:
    calls, real = [], AP.forward_paged
    monkeypatch.setattr(AP, "forward_paged", lambda *a: calls.append(1) or real(*a))
    if not paged:
        monkeypatch.setattr(PagedBatch, "supports", classmethod(lambda cls, seqs, ops: False))
    # the CPU: every op on its torch reference (interpreted kernels would take minutes); a GPU: the Triton kernels
    llm = LLM(
        model="tiny-v4",
        dtype="bfloat16",
        device=device,
        attention_backend="paged",
        seed=0,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
        reference_ops="all" if device == "cpu" else "",
        enforce_eager=not graphs,
    )
    errs = logprob_errors(llm, device)
    if graphs:
        assert llm.engine.runner.decode_graphs.report()["replays"] > 0
    monkeypatch.undo()
    return errs, len(calls)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_v4_paged_path_is_as_close_to_the_oracle_as_the_per_sequence_path(device, monkeypatch):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    fast, calls = _errors(device, True, monkeypatch)
    slow, none = _errors(device, False, monkeypatch)
    assert calls > 0 and none == 0
    med = lambda e: e[len(e) // 2]  # noqa: E731
    assert med(fast) < 1.5 * med(slow) + 0.02 and fast[-1] < 2 * slow[-1] + 0.5, (med(fast), med(slow))
    if device == "cuda":  # decode steps as CUDA graphs (the GPU's default)
        graphed, _ = _errors(device, True, monkeypatch, graphs=True)
        assert med(graphed) < 1.5 * med(slow) + 0.02 and graphed[-1] < 2 * slow[-1] + 0.5, (med(graphed), med(slow))
