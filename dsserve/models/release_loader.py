"""Load a checkpoint as stored: each tensor goes from its file straight into the form its kernel reads.

``load_release`` checks every header against ``release_layout(cfg)`` first (missing, extra, mis-shaped,
mis-typed, truncated: one error naming the tensors, before any model memory is taken), builds the model on the
meta device (nothing allocated), then streams the checkpoint tensor by tensor (one MoE layer's experts at a
time), so the host holds at most about one tensor beyond what the model keeps there:

* FP8 dense weights: with ``quantization="fp8"`` the stored e4m3 bytes and ue8m0 scales become the
  ``Fp8Linear`` of that projection (the projections ``quantize.quantize_dense_fp8`` converts); otherwise they are
  dequantised into the ``nn.Linear``.
* MXFP4 routed experts: with ``expert_format="mxfp4"`` the packed nibbles and scales of the experts this rank
  owns are copied into the layer's ``ExpertWeights``; ``fp8`` re-packs them expert by expert; None dequantises.
  ``keep_dense`` (the CPU's reference path, for tiny models) also keeps the dense experts, as today's CPU path.
* FP8 Engram tables: ``engram_tables="host-fp8"`` copies them row chunk by row chunk into a host
  ``EngramTable`` (pinned when CUDA exists) in the stored bytes; ``host-mmap`` maps the file's own tensors (no
  copy; pages read on first use and shared through the page cache); ``host`` decodes into a host table of the
  model dtype; ``device`` decodes into ``embed.weight``.
* Plain tensors are cast to the model dtype (int32 stays) on the target device.

The result equals today's path (``checkpoint.load_checkpoint`` into a dense model, then ``quantize_experts``,
``move_table_to_host`` and ``quantize_dense_fp8``) bit for bit in every value (tests/models/test_release_loader.py);
the quantised bytes are the file's, where today's re-quantisation picks the next smaller scale for a block whose
largest value rounded to half the grid's top (same values, other bytes).

A ``ParallelLayout`` selects this rank's share by the parallel passes' own rules (``rank_share``: the routed
experts ``ExpertPlacement.contiguous`` gives an EP rank, ``tensor_parallel.tp_slice`` of each tensor), read
with ranged reads; ``read_rank_tensors`` yields them in stored form. With tp_size > 1 the meta model goes through
``shard_tensor_parallel`` before it is filled, so the result is the TP rank the pass would have cut from the whole
model (its ``RowParallelLinear`` ``wo_b`` stays dequantised under ``quantization="fp8"``); routed experts are
read as this rank's intermediate slice of the stored form (MXFP4: rows of ``w1``/``w3``, byte columns of ``w2``
with their scale columns), which the pass itself, taking plain weights, cannot cut from a packed model. With
ep_size > 1 the meta model goes through ``shard_expert_parallel`` first: each backbone MoE becomes the pass's
``ExpertParallelMoE`` holding this rank's experts (the DSpark drafter's MoE too, over its own experts); with
``layout.redundant`` (EPLB) over the physical slots of EPLB's initial placement, as ``Eplb.shard`` places them, each
slot's expert read from the files (a replica is read once per slot holding it). A rank of both runs the EP pass,
then the TP pass (their order), its experts then cut by TP.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.expert_parallel import shard_expert_parallel
from ..distributed.groups import ParallelConfigError
from ..distributed.layout import ParallelLayout
from ..distributed.tensor_parallel import shard_tensor_parallel
from ..kernels.fp8_linear import Fp8Linear
from ..kernels.grouped_moe import ExpertWeights
from ..layers.engram_store import host_memory
from ..layers.engram_table import EngramTable
from ..layers.quant import MX_BLOCK, dequant_engram, dequant_fp8_block, dequant_mxfp4, quant_engram
from .checkpoint_files import CheckpointError, CheckpointFiles
from .checkpoint_layout import IGNORED_PREFIXES, TensorSpec, dtype_accepted, model_name_for, release_layout, scale_name
from .config import ModelConfig
from .quantize import EXPERT_FORMATS, QUANTIZATIONS, fuse_gate_up

ENGRAM_TABLES = ("device", "host", "host-fp8", "host-mmap")
ROW_CHUNK_ELEMS = 1 << 24  # Engram tables stream in chunks of about this many values
MAX_REPORTED = 8

# The dense projections quantize_dense_fp8 converts (backbone layers only; wo_a when its groups fit the blocks).
_FP8_LINEAR = re.compile(
    r"^layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123]|engram\.wkv)"
    r"\.weight$"
)
_EXPERT = re.compile(r"^(.*\.ffn)\.experts\.(\d+)\.(w[123])\.weight$")


def _fail(what: str, problems: list[str]) -> None:
    if problems:
        more = f"\n  ... and {len(problems) - MAX_REPORTED} more" if len(problems) > MAX_REPORTED else ""
        raise CheckpointError(f"{what}: {len(problems)} problem(s):\n  " + "\n  ".join(problems[:MAX_REPORTED]) + more)


def check_files(cfg: ModelConfig, files: CheckpointFiles) -> None:
    """Every header against release_layout(cfg): raises CheckpointError listing mis-shaped, mis-typed, unexpected,
    missing and truncated tensors (each named), with a hint when plain weights meet a quantised config."""
    layout = release_layout(cfg)
    ignored = IGNORED_PREFIXES.get(cfg.family, ())
    wrong, plain = [], 0
    for name, spec in layout.items():  # in the layout's (file) order
        t = files.tensors.get(name)
        if t is not None and (t.shape != spec.shape or not dtype_accepted(spec, t.dtype, cfg)):
            wrong.append(f"tensor {name!r}: expected {list(spec.shape)} {spec.dtype}, found {list(t.shape)} {t.dtype}")
            plain += spec.quant in ("fp8", "mxfp4", "engram_fp8") and t.dtype in ("BF16", "F32", "F16")
    extra = [
        f"unexpected tensor {name!r}: expected none (not in the {cfg.name} layout), found {list(t.shape)} {t.dtype}"
        for name, t in files.tensors.items()
        if name not in layout and not name.startswith(ignored)
    ]
    missing = [
        f"missing tensor {n!r}: expected {list(s.shape)} {s.dtype}, found none"
        for n, s in layout.items()
        if n not in files.tensors
    ]
    hint = (
        " (the files hold plain weights where config.json's quantization_config says FP8/MXFP4: drop "
        "quantization_config from config.json to load them as they are)"
        if plain
        else ""
    )
    _fail(
        f"checkpoint {files.path} does not match config {cfg.name!r} ({len(wrong)} mis-shaped/mis-typed, "
        f"{len(extra)} unexpected, {len(missing)} missing, {len(files.problems)} unreadable){hint}",
        files.problems + wrong + extra + missing,
    )


# ------------------------------------------------------------------------------------------------ rank shares
def rank_share(name: str, spec: TensorSpec, cfg: ModelConfig, layout: ParallelLayout) -> tuple | None:
    """What of release tensor `name` (a weight, not a scale) this rank reads: None (nothing: another rank's
    expert), () (all of it), or (dim, lo, hi) along dim 0 or 1 of the stored tensor (MXFP4 columns are bytes).

    The rule is the parallel passes' (``ParallelLayout.experts``, ``ParallelLayout.tp_slice``), applied to the
    release tensor's model name; a share must cover whole scale blocks of its stored form."""
    mname, expert = model_name_for(name)
    if expert is not None and expert not in _expert_ids(cfg, layout, name):
        return None
    cut = layout.tp_slice(mname, cfg) if layout.tp_size > 1 else None
    if cut is None:
        return ()
    dim, lo, hi = cut
    dim -= expert is not None  # the model stacks the experts [E, ...]; the release stores each one
    block = cfg.weight_block_size if spec.quant == "fp8" else MX_BLOCK if spec.quant == "mxfp4" and dim == 1 else 1
    if lo % block or hi % block:
        raise ParallelConfigError(
            f"tensor parallel size {layout.tp_size}: rank {layout.tp_rank}'s share [{lo}, {hi}) of {name!r} "
            f"(dim {dim}) does not cover whole {block}-wide {spec.quant} scale blocks"
        )
    if spec.quant == "mxfp4" and dim == 1:  # two values a byte
        lo, hi = lo // 2, hi // 2
    return (dim, lo, hi)


