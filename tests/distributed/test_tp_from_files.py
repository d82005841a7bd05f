"""A tensor-parallel rank built from a release checkpoint (models.release_loader.load_release with a TP layout):
each of two gloo ranks reads only its share of the files, by the TP pass's own rule (tensor_parallel.tp_slice), and
together they give the single-process reference forward's logits within 1e-9 (fp64)."""

import pytest
import torch
from tiny import sequences

from dsserve.distributed.groups import ParallelConfigError, new_groups
from dsserve.distributed.layout import ParallelLayout
from dsserve.distributed.tensor_parallel import tp_slice
from dsserve.models.checkpoint import save_checkpoint
from dsserve.models.checkpoint_layout import model_name_for, model_shapes, release_layout
from dsserve.models.loader import load_model
from dsserve.models.release_loader import load_release
from dsserve.models.tokenizer import TINY_DIR

LENGTHS = (5, 17, 40)  # 40 rows: past the 32-row window, compressed entries on every compressed layer


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tiny model written by the project's writer: FP8 dense weights, MXFP4 experts, FP8 Engram tables."""
    src = load_model("tiny", seed=7)
    out = tmp_path_factory.mktemp("tiny-release-tp")
    save_checkpoint(src.model, src.cfg, str(out), tokenizer_dir=TINY_DIR, max_shard_bytes=8 << 20)
    return src.cfg, str(out)


@torch.no_grad()
def _tp2_from_files(rank: int, cfg, path: str, quantization) -> dict:
    groups = new_groups(2, 1)
    layout = ParallelLayout(tp_rank=groups.tp_rank, tp_size=2)
    net, report = load_release(
        cfg, path, layout=layout, dtype=torch.float64, quantization=quantization, group=groups.tp
    )
    return {
        "logits": [net.reference_logits(s) for s in sequences(1, LENGTHS)],
        "bytes_read": report.bytes_read,
        "heads": net.layers[0].attn.attn_sink.shape[0],
        "experts": tuple(net.layers[0].ffn.experts["w1"].shape),
        "fp8_linear": report.forms.get("fp8_linear", 0),
    }


def _share_bytes(cfg, rank: int) -> int:
    """The bytes TP rank `rank` of 2 should read: every release tensor (scales with their weight) whole where the
    pass replicates it, else the fraction tp_slice keeps of its model tensor."""
    shapes, want = model_shapes(cfg), 0
    for name, spec in release_layout(cfg).items():
        mname, _ = model_name_for(spec.owner or name)
        cut = tp_slice(mname, cfg, rank, 2)
        if cut is None:
            want += spec.nbytes
        else:
            dim, lo, hi = cut
            assert spec.nbytes * (hi - lo) % shapes[mname][0][dim] == 0, name
            want += spec.nbytes * (hi - lo) // shapes[mname][0][dim]
    return want


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_tp2_built_from_files_matches_the_reference_and_reads_only_its_share(workers, saved, quantization):
    cfg, path = saved
    out = workers.run(_tp2_from_files, cfg, path, quantization)
    ref, ref_report = load_release(cfg, path, dtype=torch.float64, quantization=quantization)
    total = sum(s.nbytes for s in release_layout(cfg).values())
    assert ref_report.bytes_read == total
    for rank, o in enumerate(out):
        assert o["heads"] == cfg.num_attention_heads // 2
        assert o["experts"] == (cfg.n_routed_experts, cfg.moe_intermediate_size // 2, cfg.hidden_size)
        assert o["bytes_read"] == _share_bytes(cfg, rank) < total
        assert (o["fp8_linear"] > 0) == (quantization == "fp8")
    with torch.no_grad():
        for i, s in enumerate(sequences(1, LENGTHS)):
            want = ref.reference_logits(s)
            for o in out:
                err = (o["logits"][i] - want).abs().max().item()
                assert err < 1e-9, (quantization, i, err)
            assert torch.equal(out[0]["logits"][i], out[1]["logits"][i])


def test_what_a_tp_rank_from_files_does_not_support_yet_is_refused(saved):
    cfg, path = saved
    with pytest.raises(ParallelConfigError, match="expert_format 'mxfp4' under tensor parallelism"):
        load_release(cfg, path, layout=ParallelLayout(tp_rank=0, tp_size=2), expert_format="mxfp4")
    with pytest.raises(ParallelConfigError, match="both tensor and expert parallelism"):
        load_release(cfg, path, layout=ParallelLayout(tp_size=2, ep_size=2))
