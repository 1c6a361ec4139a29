"""How each jaxdd parameter relates to HF tensors, for the
Kimi target and the DFlash drafter, in both directions.

One table per model (``target_mappings``, ``drafter_mappings``): HF keeps
``nn.Linear`` weights as [out, in], jaxdd as [in, out] with heads and experts as their
own axes. Loading (``jaxdd.weights.hf_reader``), the streaming converter and the
exporter in ``convert/`` all read the same table; each entry also says where a range
of a jaxdd axis lies in the HF tensors, so that one device's part is read alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np

from jaxdd.config import DrafterConfig, KimiConfig
from jaxdd.models.quant import DENSE, ExpertFormat


class Axis(NamedTuple):
    """Where a range of one jaxdd axis lies in the HF tensors: ``scale`` rows (``hf`` 0) or columns
    (``hf`` 1) of each per index, or (``hf`` None) which of the stacked tensors (one per expert)."""

    hf: int | None
    scale: int = 1


STACK = Axis(None)


class Mapping(NamedTuple):
    """jaxdd parameters ``paths`` <-> HF tensors ``names`` (with ``shapes``); ``forward``
    maps HF arrays to jaxdd arrays, ``backward`` the other way. ``layouts``: for each path,
    where each of its axes lies in the HF tensors (None: nowhere contiguous), so that one
    device's part is read alone. ``raw`` names are read as stored (quantized pieces), the
    others as dense weights (dequantized if the checkpoint stores them quantized).
    ``forward`` works on such parts too: it never assumes the full head or expert count."""

    paths: tuple[tuple, ...]
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    forward: Callable[..., tuple[np.ndarray, ...]]
    backward: Callable[..., tuple[np.ndarray, ...]]
    layouts: tuple[tuple[Axis | None, ...], ...]
    raw: bool = False


def _single(
    path: tuple, name: str, shape: tuple[int, ...], fwd: Callable, bwd: Callable, layout: tuple
) -> Mapping:
    """One HF tensor <-> one jaxdd parameter, through ``fwd`` and back through ``bwd``."""
    return Mapping((path,), (name,), (shape,), lambda w: (fwd(w),), lambda w: (bwd(w),), (layout,))


def _unchanged(path: tuple, name: str, shape: tuple[int, ...]) -> Mapping:
    return _single(
        path, name, shape, lambda w: w, lambda w: w, tuple(Axis(i) for i in range(len(shape)))
    )


def _linear(path: tuple, name: str, shape: tuple[int, ...]) -> Mapping:
    return _single(path, name, shape, lambda w: w.T, lambda w: w.T, (Axis(1), Axis(0)))


def _heads_in(path: tuple, name: str, shape: tuple[int, ...], heads: int) -> Mapping:
    """[heads * d, in] <-> [in, heads, d]."""
    d = shape[0] // heads
    fwd = lambda w: w.T.reshape(w.shape[1], -1, d)
    bwd = lambda w: w.reshape(len(w), -1).T
    return _single(path, name, shape, fwd, bwd, (Axis(1), Axis(0, d), None))


def _heads_out(path: tuple, name: str, shape: tuple[int, ...], heads: int) -> Mapping:
    """[out, heads * d] <-> [heads, d, out]."""
    d = shape[1] // heads
    fwd = lambda w: w.T.reshape(-1, d, w.shape[0])
    bwd = lambda w: w.reshape(-1, w.shape[2]).T
    return _single(path, name, shape, fwd, bwd, (Axis(1, d), None, Axis(0)))


def _stacked(
    path: tuple, names: list[str], shape: tuple[int, ...], transpose: bool, raw: bool = False
) -> Mapping:
    """One HF tensor per expert <-> [E, ...] (transposed to [in, out] for dense weights)."""

    def forward(*ws):
        return (np.stack([w.T if transpose else w for w in ws]),)

    def backward(stack):
        return tuple(w.T if transpose else w for w in stack)

    layout = (STACK, Axis(1), Axis(0)) if transpose else (STACK, Axis(0), Axis(1))
    return Mapping((path,), tuple(names), (shape,) * len(names), forward, backward, (layout,), raw)


def target_mappings(config: KimiConfig, experts: ExpertFormat = DENSE) -> Iterator[Mapping]:
    """How every jaxdd target parameter relates to the HF checkpoint's tensors, layer by layer."""
    c = config
    d = c.hidden_size
    h = c.num_attention_heads
    dn = c.qk_nope_head_dim
    dr = c.qk_rope_head_dim
    per_head = dn + c.v_head_dim  # kv_b_proj rows per head
    yield _unchanged(("embed",), "model.embed_tokens.weight", (c.vocab_size, d))
    for i in range(c.num_hidden_layers):
        hf = f"model.layers.{i}."
        jx = ("layers", i)
        a = hf + "self_attn."
        attn = (*jx, "attn")
        yield _unchanged((*jx, "attn_norm", "weight"), hf + "input_layernorm.weight", (d,))
        yield _unchanged((*jx, "mlp_norm", "weight"), hf + "post_attention_layernorm.weight", (d,))
        yield _linear((*attn, "q_a_proj"), a + "q_a_proj.weight", (c.q_lora_rank, d))
        yield _unchanged(
            (*attn, "q_a_norm", "weight"), a + "q_a_layernorm.weight", (c.q_lora_rank,)
        )
        yield _heads_in(
            (*attn, "q_b_proj"), a + "q_b_proj.weight", (h * (dn + dr), c.q_lora_rank), h
        )
        yield _linear(
            (*attn, "kv_a_proj"), a + "kv_a_proj_with_mqa.weight", (c.kv_lora_rank + dr, d)
        )
        yield _unchanged(
            (*attn, "kv_a_norm", "weight"), a + "kv_a_layernorm.weight", (c.kv_lora_rank,)
        )
        # kv_b_proj [heads * (nope + v), latent]: each head's key half, then its value half
        yield Mapping(
            ((*attn, "k_up"), (*attn, "v_up")),
            (a + "kv_b_proj.weight",),
            ((h * per_head, c.kv_lora_rank),),
            lambda w: (
                w.reshape(-1, per_head, w.shape[1])[:, :dn].transpose(0, 2, 1),
                w.reshape(-1, per_head, w.shape[1])[:, dn:],
            ),
            lambda k, v: (np.concatenate([k.transpose(0, 2, 1), v], 1).reshape(-1, k.shape[1]),),
            ((Axis(0, per_head), Axis(1), None), (Axis(0, per_head), None, Axis(1))),
        )
        yield _heads_out((*attn, "o_proj"), a + "o_proj.weight", (d, h * c.v_head_dim), h)
        m = hf + "mlp."
        mlp = (*jx, "mlp")
        if not c.is_moe_layer(i):
            yield from _mlp(mlp, m, d, c.intermediate_size)
            continue
        yield _linear((*mlp, "router", "weight"), m + "gate.weight", (c.n_routed_experts, d))
        yield _unchanged(
            (*mlp, "router", "bias"), m + "gate.e_score_correction_bias", (c.n_routed_experts,)
        )
        f = c.moe_intermediate_size
        for proj, (n_out, n_in) in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
            base = [f"{m}experts.{e}.{proj}_proj." for e in range(c.n_routed_experts)]
            yield from _experts((*mlp, proj), base, n_out, n_in, experts)
        if c.n_shared_experts:
            yield from _mlp((*mlp, "shared"), m + "shared_experts.", d, f * c.n_shared_experts)
    yield _unchanged(("final_norm", "weight"), "model.norm.weight", (d,))
    yield _linear(("lm_head",), "lm_head.weight", (c.vocab_size, d))


