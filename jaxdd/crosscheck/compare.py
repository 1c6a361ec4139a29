"""``compare``: rerun a dumped reference with jaxdd on
this backend and say where, if anywhere, it departs.

Checks, per prompt: generated tokens and per-round acceptance; the drafter's
per-round top-k and the DDTree trees (over the rounds whose inputs still agree);
teacher-forced target logits over the reference's own sequence (so numerics are
compared even after the tokens part); and the residual stream after every layer,
which localises a numerical fault to the first layer and position where it appears.

A token divergence is *explained* when the reference's own top-2 margin at that position
is within the dtype's tolerance, or within twice the logit difference actually measured
there (a near-tie that rounding may flip); anything else is *unexplained*. Unexplained
divergences, and teacher-forced logits beyond the tolerance, fail the check.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxdd.crosscheck.trace import PromptTrace, load_traces
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.runtime.buckets import bucket

# Relative tolerances (of the largest reference magnitude at that position) per jaxdd compute dtype:
# bf16 carries ~4e-3 rounding per op through every layer (what the test models show:
# benchmarks/README.md, "Measurements behind code choices").
TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-1}


@dataclasses.dataclass
class PromptReport:
    prompt: int
    tokens: int
    matching_tokens: int
    # first differing token: index, round, position, ids, margin, explained
    divergence: dict[str, Any] | None
    acceptance_equal: bool
    first_acceptance_difference: int | None  # round
    draft_rounds: int  # rounds compared (inputs still identical)
    draft_top1_agree: int
    draft_topk_agreement: float
    first_draft_difference: int | None  # round whose top-1 draft differs
    tree_rounds: int
    first_tree_difference: int | None
    logits_max_abs: float
    logits_mean_abs: float
    logits_max_rel: float
    first_logit_excess: dict[str, Any] | None  # position, relative error
    # layer, position, relative error, whether jaxdd's is non-finite
    first_hidden_excess: dict[str, Any] | None

    @property
    def unexplained(self) -> bool:
        """Tokens that diverge without a near-tie, acceptance lengths that differ while
        the rounds' inputs still agreed, or logits or hidden states out of tolerance."""
        diverged = self.divergence is not None and not self.divergence["explained"]
        excess = self.first_logit_excess is not None or self.first_hidden_excess is not None
        return diverged or excess or not self.acceptance_equal


