"""A tensor- or expert-parallel rank built from a release checkpoint (models.release_loader.load_release with a
layout): each of two gloo ranks reads only its share of the files, by the passes' own rules (tensor_parallel.tp_slice,
ExpertPlacement), and they give the single-process reference forward's logits within 1e-9 (fp64)."""

import pytest
import torch
from tiny import sequences

from dsserve.distributed.groups import ParallelConfigError, new_groups
from dsserve.distributed.layout import ParallelLayout
from dsserve.distributed.tensor_parallel import tp_slice
from dsserve.models.checkpoint import save_checkpoint
from dsserve.models.checkpoint_files import CheckpointFiles
from dsserve.models.checkpoint_layout import model_name_for, model_shapes, release_layout
from dsserve.models.loader import load_model
from dsserve.models.release_loader import load_release, rank_share
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
def _tp2_from_files(rank: int, cfg, path: str, forms: dict) -> dict:
    groups = new_groups(2, 1)
    layout = ParallelLayout(tp_rank=groups.tp_rank, tp_size=2)
    net, report = load_release(cfg, path, layout=layout, dtype=torch.float64, tp_group=groups.tp, **forms)
    packed = net.layers[3].ffn.packed
    return {
        "logits": [net.reference_logits(s) for s in sequences(1, LENGTHS)],
        "draft": _draft(net, sequences(1, LENGTHS)[2]),
        "bytes_read": report.bytes_read,
        "forms": report.forms,
        "heads": net.layers[0].attn.attn_sink.shape[0],
        "w1": tuple((net.layers[0].ffn.experts["w1"] if packed is None else net.layers[0].ffn.packed.w1).shape),
        "expert5": None if packed is None else (packed.w2[5], packed.s2[5]),
    }


def _draft(model, seq: torch.Tensor):
    """A DSpark block after ``seq`` (its MoE split by the pass like the backbone's): (draft ids, confidence,
    logits)."""
    out = model(seq)
    y = int(model.logits(out.hidden[-1:]).argmax())
    state = model.mtp.new_state()
    model.mtp.ingest(out.taps, out.positions, state)
    return model.mtp.propose(y, seq.shape[0] - 1, state, model.embed, model.head)


def _same_draft(got, want) -> None:
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1:], want[1:]):
        assert (a - b).abs().max().item() < 1e-9


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


FORMS = [
    {"quantization": None, "expert_format": None},
    # the GPU's form: stored FP8 linears and this rank's slice of the stored MXFP4 experts, nothing dense
    {"quantization": "fp8", "expert_format": "mxfp4", "keep_dense": False},
]


