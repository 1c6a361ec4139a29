"""The PyTorch references that cross-checks run: HF greedy decoding, z-lab
``dflash_generate``, and a DDTree loop on HF transformers models written here (ours,
not the paper authors'). Needs the ``reference`` extra (torch, transformers, dflash).

The DDTree loop follows the paper's ``ddtree_generate`` (liranringel/ddtree): draft
exactly as z-lab ``dflash_generate``, build the tree with the paper's heap
(``jaxdd.decoding.tree.build_tree_host``, a plain port), verify all nodes in one HF target
forward with a 4-D mask (whole prefix + ancestors) at positions start + depth, follow the
target's argmax down the tree, compact the accepted path's cache rows, and feed the path's
features to the drafter. Limits and stop tokens follow ``dflash_generate``. Greedy only,
batch 1; ``dflash_generate`` runs on the models' device, the other loops on CPU.

Each run can ``record`` what happened per round: the drafter's logits and, for DDTree, the tree.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from pathlib import Path

import dflash.model
import numpy as np
import torch
from dflash.model import (
    DFlashDraftModel,
    _crop_to,
    _make_cache,
    _raw_input_embeddings,
    extract_context_feature,
)
from transformers import DeepseekV3ForCausalLM

from jaxdd.decoding.sampling import GREEDY, Sampling
from jaxdd.decoding.tree import build_tree_host


def load_reference_models(
    target_dir: str | Path, drafter_dir: str | Path | None = None, device: str = "cpu"
):
    """(HF ``DeepseekV3ForCausalLM``, z-lab ``DFlashDraftModel`` or
    None) from HF-layout directories, fp32, eval, on ``device``."""
    target = (
        DeepseekV3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval().to(device)
    )
    drafter = None
    if drafter_dir is not None:
        drafter = DFlashDraftModel.from_pretrained(drafter_dir).float().eval().to(device)
    return target, drafter


def _compact(cache, start: int, path: list[int]) -> None:
    """Move the rows of the accepted path (tree node i sits
    at start + i) to start .. start + len(path) - 1."""
    index = torch.tensor([start + i for i in path])
    for layer in cache.layers:
        for name in ("keys", "values"):
            rows = getattr(layer, name)
            rows[..., start : start + len(path), :] = rows.index_select(-2, index)
    _crop_to(cache, start + len(path))


@torch.inference_mode()
def ar_reference(
    target, prompt, max_new_tokens: int, stop_token_ids
) -> tuple[list[int], list[int]]:
    """Greedy decoding with HF's KV cache: (new tokens,
    one per round), stopping after a stop token."""
    cache = _make_cache(target.config)
    ids = list(prompt)
    stops = set(stop_token_ids or [])
    new = ids
    for _ in range(max_new_tokens):
        logits = target(torch.tensor([new]), past_key_values=cache, use_cache=True).logits
        new = [int(logits[0, -1].argmax())]
        ids += new
        if new[0] in stops:
            break
    tokens = ids[len(prompt) :]
    return tokens, [1] * (len(tokens) - 1)


@dataclasses.dataclass(frozen=True)
class Generation:
    """What a speculative reference loop generates: up to ``max_new_tokens`` tokens in blocks of
    ``block_size``, ending at any of ``stop_token_ids`` (None: at none); DDTree's trees of
    ``budget`` nodes."""

    max_new_tokens: int
    block_size: int
    stop_token_ids: list[int] | None = None
    budget: int | None = None


@torch.inference_mode()
def dflash_reference(
    drafter,
    target,
    prompt,
    generation: Generation,
    record=None,
    timings: dict | None = None,
    sampling: Sampling = GREEDY,
):
    """z-lab dflash_generate on the models' device: (new tokens, per-round acceptance lengths);
    greedy, or sampled with ``sampling``'s settings (torch's generator seeded with its seed).

    ``timings``, if given, receives the reference's own clock: prefill_seconds
    (its time to first token) and decode_seconds (the rest)."""
    if target.device.type == "cpu":  # the reference times itself with torch.cuda.synchronize
        dflash.model._cuda_time = time.perf_counter
    compute_logits = drafter.compute_logits
    if record is not None:  # record each round's draft logits without touching the algorithm

        def recording(hidden, head):
            logits = compute_logits(hidden, head)
            record["draft_logits"].append(logits[0].float().cpu().numpy())
            return logits

        drafter.compute_logits = recording
    torch.manual_seed(sampling.seed)
    try:
        result = dflash.model.dflash_generate(
            drafter,
            target,
            torch.tensor([list(prompt)], device=target.device),
            max_new_tokens=generation.max_new_tokens,
            stop_token_ids=generation.stop_token_ids,
            block_size=generation.block_size,
            return_stats=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
        )
    finally:
        drafter.compute_logits = compute_logits
    if timings is not None:
        timings["prefill_seconds"] = result.time_to_first_token
        timings["decode_seconds"] = result.time_per_output_token * result.num_output_tokens
    return result.output_ids[0, len(prompt) :].tolist(), list(result.acceptance_lengths)


def new_record() -> defaultdict:
    return defaultdict(list)


@torch.inference_mode()
def ddtree_reference(drafter, target, prompt, generation: Generation, record=None):
    """(new tokens, per-round acceptance lengths) of greedy DDTree decoding."""
    max_new_tokens, block_size = generation.max_new_tokens, generation.block_size
    budget, stop_token_ids = generation.budget, generation.stop_token_ids
    num_input = len(prompt)
    max_length = num_input + max_new_tokens
    input_ids = torch.tensor([list(prompt)])
    output_ids = torch.full((1, max_length + 1), drafter.mask_token_id, dtype=torch.long)
    position_ids = torch.arange(output_ids.shape[1])[None]
    target_cache = _make_cache(target.config)
    draft_cache = _make_cache(drafter.config)

    out = target(input_ids, past_key_values=target_cache, use_cache=True, output_hidden_states=True)
    output_ids[:, :num_input] = input_ids
    output_ids[:, num_input] = out.logits[0, -1].argmax()
    target_hidden = extract_context_feature(out.hidden_states, drafter.target_layer_ids)
    stops = set(stop_token_ids or [])
    start = num_input
    lengths = []
    stopped = int(output_ids[0, start]) in stops
    while start + 1 < max_length and not stopped:
        verify_size = min(block_size, max_length - start)
        block = output_ids[:, start : start + verify_size].clone()
        noise = _raw_input_embeddings(target, block)
        hidden = drafter(
            target_hidden=target_hidden,
            noise_embedding=noise,
            position_ids=position_ids[:, start - target_hidden.shape[1] : start + verify_size],
            past_key_values=draft_cache,
            use_cache=True,
        )[:, 1 - verify_size :, :]
        _crop_to(draft_cache, start)
        draft_logits = drafter.compute_logits(hidden, target.lm_head)[0].float().numpy()

        tree = build_tree_host(draft_logits, budget)
        nodes = len(tree.tokens) + 1
        parents = tree.parents
        if record is not None:
            record["draft_logits"].append(draft_logits)
            record["trees"].append(
                (np.array([int(block[0, 0]), *tree.tokens]), np.asarray(parents))
            )
        visible = np.eye(nodes, dtype=bool)
        for i in range(1, nodes):
            visible[i] |= visible[parents[i]]
        mask = torch.zeros((1, 1, nodes, start + nodes))
        mask[0, 0, :, start:][~torch.from_numpy(visible)] = torch.finfo(torch.float32).min
        tokens = torch.tensor([[int(block[0, 0]), *tree.tokens.tolist()]])
        depths = torch.tensor([[0, *tree.depths.tolist()]])
        out = target(
            tokens,
            attention_mask=mask,
            position_ids=start + depths,
            past_key_values=target_cache,
            use_cache=True,
            output_hidden_states=True,
        )
        choice = out.logits[0].argmax(-1).tolist()
        children = {}
        for i in range(1, nodes):
            children.setdefault(int(parents[i]), {})[int(tokens[0, i])] = i
        path = [0]
        while choice[path[-1]] in children.get(path[-1], {}):
            path.append(children[path[-1]][choice[path[-1]]])
        # accepted drafts (= the target's choices) then the bonus
        emitted = [choice[i] for i in path]
        produced = min(len(path), max_length - start - 1)
        for i, token in enumerate(emitted[:produced]):
            if token in stops:
                produced = i + 1
                stopped = True
                break
        output_ids[0, start + 1 : start + 1 + produced] = torch.tensor(emitted[:produced])
        _compact(target_cache, start, path[:produced])
        features = extract_context_feature(out.hidden_states, drafter.target_layer_ids)
        target_hidden = features[:, path[:produced], :]
        start += produced
        lengths.append(produced)
    return output_ids[0, num_input : min(start + 1, max_length)].tolist(), lengths


@torch.inference_mode()
def teacher_forced(
    target, sequence: list[int], logit_positions: list[int], hidden_positions: list[int], topk: int
):
    """One HF forward over ``sequence``: top-k logits (ids, values,
    logsumexp) at ``logit_positions`` and the residual stream after every
    layer but the last (HF's last hidden state is final-normed) at
    ``hidden_positions``: hidden [layers - 1, len(hidden_positions), D]."""
    out = target(torch.tensor([sequence]), output_hidden_states=True)
    logits = out.logits[0, logit_positions].float()
    values, ids = torch.topk(logits, topk, dim=-1)
    hidden = torch.stack([h[0, hidden_positions] for h in out.hidden_states[1:-1]]).float()
    return ids.numpy(), values.numpy(), torch.logsumexp(logits, -1).numpy(), hidden.numpy()