def _expert_ids(cfg: ModelConfig, layout: ParallelLayout, name: str) -> Sequence[int]:
    """The routed experts of the MoE `name` lies in (a backbone layer's, or a DSpark stage's: its own count) that
    this rank holds."""
    draft = not name.startswith("layers.")
    n = cfg.dspark_n_routed_experts if draft else cfg.n_routed_experts
    return layout.experts(n, draft) if layout.ep_size > 1 else range(n)


def _scale_share(share: tuple, spec: TensorSpec, block: int) -> tuple:
    """The scale's share for a weight's share: FP8 blocks of `block` on both dims; MXFP4/Engram scales [n, k/32]."""
    if not share:
        return share
    dim, lo, hi = share
    if spec.quant == "fp8":
        return (dim, lo // block, hi // block)
    div = 1 if dim == 0 else MX_BLOCK // 2  # MXFP4 columns were given in packed bytes (2 values each)
    return (dim, lo // div, hi // div)


class _Source:
    """Reads one weight (and its scale) as this rank's share; from the read-ahead when one runs."""

    def __init__(
        self, cfg: ModelConfig, files: CheckpointFiles, layout: ParallelLayout, dtype=torch.float32, engram_store=None
    ):
        self.cfg, self.files, self.layout = cfg, files, layout
        self.specs = release_layout(cfg)
        self.ahead: _ReadAhead | None = None
        self.dtype, self.engram_store = dtype, engram_store
        self.skip: set[str] = set()  # Engram tables another rank of this node has read: not read ahead here

    def engram_key(self, name: str, where: str) -> str:
        """The node store's key of the host Engram table ``name`` in the form ``where`` (host | host-fp8)."""
        rows, dim = self.specs[name].shape
        form = "fp8" if where == "host-fp8" else str(self.dtype).removeprefix("torch.")
        return f"{name.removesuffix('.embed.weight')}.{form}.{rows}x{dim}"

    def shared(self, name: str, where: str) -> bool:
        """Whether another rank of this node has published this table already (then none of it is read here)."""
        return (
            name in self.skip
            or where in ("host", "host-fp8")
            and self.engram_store is not None
            and self.engram_store.has(self.engram_key(name, where))
        )

    def share(self, name: str) -> tuple | None:
        return rank_share(name, self.specs[name], self.cfg, self.layout)

    def read(self, name: str, share: tuple = ()) -> torch.Tensor:
        if self.ahead is not None:
            t = self.ahead.take((name, share))
            if t is not None:
                return t
        return self.files.read(name, *((share[0], share[1:]) if share else ()))

    def read_scale(self, name: str, share: tuple = ()) -> torch.Tensor:
        s = _scale_share(share, self.specs[name], self.cfg.weight_block_size)
        return self.read(scale_name(name), s)


class _ReadAhead:
    """Reads the next tensors of a known order on `threads` threads (pread releases the GIL, and shards live in
    separate files), holding at most `max_bytes` read but not yet taken (always at least one)."""

    def __init__(self, files: CheckpointFiles, order, threads: int, max_bytes: int = 16 << 20):
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        self.files, self.order, self.max_bytes = files, iter(order), max_bytes
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="dsserve-load")
        self.queue, self.held = deque(), 0
        self._fill()

    def _fill(self) -> None:
        while not self.queue or self.held < self.max_bytes:
            key = next(self.order, None)
            if key is None:
                return
            name, share = key
            args = (share[0], share[1:]) if share else (None, None)
            out = self.files.buffer(name, *args)  # allocated here, in the consuming thread
            self.queue.append((key, out.numel(), self.pool.submit(self.files.read, name, *args, out)))
            self.held += self.queue[-1][1]

    def take(self, key) -> torch.Tensor | None:
        """The tensor of `key` if it is next in the order (None otherwise: the caller reads it itself)."""
        if not self.queue or self.queue[0][0] != key:
            return None
        _, size, fut = self.queue.popleft()
        self.held -= size
        self._fill()
        return fut.result()

    def drop(self, names: set[str]) -> None:
        """Forget the queued reads of ``names`` (tensors not needed after all)."""
        kept = []
        for item in self.queue:
            if item[0][0] in names:
                item[2].cancel()
                self.held -= item[1]
            else:
                kept.append(item)
        self.queue.clear()
        self.queue.extend(kept)
        self._fill()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _load_order(src: _Source, engram_tables: str = "device"):
    """(name, share) of every read load_release makes, in its order (what the read-ahead runs ahead on)."""
    done = set()
    for name, spec in src.specs.items():
        if spec.quant == "scale":
            continue
        m = _EXPERT.match(name)
        if m:
            if m.group(1) in done:
                continue
            done.add(m.group(1))
            ids = _expert_ids(src.cfg, src.layout, name)
            for k in ("w1", "w3", "w2"):
                for e in ids:
                    yield from _with_scale(src, f"{m.group(1)}.experts.{e}.{k}.weight")
        elif name.endswith("engram.embed.weight"):
            if engram_tables == "host-mmap":  # mapped, not read
                continue
            rows, dim = spec.shape
            step = max(1, ROW_CHUNK_ELEMS // dim)
            for r in range(0, rows, step):
                if src.shared(name, engram_tables):  # mapped from the node's shared copy (_load_engram)
                    break
                yield (name, (0, r, min(rows, r + step)))
                if spec.quant == "engram_fp8":
                    yield (scale_name(name), (0, r, min(rows, r + step)))
        else:
            yield from _with_scale(src, name)


def _with_scale(src: _Source, name: str):
    share = src.share(name)
    yield (name, share)
    if scale_name(name) in src.specs:
        yield (scale_name(name), _scale_share(share, src.specs[name], src.cfg.weight_block_size))


def read_rank_tensors(cfg: ModelConfig, files: CheckpointFiles, layout: ParallelLayout):
    """Yield (name, stored tensor) for every release tensor (scales included) of this rank's share, in file order,
    reading only those bytes. The headers must have passed check_files."""
    src = _Source(cfg, files, layout)
    for name, spec in src.specs.items():
        if spec.quant == "scale":
            continue
        share = src.share(name)
        if share is None:
            continue
        yield name, src.read(name, share)
        if scale_name(name) in src.specs:
            yield scale_name(name), src.read_scale(name, share)


# ------------------------------------------------------------------------------------------------ load
@dataclass
class LoadReport:
    """What a load did: bytes read from the files (of them, the backbone's routed experts', scales included),
    seconds, and per runtime form how many tensors went there."""

    bytes_read: int = 0
    routed_expert_bytes: int = 0
    seconds: float = 0.0
    forms: dict[str, int] = field(default_factory=dict)

    def count(self, form: str) -> None:
        self.forms[form] = self.forms.get(form, 0) + 1


def _set(net: nn.Module, mname: str, t: torch.Tensor) -> None:
    """Put `t` where the (meta) parameter or buffer `mname` is."""
    mod_name, _, attr = mname.rpartition(".")
    mod = net.get_submodule(mod_name)
    if attr in mod._parameters:
        old = mod._parameters[attr]
        mod._parameters[attr] = nn.Parameter(t, requires_grad=old.requires_grad and t.is_floating_point())
    elif attr in mod._buffers:
        mod._buffers[attr] = t
    else:
        raise CheckpointError(f"model has no parameter or buffer {mname!r}")


def load_release(
    cfg: ModelConfig,
    path: str,
    *,
    layout: ParallelLayout = ParallelLayout(),
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    quantization: str | None = None,
    expert_format: str | None = None,
    engram_tables: str = "device",
    keep_dense: bool | None = None,
    huge_pages: bool = False,
    progress: bool | None = None,
    threads: int = 4,
    tp_group: dist.ProcessGroup | None = None,
    ep_group: dist.ProcessGroup | None = None,
    engram_store=None,
) -> tuple[nn.Module, LoadReport]:
    """The model of `cfg` with the checkpoint at `path` loaded as the module docstring says; returns it (eval
    mode, on `device`) and a LoadReport. keep_dense None: True on the CPU (the reference path and the tests'
    oracle read the dense experts there), False elsewhere. progress: a rich progress bar of the bytes read and
    their rate on stderr (None: when stderr is a terminal). threads: readers running ahead of the conversion
    (at most 16 MiB read and not yet used); 0 reads in line. tp_group / ep_group (``groups.new_groups``' ``tp`` and
    ``ep``): the groups a rank of ``layout.tp_size`` > 1 closes its splits over and a rank of ``layout.ep_size`` > 1
    dispatches over; every rank of them loads at once; None builds the shard without its collectives.
    engram_store (``layers.engram_store.EngramStore``): host tables go to the node's shared copy, read only by the
    first rank of the group that needs each."""
    from .model import DeepseekForCausalLM

    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r}: expected one of {QUANTIZATIONS}")
    if expert_format is not None and expert_format not in EXPERT_FORMATS:
        raise ValueError(f"expert format {expert_format!r}: expected one of {EXPERT_FORMATS} or None")
    if engram_tables not in ENGRAM_TABLES:
        raise ValueError(f"engram_tables {engram_tables!r}: expected one of {ENGRAM_TABLES}")
    device = torch.device(device)
    keep_dense = device.type == "cpu" if keep_dense is None else keep_dense
    t0 = time.perf_counter()
    report = LoadReport()
    with CheckpointFiles(path) as files:
        check_files(cfg, files)
        with torch.device("meta"), _no_init():
            net = DeepseekForCausalLM(cfg).eval()
        _rebuild_tables(net)
        # the passes' shapes and modules, on the meta device: filled below by name
        if layout.ep_size > 1:  # first: it replaces the MoE modules, whose experts TP then cuts
            target = layout.phy2log(cfg.n_routed_experts)
            draft = layout.phy2log(cfg.dspark_n_routed_experts, draft=True) if net.mtp is not None else None
            shard_expert_parallel(net, layout.ep_rank, layout.ep_size, ep_group, phy2log=target, draft_phy2log=draft)
        if layout.tp_size > 1:
            shard_tensor_parallel(net, layout.tp_rank, layout.tp_size, tp_group)
        src = _Source(cfg, files, layout, dtype, engram_store)
        done_moes: set[str] = set()
        bar = _progress_bar(progress, f"loading {cfg.name}", _share_bytes(src))
        src.ahead = _ReadAhead(files, _load_order(src, engram_tables), threads) if threads > 0 else None
        try:
            for name, spec in src.specs.items():
                if spec.quant == "scale":
                    continue
                bar.update(files.bytes_read)
                m = _EXPERT.match(name)
                if m:
                    if m.group(1) not in done_moes:
                        done_moes.add(m.group(1))
                        fmt = expert_format if name.startswith("layers.") else None  # the draft's experts stay dense
                        _load_experts(net, src, m.group(1), fmt, keep_dense, device, dtype, report)
                    continue
                mname, _ = model_name_for(name)
                share = src.share(name)
                if spec.quant == "fp8":
                    w, s = src.read(name, share), src.read_scale(name, share)
                    owner, _, attr = mname.removesuffix(".weight").rpartition(".")
                    # wo_b under TP is a RowParallelLinear (its all-reduce): kept dequantised
                    if quantization == "fp8" and _fp8_linear_fits(name, cfg) and _is_linear(net, owner, attr):
                        groups = net.get_submodule(owner).cfg.o_groups if name.endswith("wo_a.weight") else 1
                        lin = Fp8Linear(w.to(device), s.to(device), cfg.weight_block_size, groups)
                        setattr(net.get_submodule(owner), attr, lin)
                        report.count("fp8_linear")
                    else:
                        _set(net, mname, dequant_fp8_block(w, s, cfg.weight_block_size).to(device, dtype))
                        report.count("dequantised")
                elif name.endswith("engram.embed.weight"):  # FP8 as stored, or plain (an unquantised checkpoint)
                    _load_engram(net, src, name, spec, engram_tables, device, dtype, huge_pages)
                    report.count(f"engram_{engram_tables}")
                else:
                    t = src.read(name, share)
                    _set(net, mname, t.to(device, dtype if t.is_floating_point() else t.dtype))
                    report.count("plain")
            if quantization == "fp8":
                for layer in net.layers:
                    fuse_gate_up(layer.ffn.shared_experts)
        finally:
            if src.ahead is not None:
                src.ahead.close()
            bar.close(files.bytes_read)
        report.bytes_read = files.bytes_read
    if net.engram_token_map is not None and net.engram_token_map.is_meta:  # the model's one computed buffer
        net.engram_token_map = torch.arange(cfg.vocab_size, device=device)
    left = [n for n, p in list(net.named_parameters()) + list(net.named_buffers()) if p.is_meta]
    _fail(f"model of {cfg.name!r}: tensors the checkpoint did not fill", left)
    report.seconds = time.perf_counter() - t0
    return net, report


def _share_bytes(src: _Source) -> int:
    """Bytes this rank's share reads (the progress bar's total)."""
    total = 0
    for name, spec in src.specs.items():
        owner = spec.owner or name
        share = src.share(owner)
        if share is None:
            continue
        _, expert = model_name_for(owner)
        slots = 1 if expert is None else list(_expert_ids(src.cfg, src.layout, owner)).count(expert)  # EPLB replicas
        total += slots * spec.nbytes * ((share[2] - share[1]) / src.specs[owner].shape[share[0]] if share else 1)
    return int(total)


class _progress_bar:
    """rich's transfer bar (bytes, rate, time left) on stderr, or nothing."""

    def __init__(self, on: bool | None, what: str, total: int):
        import sys

        self.bar = None
        if on or (on is None and sys.stderr.isatty()):
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

            self.bar = Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                DownloadColumn(binary_units=True),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=False,
            )
            self.task = self.bar.add_task(what, total=total)
            self.bar.start()

    def update(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done)

    def close(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done)
            self.bar.stop()


