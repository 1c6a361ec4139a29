"""``dump``: run the PyTorch references once (fp32,
CPU) and store what a jaxdd backend must reproduce."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from jaxdd.config import KimiConfig
from jaxdd.crosscheck.trace import PromptTrace, pad_rows, save_traces, selected_positions
from jaxdd.decoding.checks import check_tokens
from jaxdd.errors import InputError, read_json
from jaxdd.weights.tokenizer import load_tokenizer


def read_prompts(path: str | Path, target_dir: str | Path) -> list[list[int]]:
    """A JSON list of prompts: token-id lists, or strings
    (encoded with the target's tokenizer.json)."""
    prompts = read_json(path, InputError)
    if not isinstance(prompts, list) or not prompts:
        raise InputError(f"{path}: expected a non-empty JSON list of prompts")
    tokenizer = load_tokenizer(target_dir)
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise InputError(f"{path}: prompt {i} is text but {target_dir} has no tokenizer")
            prompt = tokenizer.encode(prompt)
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InputError(
                f"{path}: prompt {i} must be a non-empty list of token ids or a string"
            )
        out.append(list(prompt))
    return out


@dataclasses.dataclass(frozen=True)
class ReferenceRun:
    """What the references generate for each prompt: ``method`` for ``max_new_tokens`` tokens in
    blocks of ``block_size`` (None: the drafter's), DDTree trees of ``budget`` nodes (None: the
    block less one), stopping at ``stop_ids`` (None: the config's end-of-sequence ids), and the
    ``topk`` logits kept of each position."""

    method: str
    max_new_tokens: int = 32
    block_size: int | None = None
    budget: int | None = None
    stop_ids: tuple[int, ...] | None = None
    topk: int = 8


def dump(
    target_dir: str | Path,
    prompts: list[list[int]],
    out: str | Path,
    run: ReferenceRun,
    drafter_dir: str | Path | None = None,
) -> Path:
    """Generate ``run`` in PyTorch on every prompt and
    write the reference traces to ``out`` (.npz)."""
    import dflash
    import torch
    import transformers

    from jaxdd.crosscheck import torch_reference as ref

    method = run.method
    if method != "ar" and drafter_dir is None:
        raise InputError(f"method {method!r} needs a drafter")
    config = KimiConfig.from_json_file(Path(target_dir) / "config.json")
    _check_prompts(prompts, config.vocab_size)
    target, drafter = ref.load_reference_models(target_dir, drafter_dir if method != "ar" else None)
    block = (run.block_size or drafter.block_size) if drafter is not None else 1
    budget = (run.budget or block - 1) if method == "ddtree" else None
    stops = tuple(config.eos_token_ids if run.stop_ids is None else run.stop_ids)
    run = dataclasses.replace(run, block_size=block, budget=budget, stop_ids=stops)
    traces = [_trace_prompt(ref, target, drafter, prompt, run) for prompt in prompts]
    meta = {
        "method": method,
        "target": str(Path(target_dir).absolute()),
        "drafter": str(Path(drafter_dir).absolute()) if drafter_dir else None,
        "max_new_tokens": run.max_new_tokens,
        "block_size": block,
        "budget": budget,
        "stop_ids": list(stops),
        "topk": run.topk,
        "reference": {
            "dtype": "float32",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "dflash": getattr(dflash, "__version__", "unknown"),
        },
    }
    return save_traces(out, meta, traces)


def _check_prompts(prompts: list[list[int]], vocab_size: int) -> None:
    """Token ids outside the vocabulary, named by prompt (the
    references would fail on them with an IndexError)."""
    for i, prompt in enumerate(prompts):
        try:
            check_tokens(prompt, vocab_size)
        except InputError as error:
            raise InputError(f"prompt {i}: {error}") from None


def _trace_prompt(ref, target, drafter, prompt: list[int], run: ReferenceRun) -> PromptTrace:
    """One prompt's reference generation, its drafts and trees, and teacher-forced logits and
    hidden states, as ``run`` (its sizes resolved) says."""
    method, max_new_tokens, topk = run.method, run.max_new_tokens, run.topk
    block, budget, stops = run.block_size, run.budget, list(run.stop_ids)
    record = ref.new_record()
    if method == "ar":
        tokens, acceptance = ref.ar_reference(target, prompt, max_new_tokens, stops)
    elif method == "dflash":
        generation = ref.Generation(max_new_tokens, block, stops)
        tokens, acceptance = ref.dflash_reference(drafter, target, prompt, generation, record)
    else:
        generation = ref.Generation(max_new_tokens, block, stops, budget)
        tokens, acceptance = ref.ddtree_reference(drafter, target, prompt, generation, record)
    logit_positions, hidden_positions = selected_positions(len(prompt), len(tokens))
    sequence = prompt + tokens[:-1]
    ids, values, lse, hidden = ref.teacher_forced(
        target, sequence, logit_positions, hidden_positions, topk
    )
    # Stable descending order: among equal logits the
    # lower token id first, as jax.lax.top_k orders them.
    draft_topk = [
        np.argsort(-logits, axis=-1, kind="stable")[:, :topk] for logits in record["draft_logits"]
    ]
    trees = record["trees"]
    return PromptTrace(
        prompt=np.array(prompt, np.int32),
        tokens=np.array(tokens, np.int32),
        acceptance=np.array(acceptance, np.int32),
        draft_topk=pad_rows(draft_topk, (block - 1, topk)),
        tree_tokens=pad_rows([t for t, _ in trees], (budget + 1,) if budget else (0,)),
        tree_parents=pad_rows([p for _, p in trees], (budget + 1,) if budget else (0,)),
        logit_positions=logit_positions.astype(np.int32),
        logit_ids=ids.astype(np.int32),
        logit_values=values,
        logsumexp=lse,
        hidden_positions=hidden_positions.astype(np.int32),
        hidden=hidden,
    )
