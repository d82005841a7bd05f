"""Read and write release-format checkpoints (safetensors, spec 4), and seeded dummy weights.

``load_checkpoint`` validates every header against ``release_layout(cfg)`` before touching any data, then reads
tensors lazily (``safe_open``; Engram tables in row chunks) and dequantises them straight into the model's
state_dict entries. ``save_checkpoint`` writes the release names and formats (FP8 blocks, MXFP4, Engram FP8).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import zlib
from contextlib import ExitStack

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..layers.quant import dequant_engram, dequant_fp8_block, dequant_mxfp4, pack_mxfp4, quant_engram, quant_fp8_block
from .checkpoint_files import CheckpointError
from .checkpoint_layout import (
    IGNORED_PREFIXES,
    ST_DTYPES,
    TensorSpec,
    dtype_accepted,
    model_name_for,
    model_shapes,
    release_layout,
    scale_name,
)
from .config import ModelConfig

__all__ = [
    "CheckpointError",
    "TensorSpec",
    "release_layout",
    "model_name_for",
    "model_shapes",
    "load_checkpoint",
    "save_checkpoint",
    "dummy_weights",
    "dummy_tensor",
]

SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
ROW_CHUNK_ELEMS = 1 << 24  # Engram tables are streamed in chunks of about this many values
MAX_REPORTED = 8


def _fail(what: str, problems: list[str]):
    if problems:
        more = f"\n  ... and {len(problems) - MAX_REPORTED} more" if len(problems) > MAX_REPORTED else ""
        raise CheckpointError(f"{what}: {len(problems)} problem(s):\n  " + "\n  ".join(problems[:MAX_REPORTED]) + more)


def _fmt(shape, dtype) -> str:
    return f"{list(shape)} {dtype}"


def _weight_map(path: str) -> dict[str, str]:
    """Tensor name -> file, for a directory holding model.safetensors or an index with shards (or one file)."""
    if os.path.isfile(path):
        files = [path]
    elif os.path.exists(os.path.join(path, INDEX_FILE)):
        with open(os.path.join(path, INDEX_FILE)) as f:
            wm = json.load(f)["weight_map"]
        return {k: os.path.join(path, v) for k, v in wm.items()}
    elif os.path.exists(os.path.join(path, SINGLE_FILE)):
        files = [os.path.join(path, SINGLE_FILE)]
    else:
        raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")
    out = {}
    for fn in files:
        with safe_open(fn, framework="pt") as f:
            out.update({k: fn for k in f.keys()})
    return out


def _check_model(sd: dict, cfg: ModelConfig) -> list[str]:
    problems = []
    for name, (shape, _) in model_shapes(cfg).items():
        if name not in sd:
            problems.append(f"model has no tensor {name!r} (expected shape {list(shape)})")
        elif tuple(sd[name].shape) != shape:
            problems.append(f"model tensor {name!r}: expected shape {list(shape)}, found {list(sd[name].shape)}")
    return problems


# ------------------------------------------------------------------------------------------------ load
def load_checkpoint(model: torch.nn.Module, cfg: ModelConfig, path: str) -> list[str]:
    """Validate the checkpoint at `path` against release_layout(cfg), then dequantise every tensor into the
    model's state_dict (each entry keeps its own dtype/device). Raises CheckpointError listing missing, extra,
    mis-shaped or mis-typed tensors. Returns the model state_dict keys the checkpoint did not fill."""
    layout = release_layout(cfg)
    where = _weight_map(path)
    ignored = IGNORED_PREFIXES.get(cfg.family, ())
    missing = [
        f"missing tensor {n!r}: expected {_fmt(s.shape, s.dtype)}, found none"
        for n, s in layout.items()
        if n not in where
    ]
    wrong, extra = [], []
    with ExitStack() as stack:
        handles, present = {}, {}
        for fn in sorted(set(where.values())):
            if not os.path.exists(fn):
                raise CheckpointError(f"checkpoint {path}: shard {fn} named in {INDEX_FILE} does not exist")
            handles[fn] = stack.enter_context(safe_open(fn, framework="pt"))
            present[fn] = set(handles[fn].keys())
        for name, fn in where.items():
            if name not in present[fn]:
                missing.append(f"tensor {name!r} is listed in {INDEX_FILE} but absent from {fn}")
                continue
            sl = handles[fn].get_slice(name)
            shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
            spec = layout.get(name)
            if spec is None:
                if not name.startswith(ignored):
                    extra.append(
                        f"unexpected tensor {name!r}: expected none (not in the {cfg.name} layout), "
                        f"found {_fmt(shape, dtype)}"
                    )
            elif shape != spec.shape or not dtype_accepted(spec, dtype, cfg):
                wrong.append(f"tensor {name!r}: expected {_fmt(spec.shape, spec.dtype)}, found {_fmt(shape, dtype)}")
        _fail(
            f"checkpoint {path} does not match config {cfg.name!r} ({len(wrong)} mis-shaped/mis-typed, "
            f"{len(extra)} unexpected, {len(missing)} missing)",
            wrong + extra + missing,
        )
        sd = model.state_dict()
        _fail(f"model does not match config {cfg.name!r}", _check_model(sd, cfg))

        def read(name):
            return handles[where[name]].get_tensor(name)

        filled = set()
        with torch.no_grad():
            for name, spec in layout.items():
                if spec.quant == "scale":
                    continue
                mname, e = model_name_for(name)
                dst = sd[mname] if e is None else sd[mname][e]
                filled.add(mname)
                if spec.quant == "fp8":
                    dst.copy_(dequant_fp8_block(read(name), read(scale_name(name)), cfg.weight_block_size))
                elif spec.quant == "mxfp4":
                    dst.copy_(dequant_mxfp4(read(name), read(scale_name(name))))
                elif spec.quant == "engram_fp8":
                    w = handles[where[name]].get_slice(name)
                    s = handles[where[scale_name(name)]].get_slice(scale_name(name))
                    step = max(1, ROW_CHUNK_ELEMS // spec.shape[1])
                    for r in range(0, spec.shape[0], step):
                        dst[r : r + step].copy_(dequant_engram(w[r : r + step], s[r : r + step]))
                else:
                    dst.copy_(read(name))
    return sorted(set(sd) - filled)


# ------------------------------------------------------------------------------------------------ save
def _release_tensors(name: str, spec: TensorSpec, sd: dict, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    mname, e = model_name_for(name)
    src = sd[mname] if e is None else sd[mname][e]
    src = src.detach()
    if spec.quant == "fp8":
        q, s = quant_fp8_block(src, cfg.weight_block_size)
        return {name: q.cpu(), scale_name(name): s.cpu()}
    if spec.quant == "mxfp4":
        q, s = pack_mxfp4(src)
        return {name: q.cpu(), scale_name(name): s.cpu()}
    if spec.quant == "engram_fp8":
        rows, dim = spec.shape
        q = torch.empty(spec.shape, dtype=torch.float8_e4m3fn)
        s = torch.empty(rows, dim // 32, dtype=torch.float8_e8m0fnu)
        step = max(1, ROW_CHUNK_ELEMS // dim)
        for r in range(0, rows, step):
            qc, sc = quant_engram(src[r : r + step])
            q[r : r + step], s[r : r + step] = qc.cpu(), sc.cpu()
        return {name: q, scale_name(name): s}
    return {name: src.to("cpu", ST_DTYPES[spec.dtype], copy=True).contiguous()}


def save_checkpoint(
    model: torch.nn.Module,
    cfg: ModelConfig,
    out_dir: str,
    tokenizer_dir: str | None = None,
    quantize: bool = True,
    max_shard_bytes: int | None = None,
) -> None:
    """Write config.json, the weights in release names and formats (model.safetensors, or
    model-0000i-of-0000N.safetensors + model.safetensors.index.json when max_shard_bytes is given), and copy
    tokenizer.json / tokenizer_config.json from tokenizer_dir when present. quantize=False: the same names
    with every FP8/MXFP4/Engram weight plain BF16 and no quantization_config (a BF16 conversion)."""
    cfg = cfg if quantize else cfg.with_options(quantized=False)
    layout = release_layout(cfg)
    sd = model.state_dict()
    _fail(f"model does not match config {cfg.name!r}", _check_model(sd, cfg))
    os.makedirs(out_dir, exist_ok=True)
    # A unit is a weight with its scale; units are packed greedily into shards in layout order.
    units = [
        [n] + ([scale_name(n)] if scale_name(n) in layout else []) for n, s in layout.items() if s.quant != "scale"
    ]
    shards, size = [[]], 0
    for unit in units:
        nbytes = sum(layout[n].nbytes for n in unit)
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(unit[0])
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if max_shard_bytes else SINGLE_FILE
        tensors = {}
        for name in shard:
            tensors.update(_release_tensors(name, layout[name], sd, cfg))
        save_file(tensors, os.path.join(out_dir, fn), metadata={"format": "pt"})
        weight_map.update({k: fn for k in tensors})
    if max_shard_bytes:
        index = {"metadata": {"total_size": sum(s.nbytes for s in layout.values())}, "weight_map": weight_map}
        with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f, indent=2)
    for fn in TOKENIZER_FILES if tokenizer_dir else ():
        if os.path.exists(os.path.join(tokenizer_dir, fn)):
            shutil.copyfile(os.path.join(tokenizer_dir, fn), os.path.join(out_dir, fn))


def write_random_release(cfg: ModelConfig, out_dir: str, seed: int = 0, max_shard_bytes: int = 1 << 30) -> int:
    """A release-format checkpoint of random bytes (finite FP8 values, scales 2^-17..2^0, valid MXFP4 codes and
    expert ids) written tensor by tensor without building a model: loader tests and benchmarks at sizes the
    float writer cannot reach quickly. Not a model anyone should run. Returns the bytes written."""
    layout = release_layout(cfg)
    os.makedirs(out_dir, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    # Tensors are cut from a few random pools at a rolling offset: drawing every value anew costs more than the write.
    pool_n = 1 << 24
    b = torch.randint(0, 256, (pool_n,), generator=g, dtype=torch.uint8)
    b[(b & 0x7F) == 0x7F] = 0  # the two e4m3 NaN codes
    pools = {
        "F8_E4M3": b.view(torch.float8_e4m3fn),
        "I8": b.view(torch.int8),
        "F8_E8M0": torch.randint(110, 128, (pool_n,), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu),
        "F32": torch.randn(pool_n, generator=g) * 0.02,
        "I32": torch.randint(0, cfg.n_routed_experts, (pool_n,), generator=g, dtype=torch.int32),
    }
    pools["BF16"], pools["F16"] = pools["F32"].bfloat16(), pools["F32"].half()
    at = [0]

    def tensor(spec: TensorSpec) -> torch.Tensor:
        n = math.prod(spec.shape)
        src = pools[spec.dtype]
        reps = -(-n // pool_n)
        start = at[0] = (at[0] + 7919) % pool_n
        flat = src[start : start + n] if start + n <= pool_n else src.repeat(reps + 1)[start : start + n]
        return flat.clone().view(spec.shape)

    shards, size = [[]], 0
    for name, spec in layout.items():
        if max_shard_bytes and shards[-1] and size + spec.nbytes > max_shard_bytes and spec.quant != "scale":
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += spec.nbytes
    weight_map = {}
    for i, names in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensor(layout[n]) for n in names}, os.path.join(out_dir, fn), metadata={"format": "pt"})
        weight_map.update({n: fn for n in names})
    total = sum(s.nbytes for s in layout.values())
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f, indent=2)
    return total


# ------------------------------------------------------------------------------------------------ dummy
_ONES = re.compile(r"(^|\.)\w*norm\.weight$|engram\.[qk]_weight$|hc_\w+_scale$")
_ZEROS = re.compile(r"hc_\w+_base$")
# Random, not zero, so the sink, the bias-only selection and the APE are exercised by every test.
_HALF_NORMAL = re.compile(r"attn_sink$|gate\.bias(_vl)?$|compressor\.ape$")
_UNIT_NORMAL = re.compile(r"(^|markov_head\.)embed\.weight$")


def dummy_weights(model: torch.nn.Module, cfg: ModelConfig, seed: int = 0) -> None:
    """Seeded random init of every release-layout tensor the model has (other state is left alone):
    norms, engram q/k weights and hc_*_scale = 1; hc_*_base = 0; attn_sink, gate biases, compressor ape
    ~ 0.5 N(0, 1);
    embeddings ~ N(0, 1); Engram tables ~ 0.1 N(0, 1); hc_*_fn ~ 0.5 N(0, 1)/sqrt(fan_in) so the 24 mixes are
    N(0, 1/4) (varied, O(1) pre/post/comb); every other weight ~ N(0, 1)/sqrt(fan_in) with fan_in = last dim;
    tid2eid = distinct random experts per token. Each tensor draws from its own torch.Generator (on the tensor's
    device) seeded from (seed, name), so the result is independent of iteration order. Tensors on the meta
    device (experts deferred by layers.moe.deferred_experts) are skipped: their builder fills them with
    dummy_tensor, to the same values."""
    sd = model.state_dict()
    for name in model_shapes(cfg):
        if name in sd and not sd[name].is_meta:
            dummy_tensor(name, sd[name], cfg, seed)


def dummy_tensor(name: str, t: torch.Tensor, cfg: ModelConfig, seed: int = 0) -> None:
    """Fill the model tensor `name` in place as dummy_weights does (see there)."""
    with torch.no_grad():
        g = torch.Generator(device=t.device)
        g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62))
        if _ONES.search(name):
            t.fill_(1.0)
        elif _ZEROS.search(name):
            t.zero_()
        elif name.endswith("tid2eid"):
            n_exp = cfg.n_routed_experts
            r = torch.rand(t.shape[0], n_exp, generator=g, device=t.device)
            t.copy_(r.argsort(dim=-1)[:, : t.shape[1]])
        else:
            if _UNIT_NORMAL.search(name):
                std = 1.0
            elif _HALF_NORMAL.search(name):
                std = 0.5
            elif name.endswith("engram.embed.weight"):
                std = 0.1
            elif re.search(r"hc_\w+_fn$", name):
                std = 0.5 / t.shape[-1] ** 0.5
            else:
                std = 1.0 / t.shape[-1] ** 0.5
            rows = t.view(-1, t.shape[-1])
            step = max(1, ROW_CHUNK_ELEMS // t.shape[-1])
            for r in range(0, rows.shape[0], step):
                chunk = rows[r : r + step]
                chunk.copy_(torch.randn(chunk.shape, generator=g, device=t.device) * std)
