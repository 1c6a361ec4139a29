"""Reading HF checkpoints (config.json + safetensors shards): the tensors the tables in
``jaxdd.weights.hf_mappings`` name, whole or one region (``jaxdd.weights.hf_loader`` fills
jaxdd parameters from them).

``HFCheckpoint`` reads the real layouts: plain bf16/fp32 (save_pretrained), Kimi
K2-Instruct / DeepSeek-V3 FP8 (``weight`` e4m3 + ``weight_scale_inv`` per 128 x 128 block),
and K2-Thinking / K2.5 / K2.6 compressed-tensors INT4 (``weight_packed`` / ``weight_scale``
/ ``weight_shape``), with the K2.5 ``language_model.`` prefix stripped and the vision
tower, projector and stray ``rotary_emb.inv_freq`` buffers skipped. ``check`` validates
every name, shape and dtype from the shard headers alone, before a single tensor is read.
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxdd.errors import CheckpointError, ConfigError, read_json
from jaxdd.models.quant import ExpertFormat, dequantize_fp8_blocks, dequantize_int4_groups
from jaxdd.weights.hf_mappings import Mapping
from jaxdd.weights.hf_quantization import fp8_block, int4_group, quantization_config

# Junk buffers some exports carry, and vision parts of the K2.5/K2.6 wrapper.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
IGNORED_PREFIXES = ("vision_tower.", "mm_projector.")
WRAPPER_PREFIX = "language_model."
INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = {"BF16", "F16", "F32"}
# Quantized pieces kept as stored, in the real layouts'
# dtypes (the jaxdd parameters have exactly these).
RAW_DTYPES = {
    "weight_packed": {"I32"},
    "weight_scale": {"BF16"},
    "weight_scale_inv": {"F32"},
    "weight": {"F8_E4M3"},
}


class TensorInfo(NamedTuple):
    file: Path
    stored_name: str  # as in the file (with any wrapper prefix)
    dtype: str  # safetensors dtype name: BF16, F32, F8_E4M3, I32, ...
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * _ITEMSIZE.get(self.dtype, 4)


_ITEMSIZE = {
    "BF16": 2,
    "F16": 2,
    "F32": 4,
    "F64": 8,
    "F8_E4M3": 1,
    "I8": 1,
    "U8": 1,
    "I32": 4,
    "I64": 8,
    "BOOL": 1,
}


def _shard_files(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The shards (those the index names, or every
    *.safetensors file) and the index's weight map."""
    index = directory / INDEX_FILE
    if index.exists():
        try:
            weight_map = read_json(index)["weight_map"]
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        names = sorted(set(weight_map.values()))
        # present but unreadable: said when opened
        missing = [n for n in names if not (directory / n).exists()]
        if missing:
            raise CheckpointError(f"{index} names missing shard(s): {', '.join(missing)}")
        return [directory / n for n in names], weight_map
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files")
    return files, None