@contextlib.contextmanager
def _no_init():
    """While the model is built on the meta device: nn.init's fills do nothing (they would compute nothing there),
    and the RoPE frequencies (host tables outside the parameters) are computed on the CPU. Either, on meta, goes
    through torch's reference decompositions, whose first use imports sympy (~3 s)."""
    from ..layers import rope

    names = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_")
    names += ("xavier_normal_", "zeros_", "ones_", "constant_")
    saved = {n: getattr(nn.init, n) for n in names}
    inv_freq = rope.inv_freq

    def on_cpu(spec):
        with torch.device("cpu"):
            return inv_freq(spec)

    for n in names:
        setattr(nn.init, n, lambda t, *a, **k: t)
    rope.inv_freq = on_cpu
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)
        rope.inv_freq = inv_freq


def _rebuild_tables(net: nn.Module) -> None:
    """Host-side tables a module computes at construction outside its parameters and buffers (the RoPE
    frequencies): built on the meta device above, rebuilt here on the CPU."""
    from ..layers.rope import Rope

    for m in net.modules():
        for v in vars(m).values():
            if isinstance(v, Rope) and v.inv_freq.is_meta:
                with torch.device("cpu"):
                    Rope.__init__(v, v.spec)


def _is_linear(net: nn.Module, owner: str, attr: str) -> bool:
    return type(getattr(net.get_submodule(owner), attr)) is nn.Linear