@dataclasses.dataclass
class Report:
    method: str
    dtype: str
    backend: str
    tolerance: float
    prompts: list[PromptReport]
    inconsistency: str | None = None  # the reference's data do not fit its stated method

    @property
    def ok(self) -> bool:
        return self.inconsistency is None and not any(p.unexplained for p in self.prompts)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON values: a NaN or infinite number as the string
        "NaN", "Infinity" or "-Infinity" (JSON has no such numbers)."""
        out = dataclasses.asdict(self)
        out["ok"] = self.ok
        for entry, prompt in zip(out["prompts"], self.prompts, strict=True):
            entry["unexplained"] = prompt.unexplained
        return _json_numbers(out)

    def __str__(self) -> str:
        lines = [
            f"jaxdd cross-check: {self.method}, jaxdd {self.dtype} on {self.backend} vs "
            f"the PyTorch reference"
        ]
        if self.inconsistency is not None:
            lines.append(f"reference: {self.inconsistency}")
        for p in self.prompts:
            lines.append(f"prompt {p.prompt}: " + "; ".join(_prompt_lines(p, self.tolerance)))
        bad = sum(p.unexplained for p in self.prompts)
        if self.ok:
            lines.append("result: OK")
        else:
            why = [f"{bad} prompt(s) with unexplained divergence"] if bad else []
            why += ["the reference contradicts its method"] if self.inconsistency else []
            lines.append(f"result: FAIL ({'; '.join(why)})")
        return "\n".join(lines)


def _json_numbers(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _json_numbers(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_numbers(v) for v in value]
    if isinstance(value, float) and not np.isfinite(value):
        return "NaN" if np.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def _prompt_lines(p: PromptReport, tolerance: float) -> list[str]:
    out = []
    if p.divergence is None:
        out.append(f"tokens {p.tokens}/{p.tokens} identical")
    else:
        d = p.divergence
        why = "near-tie, explained" if d["explained"] else "UNEXPLAINED"
        out.append(
            f"tokens {p.matching_tokens}/{p.tokens} identical, first divergence at token "
            f"{d['index']} "
            f"(round {d['round']}, position {d['position']}): reference {d['reference']}, "
            f"jaxdd {d['jaxdd']}; "
            f"reference top-2 margin {d['margin']:.2e} vs tolerance {tolerance:.0e} ({why})"
        )
    if p.acceptance_equal:
        out.append("acceptance identical")
    else:
        out.append(f"acceptance first differs in round {p.first_acceptance_difference}")
    if p.draft_rounds:
        draft = (
            f"draft top-1 {p.draft_top1_agree}/{p.draft_rounds} rounds, top-k "
            f"{p.draft_topk_agreement:.1%}"
        )
        if p.first_draft_difference is not None:
            draft += f", first differs in round {p.first_draft_difference}"
        out.append(draft)
    if p.tree_rounds:
        same = p.first_tree_difference is None
        out.append(
            f"trees identical ({p.tree_rounds} rounds)"
            if same
            else f"trees first differ in round {p.first_tree_difference}"
        )
    out.append(
        f"logits max |d| {p.logits_max_abs:.1e} (rel {p.logits_max_rel:.1e}), mean "
        f"{p.logits_mean_abs:.1e}"
    )
    if p.first_logit_excess is not None:
        e = p.first_logit_excess
        out.append(
            f"target logits first exceed tolerance at position {e['position']} (rel {e['rel']:.1e})"
        )
    if p.first_hidden_excess is not None:
        e = p.first_hidden_excess
        if e.get("non_finite"):
            out.append(
                f"hidden states are NaN or infinite after layer {e['layer']} (position "
                f"{e['position']})"
            )
        else:
            out.append(
                f"hidden states first exceed it after layer {e['layer']} at position "
                f"{e['position']} "
                f"(rel {e['rel']:.1e})"
            )
    return out


def compare(
    reference_path,
    dtype: str = "float32",
    target_dir=None,
    drafter_dir=None,
    devices: int = 1,
    moe: str = "tp",
) -> Report:
    """Run jaxdd (on this process's devices, ``dtype``) on the reference's inputs
    and compare. The models are the ones the reference names, or ``target_dir`` /
    ``drafter_dir`` (a reference dumped on another machine); with ``devices`` > 1
    they are loaded onto that many devices (``moe``: tp or ep)."""
    import jaxdd

    meta, traces = load_traces(reference_path)
    drafter_path = drafter_dir or meta["drafter"] if meta["method"] != "ar" else None
    target, drafter = jaxdd.load_pair(
        target_dir or meta["target"], drafter_path, dtype, devices, moe
    )
    decoder = SpeculativeDecoder(target, drafter)
    tolerance = TOLERANCE[dtype]
    reports = [
        _compare_prompt(i, t, meta, target, decoder, tolerance) for i, t in enumerate(traces)
    ]
    return Report(
        meta["method"],
        dtype,
        decoder.backend.platform,
        tolerance,
        reports,
        _inconsistency(meta, traces),
    )


def _inconsistency(meta, traces: list[PromptTrace]) -> str | None:
    """What in the reference contradicts its method: drafts without a
    drafter, trees without DDTree, or the other way round (greedy DFlash
    and DDTree emit the same tokens, so the tokens cannot tell)."""
    method = meta["method"]
    drafts = any(t.draft_topk.size and (t.draft_topk >= 0).any() for t in traces)
    trees = any(t.tree_tokens.size and (t.tree_tokens >= 0).any() for t in traces)
    rounds = sum(len(t.acceptance) for t in traces)
    if rounds and drafts != (method != "ar"):
        return f"method {method!r}, but it holds {'drafts' if drafts else 'no drafts'}"
    if rounds and trees != (method == "ddtree"):
        return f"method {method!r}, but it holds {'DDTree trees' if trees else 'no trees'}"
    return None


def _compare_prompt(
    index: int, ref: PromptTrace, meta, target, decoder, tolerance: float
) -> PromptReport:
    ours = _regenerate(ref, meta, decoder)
    first = _first_token_difference(ours.tokens, ref.tokens)
    # Rounds whose inputs still agree: up to and including
    # the round that produced the first divergence.
    ends = np.cumsum(ref.acceptance)
    last_round = (
        len(ref.acceptance) - 1
        if first is None
        else int(np.searchsorted(ends, max(first, 1) - 1, "right"))
    )
    acceptance = np.asarray(ours.acceptance_lengths)
    rounds = min(len(acceptance), len(ref.acceptance), last_round + 1)
    # a diverging round may accept otherwise
    same_inputs = rounds if first is None else min(rounds, last_round)
    acceptance_equal, first_acceptance = _acceptance_check(
        acceptance, ref.acceptance, same_inputs, first
    )
    draft_rounds = min(len(ours.draft_topk), len(ref.draft_topk), rounds)
    top1, topk_agreement, first_draft = _draft_agreement(
        ours.draft_topk, ref.draft_topk, draft_rounds
    )
    tree_rounds = min(len(ours.trees), len(ref.tree_tokens), rounds)
    first_tree = next(
        (
            r
            for r in range(tree_rounds)
            if _paths(*ours.trees[r]) != _paths(ref.tree_tokens[r], ref.tree_parents[r])
        ),
        None,
    )

    logits, hidden = _teacher_forced(target, ref)
    diff, rel = _logit_errors(logits, ref)
    excess = np.flatnonzero(~(rel <= tolerance))  # NaN compares false: it is an excess too
    first_logit = None
    if excess.size:
        first_logit = {
            "position": int(ref.logit_positions[excess[0]]),
            "rel": float(rel[excess[0]]),
        }

    divergence = None
    if first is not None:
        noise = float(diff[first].max()) if first < len(diff) else 0.0
        divergence = _divergence(ref, ours.tokens, first, last_round, tolerance, noise)

    first_hidden = None if hidden is None else first_hidden_excess(hidden, ref, tolerance)
    return PromptReport(
        prompt=index,
        tokens=len(ref.tokens),
        matching_tokens=len(ref.tokens) if first is None else first,
        divergence=divergence,
        acceptance_equal=bool(acceptance_equal),
        first_acceptance_difference=first_acceptance,
        draft_rounds=draft_rounds,
        draft_top1_agree=top1,
        draft_topk_agreement=topk_agreement,
        first_draft_difference=first_draft,
        tree_rounds=tree_rounds,
        first_tree_difference=first_tree,
        logits_max_abs=float(diff.max()),
        logits_mean_abs=float(diff.mean()),
        logits_max_rel=float(rel.max()),
        first_logit_excess=first_logit,
        first_hidden_excess=first_hidden,
    )


def _regenerate(ref: PromptTrace, meta, decoder):
    """jaxdd's own generation from the reference's prompt, with the reference's settings."""
    method = meta["method"]
    return decoder.generate(
        ref.prompt.tolist(),
        method=method,
        max_new_tokens=meta["max_new_tokens"],
        stop_token_ids=meta["stop_ids"],
        block_size=None if method == "ar" else meta["block_size"],
        budget=meta["budget"],
        trace_topk=0 if method == "ar" else meta["topk"],
    )


def _first_token_difference(ours: list[int], reference: np.ndarray) -> int | None:
    """The index of the first differing token; the
    shorter length when one is a prefix of the other."""
    n = min(len(ours), len(reference))
    differ = np.flatnonzero(np.asarray(ours[:n]) != reference[:n])
    return int(differ[0]) if differ.size else (n if len(ours) != len(reference) else None)


def _acceptance_check(
    acceptance: np.ndarray, reference: np.ndarray, same_inputs: int, first: int | None
) -> tuple[bool, int | None]:
    """Whether the acceptance lengths agree over the ``same_inputs`` rounds (and
    in count when no token differs), and the first round where they do not."""
    acc_diff = np.flatnonzero(acceptance[:same_inputs] != reference[:same_inputs])
    acceptance_equal = not acc_diff.size and (
        first is not None or len(acceptance) == len(reference)
    )
    first_acceptance = (
        int(acc_diff[0]) if acc_diff.size else None if acceptance_equal else same_inputs
    )
    return acceptance_equal, first_acceptance


def _draft_agreement(
    ours: list[np.ndarray], reference: np.ndarray, rounds: int
) -> tuple[int, float, int | None]:
    """Over the first ``rounds`` rounds: how many agree on every top-1 draft token,
    the mean top-k overlap, and the first round whose top-1 drafts differ."""
    top1 = 0
    topk = []
    first_draft = None
    for r in range(rounds):
        rows = int((reference[r][:, 0] >= 0).sum())  # the reference's block may be shorter
        a = ours[r][:rows]
        b = reference[r][:rows]
        same_top1 = bool((a[:, 0] == b[:, 0]).all())
        top1 += same_top1
        topk.append(
            np.mean([len(set(x) & set(y)) / len(y) for x, y in zip(a, b, strict=True)])
            if rows
            else 1.0
        )
        if not same_top1 and first_draft is None:
            first_draft = r
    return top1, float(np.mean(topk)) if topk else 1.0, first_draft


def _logit_errors(logits: np.ndarray, ref: PromptTrace) -> tuple[np.ndarray, np.ndarray]:
    """Absolute differences from the reference's top logits [positions, k], and each
    position's largest one relative to the reference's largest magnitude there."""
    ours_at_ids = np.take_along_axis(logits[ref.logit_positions], ref.logit_ids, axis=1)
    diff = np.abs(ours_at_ids - ref.logit_values)
    scale = np.maximum(np.abs(ref.logit_values).max(axis=1), 1e-30)
    return diff, diff.max(axis=1) / scale


def first_hidden_excess(
    hidden: np.ndarray, ref: PromptTrace, tolerance: float
) -> dict[str, Any] | None:
    """The first layer, then position, where jaxdd's residual stream departs from the reference's
    by more than ``tolerance`` or is not finite (a NaN compares false with any tolerance)."""
    ours_hidden = hidden[:, ref.hidden_positions]  # [layers - 1, H, D]
    scale = np.maximum(np.abs(ref.hidden).max(axis=-1), 1e-30)
    hidden_rel = np.abs(ours_hidden - ref.hidden).max(axis=-1) / scale  # [layers - 1, H]
    # layer-major order: the first layer, then its first position
    bad = np.argwhere(~(hidden_rel <= tolerance))
    if not bad.size:
        return None
    layer, h = (int(i) for i in bad[0])
    position = int(ref.hidden_positions[h])
    non_finite = not np.isfinite(ours_hidden[layer, h]).all()
    return {
        "layer": layer,
        "position": position,
        "rel": float(hidden_rel[layer, h]),
        "non_finite": non_finite,
    }


def _divergence(
    ref: PromptTrace, ours: list[int], index: int, round_: int, tolerance: float, noise: float
) -> dict[str, Any]:
    margin = float("inf")  # one side stopping earlier is never a near-tie
    scale = 1.0
    if index < min(len(ref.tokens), len(ours)):
        values = ref.logit_values[index]
        margin = float(values[0] - values[1])
        scale = float(np.abs(values).max())
    return {
        "index": index,
        "round": -1 if index == 0 else round_,  # token 0 comes from the prefill
        "position": int(len(ref.prompt) + index),
        "reference": int(ref.tokens[index]) if index < len(ref.tokens) else None,
        "jaxdd": int(ours[index]) if index < len(ours) else None,
        "margin": margin,
        "explained": margin <= max(tolerance * scale, 2 * noise),
    }


def _teacher_forced(target, ref: PromptTrace) -> tuple[np.ndarray, np.ndarray | None]:
    """jaxdd's fp32 logits [T, V] and residual stream
    [layers - 1, T, D] over the reference's sequence."""
    sequence = np.concatenate([ref.prompt, ref.tokens[:-1]])[None]
    layers = target.config.num_hidden_layers
    taps = tuple(range(layers - 1))
    out = target.forward(sequence, target.new_cache(1, bucket(sequence.shape[1])), taps=taps)
    logits = np.asarray(out.logits[0])
    if not taps:
        return logits, None
    hidden = (
        np.asarray(out.taps[0], np.float32)
        .reshape(sequence.shape[1], len(taps), -1)
        .transpose(1, 0, 2)
    )
    return logits, hidden


def _paths(tokens: np.ndarray, parents: np.ndarray) -> set[tuple[int, ...]]:
    """A tree as the set of root-to-node token paths
    (independent of node order and parent conventions)."""
    tokens = np.asarray(tokens)
    parents = np.asarray(parents)
    valid = int((tokens >= 0).sum())
    paths: list[tuple[int, ...]] = [(int(tokens[0]),)]
    for i in range(1, valid):
        paths.append((*paths[int(parents[i])], int(tokens[i])))
    return set(paths)