class HFCheckpoint:
    """An HF checkpoint directory: its config and the
    headers of all its tensors (nothing else read yet)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not (self.directory / "config.json").is_file():
            raise CheckpointError(
                f"{self.directory}: no config.json (is this an HF checkpoint directory?)"
            )
        self.config_path = self.directory / "config.json"
        self.raw_config: dict[str, Any] = read_json(self.config_path, ConfigError)
        files, weight_map = _shard_files(self.directory)
        self.tensors: dict[str, TensorInfo] = {}
        for file in files:
            try:
                file.open("rb").close()  # safetensors reports any unreadable file as missing
            except OSError as e:
                raise CheckpointError(f"{file}: {e.strerror}") from None
            try:
                with safe_open(file, framework="numpy") as f:
                    for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                        if name.endswith(IGNORED_SUFFIXES) or name.startswith(IGNORED_PREFIXES):
                            continue
                        piece = f.get_slice(name)
                        info = TensorInfo(file, name, piece.get_dtype(), tuple(piece.get_shape()))
                        self.tensors[name.removeprefix(WRAPPER_PREFIX)] = info
            except SafetensorError as e:
                raise CheckpointError(f"{file}: corrupt safetensors file ({e})") from None
        if weight_map is not None:
            stored = {info.stored_name: info.file.name for info in self.tensors.values()}
            absent = sorted(
                n for n, shard in weight_map.items() if n in stored and stored[n] != shard
            )
            absent += sorted(n for n in weight_map if n not in stored and not _ignored(n))
            if absent:
                listed = ", ".join(f"{n} (in {weight_map[n]})" for n in absent[:10])
                raise CheckpointError(
                    f"{self.directory / INDEX_FILE}: tensors not where the index says: {listed}"
                )

    def quantization(self) -> dict[str, Any]:
        return quantization_config(self.raw_config)

    def stored_expert_format(self) -> ExpertFormat:
        """How the first routed expert is stored here (INT4 packed, FP8 blocks, or dense)
        and the first router's gate (bf16 kept as bf16; fp16 and fp32 held in fp32)."""
        q = self.quantization()
        first = next((n for n in self.tensors if ".mlp.experts." in n), "")
        base = first.rsplit(".", 1)[0]
        gate = next(
            (info for n, info in self.tensors.items() if n.endswith(".mlp.gate.weight")), None
        )
        router = "bfloat16" if gate is not None and gate.dtype == "BF16" else "float32"
        if base + ".weight_packed" in self.tensors:
            return ExpertFormat("int4", group=int4_group(q), router=router)
        if base + ".weight_scale_inv" in self.tensors:
            return ExpertFormat("fp8", block=fp8_block(q), router=router)
        return ExpertFormat(router=router)

    def check(
        self, mappings: list[Mapping], ignored: Callable[[str], bool] = lambda name: False
    ) -> None:
        """Every tensor the mappings need is present with
        its shape and dtype, and nothing else is there.

        One CheckpointError lists every problem; nothing is
        read beyond the headers (and INT4 weight_shape)."""
        problems = []
        used = set()
        for mapping in mappings:
            for name, shape in zip(mapping.names, mapping.shapes, strict=True):
                check = self._check_raw if mapping.raw else self._check_dense
                problems += check(name, shape, used)
        unexpected = sorted(n for n in self.tensors.keys() - used if not ignored(n))
        problems += [f"unexpected tensor: {n}" for n in unexpected]
        if problems:
            more = [f"  ... {len(problems) - 30} more"] if len(problems) > 30 else []
            lines = [f"{self.directory}: the tensors do not match the config"] + [
                f"  {p}" for p in problems[:30]
            ]
            raise CheckpointError("\n".join(lines + more))

    def _check_raw(self, name: str, shape: tuple[int, ...], used: set[str]) -> list[str]:
        suffix = name.rsplit(".", 1)[1]
        problems = self._check_tensor(name, shape, RAW_DTYPES[suffix], used)
        if suffix == "weight_packed":  # its weight_shape companion must give the unpacked shape
            problems += self._check_tensor(
                name.replace("weight_packed", "weight_shape"), (2,), {"I32", "I64"}, used
            )
        return problems

    def _check_dense(self, name: str, shape: tuple[int, ...], used: set[str]) -> list[str]:
        base = name.removesuffix(".weight")
        if base + ".weight_packed" in self.tensors:
            group = int4_group(self.quantization())
            packed = (shape[0], -(-shape[1] // 8))
            scale = (shape[0], shape[1] // group)
            problems = self._check_raw(base + ".weight_packed", packed, used)
            problems += self._check_tensor(base + ".weight_scale", scale, FLOAT_DTYPES, used)
            if not problems and tuple(self._read(base + ".weight_shape").tolist()) != shape:
                problems.append(
                    f"{base}.weight_shape: {self._read(base + '.weight_shape').tolist()}, "
                    f"needs {shape}"
                )
            return problems
        if base + ".weight_scale_inv" in self.tensors:
            block = fp8_block(self.quantization())
            blocks = (-(-shape[0] // block), -(-shape[1] // block))
            problems = self._check_tensor(name, shape, {"F8_E4M3"}, used)
            return problems + self._check_tensor(base + ".weight_scale_inv", blocks, {"F32"}, used)
        return self._check_tensor(name, shape, FLOAT_DTYPES, used)

    def _check_tensor(
        self, name: str, shape: tuple[int, ...], dtypes: set[str], used: set[str]
    ) -> list[str]:
        info = self.tensors.get(name)
        if info is None:
            return [f"missing tensor: {name}"]
        used.add(name)
        problems = []
        if info.shape != tuple(shape):
            problems.append(f"{name}: shape {list(info.shape)}, the config needs {list(shape)}")
        if info.dtype not in dtypes:
            problems.append(f"{name}: dtype {info.dtype}, expected {' or '.join(sorted(dtypes))}")
        return problems

    def read(self, mapping: Mapping) -> tuple[np.ndarray, ...]:
        """The HF arrays of one mapping: stored pieces as
        they are, dense weights dequantized (bf16)."""
        return tuple(self._read(n) if mapping.raw else self.read_dense(n) for n in mapping.names)

    def read_part(
        self, mapping: Mapping, k: int, index: tuple[slice, ...], shape: tuple[int, ...]
    ) -> np.ndarray:
        """``index`` of the mapping's k-th jaxdd parameter (of ``shape``), reading from
        disk only the HF rows, columns or experts it covers when it splits one axis the
        mapping's layout places (one device's shard does); the whole tensors otherwise."""
        split = [
            axis
            for axis, (s, n) in enumerate(zip(index, shape, strict=True))
            if s.indices(n)[:2] != (0, n)
        ]
        names = mapping.names
        region = None
        rest = list(index)
        where = mapping.layouts[k][split[0]] if len(split) == 1 else None
        if where is not None:
            start, stop, _ = index[split[0]].indices(shape[split[0]])
            rest[split[0]] = slice(None)
            if where.hf is None:
                names = names[start:stop]
            else:
                region = (slice(None),) * where.hf + (
                    slice(start * where.scale, stop * where.scale),
                )
        pieces = [
            self._read(n, region) if mapping.raw else self.read_dense(n, region) for n in names
        ]
        return mapping.forward(*pieces)[k][tuple(rest)]

    def read_dense(self, name: str, region: tuple[slice, ...] | None = None) -> np.ndarray:
        """A dense weight, or its ``region`` (rows, columns); quantized ones are
        read and dequantized from the whole groups / blocks around it, then cut."""
        base = name.removesuffix(".weight")
        if base + ".weight_packed" in self.tensors:
            out, in_features = (int(n) for n in self._read(base + ".weight_shape"))
            group = int4_group(self.quantization())
            rows = _rows(region, out)
            (wide, cut) = _widen(region, 1, in_features, group)
            packed = self._read(
                base + ".weight_packed", (rows, slice(wide.start // 8, -(-wide.stop // 8)))
            )
            scale = self._read(
                base + ".weight_scale", (rows, slice(wide.start // group, -(-wide.stop // group)))
            )
            dense = dequantize_int4_groups(
                packed, scale, wide.stop - wide.start, scale.dtype, group
            )
            return np.asarray(dense)[:, cut]
        if base + ".weight_scale_inv" in self.tensors:
            block = fp8_block(self.quantization())
            shape = self.tensors[name].shape
            (wide_rows, cut_rows), (wide, cut) = (
                _widen(region, axis, shape[axis], block) for axis in (0, 1)
            )
            weight = self._read(name, (wide_rows, wide))
            blocks = tuple(slice(w.start // block, -(-w.stop // block)) for w in (wide_rows, wide))
            dense = dequantize_fp8_blocks(
                weight, self._read(base + ".weight_scale_inv", blocks), jnp.bfloat16, block
            )
            return np.asarray(dense)[cut_rows, cut]
        return self._read(name, region)

    def nbytes(self, mapping: Mapping) -> int:
        """Bytes this mapping reads, quantization companions (scales, shapes) included."""
        return sum(
            self.tensors[n].nbytes
            for name in mapping.names
            for n in self._pieces(name, mapping.raw)
        )

    def _pieces(self, name: str, raw: bool) -> list[str]:
        """The stored tensors behind one mapping name."""
        base = name.rsplit(".", 1)[0]
        if raw:
            return [name, base + ".weight_shape"] if name.endswith(".weight_packed") else [name]
        if base + ".weight_packed" in self.tensors:
            return [base + ".weight_packed", base + ".weight_scale", base + ".weight_shape"]
        if base + ".weight_scale_inv" in self.tensors:
            return [name, base + ".weight_scale_inv"]
        return [name]

    def _read(self, name: str, region: tuple[slice, ...] | None = None) -> np.ndarray:
        """A stored tensor, or its ``region``: only the
        bytes that covers are read from the shard."""
        info = self.tensors[name]
        if info.dtype == "F8_E4M3":  # numpy has no float8, so safetensors' numpy reader refuses it
            array = _read_float8(info, region)
        else:
            with safe_open(info.file, framework="numpy") as f:
                array = (
                    f.get_tensor(info.stored_name)
                    if region is None
                    else f.get_slice(info.stored_name)[region]
                )
        return finite(array, info)


def finite(array: np.ndarray, info: TensorInfo) -> np.ndarray:
    """``array`` as read from ``info``'s file, or a CheckpointError
    naming it when it holds a NaN or an infinity (a model with one
    computes garbage that speculative decoding would silently accept)."""
    if jnp.issubdtype(array.dtype, jnp.inexact) and not np.isfinite(array).all():
        raise CheckpointError(
            f"{info.file}: tensor {info.stored_name} holds NaN or infinite values"
        )
    return array


def _rows(region: tuple[slice, ...] | None, rows: int) -> slice:
    return slice(0, rows) if region is None else slice(*region[0].indices(rows)[:2])


def _widen(
    region: tuple[slice, ...] | None, axis: int, size: int, unit: int
) -> tuple[slice, slice]:
    """The range of ``region`` along ``axis`` widened to
    whole quantization units, and where it lies in that."""
    start, stop = (
        (0, size) if region is None or len(region) <= axis else region[axis].indices(size)[:2]
    )
    low = start - start % unit
    high = min(size, -(-stop // unit) * unit)
    return slice(low, high), slice(start - low, stop - low)


def _ignored(name: str) -> bool:
    return name.endswith(IGNORED_SUFFIXES) or name.startswith(IGNORED_PREFIXES)


def _header(file: Path) -> tuple[int, dict[str, Any]]:
    """(data start, header) of a shard; cached per file
    version, so a rewritten shard is read afresh."""
    stat = file.stat()
    return _read_header(file, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _read_header(file: Path, mtime_ns: int, size: int) -> tuple[int, dict[str, Any]]:
    with file.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return 8 + size, json.loads(f.read(size))


def _read_float8(info: TensorInfo, region: tuple[slice, ...] | None) -> np.ndarray:
    """An F8_E4M3 tensor (or its region) through a memory
    map of the shard, as ml_dtypes float8_e4m3fn."""
    data_start, header = _header(info.file)
    begin, end = header[info.stored_name]["data_offsets"]
    raw = np.memmap(info.file, np.uint8, "r", offset=data_start + begin, shape=(end - begin,))
    tensor = raw.view(ml_dtypes.float8_e4m3fn).reshape(info.shape)
    return np.array(tensor if region is None else tensor[region])
