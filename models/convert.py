"""Converting any model edgeserve loads into an MLX-format folder, as mlx-lm writes one.

The folder holds config.json with a `quantization` entry (per-module overrides where a tensor
differs from the rest, as mlx-lm writes them), model.safetensors (or shards with
model.safetensors.index.json), the tokenizer files and the chat template, so mlx-lm loads it as
well as edgeserve. Matrices become affine groups (`quant.affine`); GGUF Q4_0/Q4_1/Q8_0 blocks and
already-quantized MLX tensors of the asked group size are copied (or, below the asked width,
repacked into wider integers) with their exact values, never requantized.
Everything else (norms, and every weight at 16 bits) is written as float16.

The folder is written under a hidden temporary name beside OUT and renamed at the end, so a
failure or Ctrl-C never leaves a half-written OUT behind.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import stat
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from safetensors.numpy import save_file
from tqdm import tqdm

from edgeserve.errors import EdgeserveError
from edgeserve.models.loader import LoadedModel
from edgeserve.models.registry import architecture
from edgeserve.quant.affine import SUPPORTED_GROUP_SIZES, QuantizedTensor, _as_float32, pack, quantize, unpack
from edgeserve.quant.kquants import KQuantTensor
from edgeserve.units import format_size

BITS = (4, 8, 16)
KEEP_EMBEDDINGS_BITS = (8, 16)
DEFAULT_GROUP_SIZE = 64  # mlx-lm's default, for float sources
MAX_SHARD_BYTES = 5 * 10**9  # mlx-lm's shard size
EMBEDDING_WEIGHTS = ("model.embed_tokens.weight", "lm_head.weight")

_FLOAT16_MAX = float(np.finfo(np.float16).max)
_SPACE_MARGIN = 64 * 2**20  # tokenizer, config and file-system slack on top of the weights


class ConvertError(EdgeserveError):
    """A conversion that cannot run as asked; nothing was written."""


@dataclass(frozen=True)
class TensorPlan:
    """What becomes of one source weight."""

    name: str
    is_matrix: bool
    bits: int  # 16: a float array (float16, or float32 where values overflow float16)
    group_size: int | None
    # "float": written as floats; "quantize": new affine groups; "copy": the source's groups as
    # they are; "widen": the source's groups repacked into wider integers (the same values).
    action: Literal["float", "quantize", "copy", "widen"]
    nbytes: int  # expected size in the output

    @property
    def quantized(self) -> bool:
        return self.bits != 16


@dataclass
class ConversionResult:
    out: Path
    plans: list[TensorPlan]
    bits: int
    group_size: int | None  # of the layers; None when nothing is quantized
    total_bytes: int
    # ||W - W'|| / ||W|| of every matrix against the source's own values, when measured.
    relative_errors: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        """e.g. '4-bit, group 32; model.embed_tokens 8-bit, group 32' or 'float16'."""
        if self.group_size is None:
            return "float16"
        parts = [f"{self.bits}-bit, group {self.group_size}"]
        for p in self.plans:
            if p.is_matrix and (p.bits, p.group_size) != (self.bits, self.group_size):
                width = f"{p.bits}-bit, group {p.group_size}" if p.quantized else "float16"
                parts.append(f"{p.name.removesuffix('.weight')} {width}")
        return "; ".join(parts)


def convert(
    model: LoadedModel,
    out: str | Path,
    *,
    bits: int = 4,
    group_size: int | None = None,
    keep_embeddings: int = 8,
    force: bool = False,
    measure_errors: bool = False,
    progress: bool = True,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> ConversionResult:
    """Write a loaded model into `out` as an MLX-format folder.

    bits: 4 or 8 for affine groups, 16 for float16. group_size: None takes a quantized source
    tensor's own group size (GGUF Q4_0/Q4_1/Q8_0: 32, so those carry over) and 64 for float
    sources. keep_embeddings: the width of the embeddings and output head, never below `bits`
    (llama.cpp's "_M" recipes).
    """
    out = Path(out)
    _check_options(bits, group_size, keep_embeddings)
    check_output(out, force)
    _check_not_overlapping(model.source, out)
    plans = plan_conversion(model, bits, group_size, keep_embeddings)
    _check_disk_space(out, sum(p.nbytes for p in plans) + _SPACE_MARGIN)
    layer_bits, layer_group = _layer_quantization(plans)
    config = _config(model, plans, layer_bits, layer_group)
    result = ConversionResult(out, plans, layer_bits, layer_group, 0)

    def write(folder: Path) -> None:
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation = model.source / "generation_config.json"
        if model.source.is_dir() and generation.is_file():
            shutil.copyfile(generation, folder / "generation_config.json")
        model.tokenizer.save_pretrained(folder)
        errors = result.relative_errors if measure_errors else None
        result.total_bytes = _write_weights(model, plans, folder, max_shard_bytes, progress, errors)

    _write_atomically(out, write)
    return result


def plan_conversion(model: LoadedModel, bits: int, group_size: int | None, keep_embeddings: int) -> list[TensorPlan]:
    """Decide width, group size and action for every weight; raise before anything is written."""
    plans = []
    for name, w in model.weights.items():
        # K-quants are requantized from their exact float values ("quantize" below)
        if not isinstance(w, (QuantizedTensor, KQuantTensor)) and not np.issubdtype(w.dtype, np.floating):
            raise ConvertError(f"{model.source}: tensor {name} has unsupported type {w.dtype}")
        target = max(bits, keep_embeddings) if name in EMBEDDING_WEIGHTS else bits
        if len(w.shape) != 2 or target == 16:
            plans.append(TensorPlan(name, len(w.shape) == 2, 16, None, "float", 2 * int(np.prod(w.shape))))
            continue
        rows, cols = w.shape
        group = group_size or (w.group_size if isinstance(w, QuantizedTensor) else DEFAULT_GROUP_SIZE)
        if cols % group:
            fits = [str(g) for g in SUPPORTED_GROUP_SIZES if cols % g == 0]
            hint = f"use --group-size {' or '.join(fits)}" if fits else "it cannot be quantized in groups"
            raise ConvertError(f"group size {group} does not divide the {cols} columns of {name}; {hint}")
        # Source groups of the same size and no more bits keep their exact values: a 4-bit
        # group fits 8-bit integers as it is, while requantizing it would only add rounding.
        keeps = isinstance(w, QuantizedTensor) and w.group_size == group and w.bits <= target
        action = ("copy" if w.bits == target else "widen") if keeps else "quantize"
        scale_bytes = 4 if keeps and w.scales.dtype != np.float16 else 2
        nbytes = rows * cols * target // 8 + 2 * rows * (cols // group) * scale_bytes
        plans.append(TensorPlan(name, True, target, group, action, nbytes))
    return plans


def convert_tensor(w: np.ndarray | QuantizedTensor, plan: TensorPlan) -> np.ndarray | QuantizedTensor:
    """One weight as the plan asks: affine groups, or a float16 (float32 if it overflows) array."""
    if plan.action == "float":
        return _half(_as_float(w))
    if plan.action == "quantize":
        return quantize(_half(_as_float(w)), plan.group_size, plan.bits)
    weight = w.weight if plan.action == "copy" else pack(unpack(w.weight, w.bits), plan.bits)
    scales, biases = w.scales, w.biases
    if scales.dtype == np.uint16:  # bfloat16 bits: safetensors.numpy has no bfloat16; float32 is exact
        scales, biases = _as_float32(scales), _as_float32(biases)
    return QuantizedTensor(weight, scales, biases, plan.bits, plan.group_size)


def relative_error(source: np.ndarray | QuantizedTensor, converted: np.ndarray | QuantizedTensor) -> float:
    """||W - W'|| / ||W|| of a converted matrix against the source's values."""
    a = _as_float(source).astype(np.float32, copy=False)
    b = _as_float(converted).astype(np.float32, copy=False)
    norm = float(np.linalg.norm(a))
    return float(np.linalg.norm(a - b)) / norm if norm else float(np.linalg.norm(b))


def _as_float(w: np.ndarray | QuantizedTensor | KQuantTensor) -> np.ndarray:
    return w.dequantize(np.float32) if isinstance(w, (QuantizedTensor, KQuantTensor)) else np.asarray(w)


def _half(w: np.ndarray) -> np.ndarray:
    """float16, the dtype mlx-lm folders use, unless the values overflow it."""
    if w.dtype == np.float16:
        return w
    return w.astype(np.float16 if np.abs(w).max(initial=0) <= _FLOAT16_MAX else np.float32)


def _arrays(name: str, converted: np.ndarray | QuantizedTensor) -> dict[str, np.ndarray]:
    """The safetensors entries of one converted weight (mlx-lm's naming)."""
    if not isinstance(converted, QuantizedTensor):
        return {name: np.ascontiguousarray(converted)}
    stem = name.removesuffix(".weight")
    return {f"{stem}.weight": converted.weight, f"{stem}.scales": converted.scales, f"{stem}.biases": converted.biases}


def _layer_quantization(plans: list[TensorPlan]) -> tuple[int, int | None]:
    """The most common (bits, group size) among quantized matrices: config.json's default entry."""
    counts = Counter((p.bits, p.group_size) for p in plans if p.quantized)
    if not counts:
        return 16, None
    return counts.most_common(1)[0][0]


def _shards(plans: list[TensorPlan], max_bytes: int) -> list[list[TensorPlan]]:
    shards: list[list[TensorPlan]] = [[]]
    size = 0
    for plan in plans:
        if shards[-1] and size + plan.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(plan)
        size += plan.nbytes
    return shards


def _write_weights(
    model: LoadedModel,
    plans: list[TensorPlan],
    folder: Path,
    max_shard_bytes: int,
    progress: bool,
    errors: dict[str, float] | None,
) -> int:
    """Convert and save shard by shard (one shard in memory at a time); return the bytes written."""
    shards = _shards(plans, max_shard_bytes)
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    weight_map: dict[str, str] = {}
    total = 0
    with tqdm(total=len(plans), unit="tensor", desc="converting", disable=not progress) as bar:
        for shard_name, shard in zip(names, shards):
            arrays: dict[str, np.ndarray] = {}
            for plan in shard:
                bar.set_postfix_str(plan.name, refresh=False)
                source = model.weights[plan.name]
                converted = convert_tensor(source, plan)
                if errors is not None and plan.is_matrix:
                    exact = plan.action in ("copy", "widen")
                    errors[plan.name] = 0.0 if exact else relative_error(source, converted)
                arrays.update(_arrays(plan.name, converted))
                bar.update()
            path = folder / shard_name
            save_file(arrays, str(path), metadata={"format": "mlx"})
            # safetensors creates owner-only files; give the shards the mode config.json got.
            path.chmod(stat.S_IMODE((folder / "config.json").stat().st_mode))
            weight_map.update(dict.fromkeys(arrays, shard_name))
            total += sum(a.nbytes for a in arrays.values())
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=4) + "\n")
    return total


