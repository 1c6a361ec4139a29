"""What a cross-check records per prompt, and its file
format (one compressed ``.npz``: arrays + a JSON header).

Both sides fill the same ``PromptTrace``: the PyTorch references when dumping, jaxdd when comparing.
"""

from __future__ import annotations

import dataclasses
import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "jaxdd-crosscheck-1"


@dataclasses.dataclass
class PromptTrace:
    prompt: np.ndarray  # [P] token ids
    tokens: np.ndarray  # [N] new tokens
    acceptance: np.ndarray  # [R] tokens per round
    # Per round: the drafter's top-k tokens per block
    # position, -1 where the round's block was shorter.
    draft_topk: np.ndarray  # [R, block - 1, k] (empty for ``ar``)
    # Per round (DDTree): the tree, root first, -1
    # padded; ``tree_parents`` index into it (root: -1).
    tree_tokens: np.ndarray  # [R, budget + 1]
    tree_parents: np.ndarray  # [R, budget + 1]
    # Teacher-forced target over prompt + tokens: the
    # next-token logits at ``logit_positions`` (top-k).
    logit_positions: np.ndarray  # [S]
    logit_ids: np.ndarray  # [S, k]
    logit_values: np.ndarray  # [S, k] fp32
    logsumexp: np.ndarray  # [S]
    hidden_positions: np.ndarray  # [H]
    hidden: np.ndarray  # [layers - 1, H, D]: residual stream after each layer but the last


def save_traces(path: str | Path, meta: dict[str, Any], traces: list[PromptTrace]) -> Path:
    """Write atomically (a temporary file renamed into place)."""
    path = Path(path)
    arrays = {"header": np.array(json.dumps({"format": FORMAT, **meta}))}
    for i, trace in enumerate(traces):
        arrays |= {f"{i}/{field}": value for field, value in dataclasses.asdict(trace).items()}
    partial = path.with_name(path.name + ".partial")
    with partial.open("wb") as f:
        np.savez_compressed(f, **arrays)
    partial.rename(path)
    return path


def load_traces(path: str | Path) -> tuple[dict[str, Any], list[PromptTrace]]:
    """The reference in ``path``; a ValueError naming the
    file when it is not one (truncated, empty, foreign)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
        meta = json.loads(str(arrays["header"]))
    except FileNotFoundError:
        raise
    except (OSError, EOFError, KeyError, ValueError, zipfile.BadZipFile) as error:
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
        raise ValueError(f"{path}: not a readable jaxdd cross-check reference ({reason})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise ValueError(f"{path}: not a jaxdd cross-check reference (format {found!r})")
    count = len({key.split("/")[0] for key in arrays if "/" in key})
    fields = [f.name for f in dataclasses.fields(PromptTrace)]
    try:
        traces = [PromptTrace(**{f: arrays[f"{i}/{f}"] for f in fields}) for i in range(count)]
    except KeyError as error:
        raise ValueError(
            f"{path}: not a complete jaxdd cross-check reference (no {error})"
        ) from None
    return meta, traces


def pad_rows(rows: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    """Stack ragged int arrays into ``[len(rows), *shape]``, -1 where a row is shorter."""
    out = np.full((len(rows), *shape), -1, np.int32)
    for i, row in enumerate(rows):
        out[(i, *tuple(slice(0, n) for n in row.shape))] = row
    return out


def selected_positions(prompt_len: int, new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(logit positions: every position that predicts a new token; hidden
    positions: the first two, whose rope angles are zero and nonzero, the
    last prompt position and the last predicting position)."""
    logits = np.arange(prompt_len - 1, prompt_len - 1 + new_tokens)
    hidden = sorted({0, min(1, prompt_len - 1), prompt_len - 1, prompt_len + new_tokens - 2})
    return logits, np.array(hidden)