def _fp8_linear_fits(name: str, cfg: ModelConfig) -> bool:
    if not _FP8_LINEAR.match(name):
        return False
    return not name.endswith("wo_a.weight") or cfg.o_groups == 1 or cfg.o_lora_rank % cfg.weight_block_size == 0


def _load_experts(net, src: _Source, ffn: str, fmt, keep_dense, device, dtype, report: LoadReport) -> None:
    """One MoE's routed experts (the ones this rank owns) into their runtime form."""
    moe = net.get_submodule(ffn)
    ids = _expert_ids(src.cfg, src.layout, ffn)
    spec = src.specs[f"{ffn}.experts.{ids[0]}.w1.weight"]
    names = ("w1", "w3", "w2")
    backbone = ffn.startswith("layers.")  # the drafter's experts are not counted as routed_expert_bytes
    if fmt == "mxfp4" and spec.quant == "mxfp4":  # the stored bytes as they are
        ws, ss = {}, {}
        for k in names:
            for i, e in enumerate(ids):
                name = f"{ffn}.experts.{e}.{k}.weight"
                share = src.share(name)
                w, s = src.read(name, share).view(torch.uint8), src.read_scale(name, share).view(torch.uint8)
                report.routed_expert_bytes += (w.nbytes + s.nbytes) * backbone
                if i == 0:
                    ws[k] = torch.empty(len(ids), *w.shape, dtype=torch.uint8, device=device)
                    ss[k] = torch.empty(len(ids), *s.shape, dtype=torch.uint8, device=device)
                ws[k][i].copy_(w)
                ss[k][i].copy_(s)
        packed = ExpertWeights("mxfp4", ws["w1"], ws["w3"], ws["w2"], ss["w1"], ss["w3"], ss["w2"])
        report.count("experts_mxfp4")
    else:
        dense = {}
        for k in names:
            for i, e in enumerate(ids):
                name = f"{ffn}.experts.{e}.{k}.weight"
                share = src.share(name)
                w = src.read(name, share)
                report.routed_expert_bytes += w.nbytes * backbone
                if spec.quant == "mxfp4":
                    s = src.read_scale(name, share)
                    report.routed_expert_bytes += s.nbytes * backbone
                    w = dequant_mxfp4(w, s)
                if i == 0:  # fp32 when packing: today's path packs from the float32 model, before the cast
                    dense[k] = torch.empty(len(ids), *w.shape, dtype=torch.float32 if fmt else dtype, device=device)
                dense[k][i].copy_(w)
        if fmt is None:
            for k in names:
                _set(net, f"{ffn}.experts.{k}", dense[k])
            moe.local_experts = ids
            report.count("experts_dense")
            return
        packed = ExpertWeights.from_dense(dense["w1"], dense["w3"], dense["w2"], fmt)
        report.count(f"experts_{fmt}_repacked")
    moe.packed, moe.local_experts = packed, ids
    if keep_dense:  # the dense copies rounded to the packed values (quantize.pack_experts)
        for i, k in enumerate(names):
            d = torch.stack([packed.dequant(e)[i] for e in range(len(ids))]).to(dtype)
            _set(net, f"{ffn}.experts.{k}", d)
    else:
        for k in names:
            del moe.experts[k]