def _config(model: LoadedModel, plans: list[TensorPlan], bits: int, group_size: int | None) -> dict:
    """config.json: the model's arguments, token ids and the quantization entry mlx-lm reads."""
    config = _source_config(model)
    try:
        config.update(model.args.to_config())
    except ValueError as exc:
        raise ConvertError(f"{model.source}: {exc}") from exc
    config["architectures"] = [architecture(model.args.model_type, model.source).hf_name]
    config["torch_dtype"] = "float16"
    tok = model.tokenizer
    config.setdefault("bos_token_id", tok.bos_token_id)
    config.setdefault("eos_token_id", sorted(tok.eos_token_ids) if tok.eos_token_ids else tok.eos_token_id)
    if group_size is not None:
        quantization: dict = {"group_size": group_size, "bits": bits, "mode": "affine"}
        for p in plans:
            if p.quantized and (p.bits, p.group_size) != (bits, group_size):
                quantization[p.name.removesuffix(".weight")] = {"group_size": p.group_size, "bits": p.bits}
        config["quantization"] = quantization
        config["quantization_config"] = quantization  # what mlx-lm writes too, for Hugging Face tools
    return config


def _source_config(model: LoadedModel) -> dict:
    """A folder source's own config.json (keeping entries edgeserve does not model), minus its quantization."""
    path = model.source / "config.json"
    if not model.source.is_dir() or not path.is_file():
        return {}
    config = json.loads(path.read_text())
    for key in ("quantization", "quantization_config", "torch_dtype", "dtype"):
        config.pop(key, None)
    return config