@pytest.mark.parametrize("forms", FORMS, ids=["dense", "fp8-mxfp4"])
def test_tp2_built_from_files_matches_the_reference_and_reads_only_its_share(workers, saved, forms):
    cfg, path = saved
    out = workers.run(_tp2_from_files, cfg, path, forms)
    ref, ref_report = load_release(cfg, path, dtype=torch.float64, **forms)
    total = sum(s.nbytes for s in release_layout(cfg).values())
    assert ref_report.bytes_read == total
    inter = cfg.moe_intermediate_size // 2
    for rank, o in enumerate(out):
        assert o["heads"] == cfg.num_attention_heads // 2
        packed = forms["expert_format"] == "mxfp4"
        assert o["w1"] == (cfg.n_routed_experts, inter, cfg.hidden_size // (2 if packed else 1))
        assert o["bytes_read"] == _share_bytes(cfg, rank) < total
        assert (o["forms"].get("fp8_linear", 0) > 0) == (forms["quantization"] == "fp8")
        assert o["forms"].get("experts_mxfp4", 0) == (cfg.num_hidden_layers if packed else 0)
    if forms["expert_format"] == "mxfp4":  # the stored bytes: the two ranks' columns of w2 are the file's
        with CheckpointFiles(path) as files:
            name = "layers.3.ffn.experts.5.w2"
            w, s = files.read(f"{name}.weight").view(torch.uint8), files.read(f"{name}.scale").view(torch.uint8)
        assert torch.equal(torch.cat([o["expert5"][0] for o in out], 1), w)
        assert torch.equal(torch.cat([o["expert5"][1] for o in out], 1), s)
    with torch.no_grad():
        for i, s in enumerate(sequences(1, LENGTHS)):
            want = ref.reference_logits(s)
            for o in out:
                err = (o["logits"][i] - want).abs().max().item()
                assert err < 1e-9, (forms, i, err)
            assert torch.equal(out[0]["logits"][i], out[1]["logits"][i])
        want = _draft(ref, sequences(1, LENGTHS)[2])
        for o in out:
            _same_draft(o["draft"], want)


RANK_LENGTHS = ((6, 40, 3), (19, 9, 33))  # DEP: each rank its own sequences, as many forwards on each


@torch.no_grad()
def _ep2_from_files(rank: int, cfg, path: str, forms: dict) -> dict:
    groups = new_groups(1, 2)
    layout = ParallelLayout(ep_rank=groups.dp_rank, ep_size=2)
    net, report = load_release(cfg, path, layout=layout, dtype=torch.float64, ep_group=groups.ep, **forms)
    ffn = net.layers[0].ffn
    return {
        "logits": [net.reference_logits(s) for s in sequences(10 + rank, RANK_LENGTHS[rank])],
        "draft": _draft(net, sequences(10 + rank, RANK_LENGTHS[rank])[1]),  # each rank its own
        "bytes_read": report.bytes_read,
        "kind": type(ffn).__name__,
        "held": (ffn.experts["w1"] if ffn.packed is None else ffn.packed.w1).shape[0],
        "drafter": net.mtp[0].ffn.experts["w1"].shape[0],  # the drafter's experts stay dense
        "received": ffn.dispatcher.rows_received,
    }


@pytest.mark.parametrize("forms", FORMS, ids=["dense", "fp8-mxfp4"])
def test_ep2_built_from_files_matches_the_reference_and_reads_only_its_experts(workers, saved, forms):
    cfg, path = saved
    out = workers.run(_ep2_from_files, cfg, path, forms)
    ref, _ = load_release(cfg, path, dtype=torch.float64, **forms)
    specs = release_layout(cfg)
    for rank, o in enumerate(out):
        assert o["kind"] == "ExpertParallelMoE" and o["held"] == cfg.n_routed_experts // 2 and o["received"] > 0
        assert o["drafter"] == cfg.dspark_n_routed_experts // 2  # the drafter's MoE over its own experts
        want = 0
        for name, spec in specs.items():
            mname, e = model_name_for(spec.owner or name)
            n = cfg.n_routed_experts if mname.startswith("layers.") else cfg.dspark_n_routed_experts
            want += spec.nbytes if e is None or e // (n // 2) == rank else 0
        assert o["bytes_read"] == want
    with torch.no_grad():
        for rank, o in enumerate(out):
            for s, got in zip(sequences(10 + rank, RANK_LENGTHS[rank]), o["logits"], strict=True):
                err = (got - ref.reference_logits(s)).abs().max().item()
                assert err < 1e-9, (forms, rank, err)
            _same_draft(o["draft"], _draft(ref, sequences(10 + rank, RANK_LENGTHS[rank])[1]))


def test_a_share_that_cuts_a_scale_block_is_refused(saved):
    """The pass's checks first (TP 4 of tiny: its 2 output groups do not split 4 ways), then the stored form's: a
    TP slice must cover whole scale blocks (tiny with 128-wide FP8 blocks: wo_b's inputs split at 64)."""
    cfg, path = saved
    with pytest.raises(ParallelConfigError, match="o_groups=2"):
        load_release(cfg, path, layout=ParallelLayout(tp_rank=0, tp_size=4))
    wide = cfg.with_options(weight_block_size=128)
    name = "layers.0.attn.wo_b.weight"
    with pytest.raises(ParallelConfigError, match=r"\[64, 128\) of 'layers.0.attn.wo_b.weight' .* 128-wide fp8"):
        rank_share(name, release_layout(wide)[name], wide, ParallelLayout(tp_rank=1, tp_size=2))