def _mlp(path: tuple, hf: str, d: int, f: int) -> Iterator[Mapping]:
    for proj, shape in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
        yield _linear((*path, proj), f"{hf}{proj}_proj.weight", shape)


def _experts(
    path: tuple, base: list[str], n_out: int, n_in: int, fmt: ExpertFormat
) -> Iterator[Mapping]:
    """Routed experts of one projection: dense [E, in, out],
    or the stored quantized pieces stacked as they are."""
    if fmt.kind == "dense":
        yield _stacked(
            (*path, "weight"), [b + "weight" for b in base], (n_out, n_in), transpose=True
        )
    elif fmt.kind == "int4":
        packed = (n_out, -(-n_in // 8))
        scale = (n_out, n_in // fmt.group)
        yield _stacked(
            (*path, "packed"),
            [b + "weight_packed" for b in base],
            packed,
            transpose=False,
            raw=True,
        )
        yield _stacked(
            (*path, "scale"), [b + "weight_scale" for b in base], scale, transpose=False, raw=True
        )
    else:
        blocks = (-(-n_out // fmt.block), -(-n_in // fmt.block))
        yield _stacked(
            (*path, "weight"),
            [b + "weight" for b in base],
            (n_out, n_in),
            transpose=False,
            raw=True,
        )
        yield _stacked(
            (*path, "scale_inv"),
            [b + "weight_scale_inv" for b in base],
            blocks,
            transpose=False,
            raw=True,
        )


def drafter_mappings(config: DrafterConfig) -> Iterator[Mapping]:
    """How every drafter parameter relates to a z-lab ``DFlashDraftModel`` checkpoint."""
    c = config
    d = c.hidden_size
    n = c.num_attention_heads
    k = c.num_key_value_heads
    h = c.head_dim
    yield _linear(("fc",), "fc.weight", (d, len(c.target_layer_ids) * d))
    yield _unchanged(("hidden_norm", "weight"), "hidden_norm.weight", (d,))
    yield _unchanged(("norm", "weight"), "norm.weight", (d,))
    for i in range(c.num_hidden_layers):
        hf = f"layers.{i}."
        jx = ("layers", i)
        a = hf + "self_attn."
        attn = (*jx, "attn")
        yield _unchanged((*jx, "attn_norm", "weight"), hf + "input_layernorm.weight", (d,))
        yield _unchanged((*jx, "mlp_norm", "weight"), hf + "post_attention_layernorm.weight", (d,))
        yield _heads_in((*attn, "q_proj"), a + "q_proj.weight", (n * h, d), n)
        yield _heads_in((*attn, "k_proj"), a + "k_proj.weight", (k * h, d), k)
        yield _heads_in((*attn, "v_proj"), a + "v_proj.weight", (k * h, d), k)
        yield _heads_out((*attn, "o_proj"), a + "o_proj.weight", (d, n * h), n)
        yield _unchanged((*attn, "q_norm", "weight"), a + "q_norm.weight", (h,))
        yield _unchanged((*attn, "k_norm", "weight"), a + "k_norm.weight", (h,))
        yield from _mlp((*jx, "mlp"), hf + "mlp.", d, c.intermediate_size)