def _check_options(bits: int, group_size: int | None, keep_embeddings: int) -> None:
    if bits not in BITS:
        raise ConvertError(f"unsupported width {bits} bits (choose from {', '.join(map(str, BITS))})")
    if group_size is not None and group_size not in SUPPORTED_GROUP_SIZES:
        choices = ", ".join(map(str, SUPPORTED_GROUP_SIZES))
        raise ConvertError(f"unsupported group size {group_size} (choose from {choices})")
    if keep_embeddings not in KEEP_EMBEDDINGS_BITS:
        raise ConvertError(f"unsupported embedding width {keep_embeddings} bits (choose from 8, 16)")


def check_output(out: Path, force: bool) -> None:
    """Refuse an existing OUT unless forced (cheap: run it before loading the source)."""
    if out.exists() and not force:
        raise ConvertError(f"{out} already exists (use --force to replace it)")


def _check_not_overlapping(source: Path, out: Path) -> None:
    src, dst = source.resolve(), out.resolve()
    if src == dst or dst in src.parents:
        raise ConvertError(f"{out} holds the source model; choose another output folder")
    if src in dst.parents:
        raise ConvertError(f"{out} is inside the source model folder; choose another output folder")


def _check_disk_space(out: Path, needed: int) -> None:
    existing = next(p for p in [out.absolute(), *out.absolute().parents] if p.exists())
    free = shutil.disk_usage(existing).free
    if free < needed:
        raise ConvertError(
            f"not enough disk space for {out}: needs about {format_size(needed)}, {format_size(free)} free"
        )


def _write_atomically(out: Path, write: Callable[[Path], None]) -> None:
    """Run `write` into a hidden sibling folder, then move it into place (replacing `out`)."""
    out = out.absolute()
    created = [p for p in [out.parent, *out.parent.parents] if not p.exists()]
    tmp = out.parent / f".{out.name}.{uuid.uuid4().hex[:8]}.partial"
    try:
        tmp.mkdir(parents=True)
        write(tmp)
        if out.exists():
            old = tmp.with_suffix(".old")
            out.rename(old)
            try:
                tmp.rename(out)
            except BaseException:
                old.rename(out)
                raise
            _remove(old)
        else:
            tmp.rename(out)
    except BaseException as exc:
        _remove(tmp)
        for parent in created:  # innermost first
            with contextlib.suppress(OSError):
                parent.rmdir()
        if isinstance(exc, OSError):
            raise ConvertError(f"could not write {out}: {exc}") from exc
        raise


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()

