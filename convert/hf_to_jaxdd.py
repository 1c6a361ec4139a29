"""HF checkpoint directory -> jaxdd checkpoint, streamed
one group (a layer, the embedding, the head) at a time.

Everything is validated from the shard headers before anything is written; the
output appears atomically (``jaxdd.weights.checkpoint.write_checkpoint``), so
an interrupted or failed run leaves nothing jaxdd would load.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxdd.config import DrafterConfig, KimiConfig, in_file
from jaxdd.models.drafter import abstract_drafter
from jaxdd.models.quant import ExpertFormat
from jaxdd.models.target import abstract_target
from jaxdd.weights.checkpoint import (
    CheckpointHeader,
    Kind,
    get_path,
    set_path,
    write_checkpoint,
)
from jaxdd.weights.hf_loader import convert_arrays, mtp_layers
from jaxdd.weights.hf_mappings import Mapping, drafter_mappings, target_mappings
from jaxdd.weights.hf_reader import HFCheckpoint
from jaxdd.weights.tokenizer import tokenizer_files


@dataclasses.dataclass
class Summary:
    kind: Kind
    parameters: int = 0
    tensors_read: int = 0
    bytes_read: int = 0
    bytes_by_dtype: Counter = dataclasses.field(default_factory=Counter)
    seconds: float = 0.0
    experts: str | None = None  # targets: how the routed experts are stored

    def __str__(self) -> str:
        stored = ", ".join(
            f"{dtype} {n / 1e6:.1f} MB" for dtype, n in sorted(self.bytes_by_dtype.items())
        )
        rate = self.bytes_read / 1e6 / max(self.seconds, 1e-9)
        experts = f"routed experts {self.experts}; " if self.experts else ""
        return (
            f"converted a {self.kind}: {self.parameters:,} parameters; {experts}stored {stored}; "
            f"read {self.tensors_read:,} tensors, {self.bytes_read / 1e6:.1f} MB "
            f"in {self.seconds:.1f} s ({rate:.0f} MB/s)"
        )


def is_drafter_config(raw: dict[str, Any]) -> bool:
    return "dflash_config" in raw or "DFlashDraftModel" in (raw.get("architectures") or [])


def convert(
    source_dir: str | Path,
    output_dir: str | Path,
    dtype: str | jnp.dtype = "bfloat16",
    dequantize_experts: bool = False,
    progress: bool = True,
) -> Summary:
    """Convert an HF target (plain, FP8 blocks, INT4 pack-quantized) or DFlash drafter checkpoint.

    dtype: for the floating weights (the router stays fp32); quantized
    routed experts stay as stored unless ``dequantize_experts``.
    """
    start = time.perf_counter()
    dtype = jnp.dtype(dtype)
    source = HFCheckpoint(source_dir)
    if Path(output_dir).exists():
        raise FileExistsError(
            f"{Path(output_dir).absolute()} already exists; choose a new directory"
        )
    experts: ExpertFormat | None = None
    if is_drafter_config(source.raw_config):
        kind: Kind = "drafter"
        config = in_file(source.config_path, DrafterConfig.from_hf, source.raw_config)
        mappings = list(drafter_mappings(config))
        source.check(mappings)
        abstract = abstract_drafter(config, dtype)[1]
        stored_config = source.raw_config
    else:
        kind = "target"
        config = in_file(source.config_path, KimiConfig.from_hf, source.raw_config)
        stored = source.stored_expert_format()
        experts = ExpertFormat(router=stored.router) if dequantize_experts else stored
        mappings = list(target_mappings(config, experts))
        source.check(mappings, ignored=mtp_layers(config))
        abstract = abstract_target(config, dtype, experts)[1]
        stored_config = config.to_hf()

    summary = Summary(kind, experts=experts.kind if experts else None)
    total = sum(source.nbytes(m) for m in mappings)
    with tqdm(
        total=total, unit="B", unit_scale=True, desc=f"converting {kind}", disable=not progress
    ) as bar:
        groups = _groups(source, mappings, nnx.to_pure_dict(abstract), summary, bar)
        stored = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(abstract))
        extra = tokenizer_files(source_dir)
        header = CheckpointHeader(kind, stored_config, dtype, experts)
        write_checkpoint(output_dir, header, groups, extra, expected_bytes=stored)
    summary.seconds = time.perf_counter() - start
    return summary


def _group_of(mapping: Mapping) -> tuple:
    path = mapping.paths[0]
    return path[:2] if path[0] == "layers" else path[:1]


def _groups(
    source: HFCheckpoint, mappings: list[Mapping], abstract: dict, summary: Summary, bar: tqdm
) -> Iterator[tuple[str, Any]]:
    """Build each group's arrays only when the writer asks
    for it (the tables list parameters group by group)."""
    for prefix, group_mappings in itertools.groupby(mappings, _group_of):
        tree = {"value": jax.tree.map(lambda leaf: leaf, get_path(abstract, prefix))}
        for mapping in group_mappings:
            for path, array in convert_arrays(source, mapping, abstract):
                set_path(tree, ("value", *path[len(prefix) :]), array)
                summary.parameters += array.size
                summary.bytes_by_dtype[array.dtype.name] += array.nbytes
            bar.update(source.nbytes(mapping))
            summary.bytes_read += source.nbytes(mapping)
            summary.tensors_read += len(mapping.names)
            bar.set_postfix(
                group=".".join(map(str, prefix)), tensors=summary.tensors_read, refresh=False
            )
        leftover = [leaf for leaf in jax.tree.leaves(tree) if not isinstance(leaf, np.ndarray)]
        assert not leftover, f"the table leaves {len(leftover)} parameters of {prefix} unset"
        yield ".".join(map(str, prefix)), tree["value"]