def _load_engram(net, src: _Source, name: str, spec: TensorSpec, where: str, device, dtype, huge_pages) -> None:
    """One Engram table, streamed in row chunks: host-fp8 keeps the stored bytes (EngramTable's "fp8" layout).
    With ``src.engram_store`` a host table goes to the node's shared copy, read here only where no rank of the
    group has read it."""
    engram = net.get_submodule(name.removesuffix(".embed.weight"))
    rows, dim = spec.shape
    if where == "host-mmap":  # the file's own bytes, mapped: nothing read now, nothing copied
        if spec.quant != "engram_fp8":
            raise CheckpointError(
                f"{name}: engram_tables host-mmap maps FP8 tables; this checkpoint stores {spec.dtype}"
            )
        w, s = src.files.tensors[name], src.files.tensors[scale_name(name)]
        mem = src.files.mapped(w.file)
        smem = src.files.mapped(s.file)
        data = mem.tensor[w.begin : w.end].view(rows, dim)
        scale = smem.tensor[s.begin : s.end].view(rows, dim // MX_BLOCK)
        engram.table = EngramTable(data, "fp8", dim, mem, scale=scale)
        engram.table.scale_memory = smem
        engram.embed = nn.Embedding(0, dim, device=device, dtype=dtype)
        return
    if where == "device":
        data = torch.empty(rows, dim, dtype=dtype, device=device)
        _read_engram(src, name, spec, where, data)
        _set(net, name, data)
        return
    width = dim + dim // MX_BLOCK if where == "host-fp8" else dim
    item = 1 if where == "host-fp8" else dtype.itemsize

    def fill(buf: torch.Tensor) -> None:
        _read_engram(src, name, spec, where, buf.view(rows, width) if item == 1 else buf.view(dtype).view(rows, dim))

    mem = host_memory(rows * width * item, fill, src.engram_store, src.engram_key(name, where), huge_pages)
    if src.ahead is not None:  # another rank of this node read it: none of its reads is needed here
        src.skip.add(name)
        src.ahead.drop({name, scale_name(name)})
    data = mem.tensor.view(rows, width) if item == 1 else mem.tensor.view(dtype).view(rows, dim)
    engram.table = EngramTable(data, "fp8" if where == "host-fp8" else "float", dim, mem)
    engram.embed = nn.Embedding(0, dim, device=device, dtype=dtype)


def _read_engram(src: _Source, name: str, spec: TensorSpec, where: str, data: torch.Tensor) -> None:
    """Stream one Engram table into ``data`` in row chunks: host-fp8 keeps the stored bytes (weight | scale)."""
    rows, dim = spec.shape
    step = max(1, ROW_CHUNK_ELEMS // dim)
    for r in range(0, rows, step):
        hi = min(rows, r + step)
        w = src.read(name, (0, r, hi))
        s = src.read(scale_name(name), (0, r, hi)) if spec.quant == "engram_fp8" else None
        if where == "host-fp8" and s is not None:
            data[r:hi, :dim].copy_(w.view(torch.uint8))
            data[r:hi, dim:].copy_(s.view(torch.uint8))
        elif where == "host-fp8":  # a plain table (unquantised checkpoint) quantised on load
            q, sc = quant_engram(w.float())
            data[r:hi, :dim].copy_(q.view(torch.uint8))
            data[r:hi, dim:].copy_(sc.view(torch.uint8))
        else:
            data[r:hi].copy_(dequant_engram(w, s) if s is not None else w)


__all__ = [
    "ENGRAM_TABLES",
    "LoadReport",
    "check_files",
    "load_release",
    "rank_share",
    "read_rank_tensors",
]
