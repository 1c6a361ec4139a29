"""Load HF-layout checkpoints (config.json + safetensors, bf16/fp32 as save_pretrained writes them): the Kimi
target and the z-lab DFlash drafter.

HF stores ``nn.Linear`` weights as [out, in]; jaxdd keeps [in, out] with heads and experts as their own axes.
``hf_to_jaxdd`` is the one place that knows the mapping. Quantized checkpoints (FP8 blocks, INT4
pack-quantized) go through the converter in ``convert/`` instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from jaxdd.config import DrafterConfig, KimiConfig
from jaxdd.drafter import DFlashDrafter, abstract_drafter
from jaxdd.errors import CheckpointError
from jaxdd.target import KimiTarget, abstract_target

# Junk buffers some exports carry, and vision parts of the K2.5/K2.6 wrapper.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
IGNORED_PREFIXES = ("vision_tower.", "mm_projector.")
WRAPPER_PREFIX = "language_model."


def safetensors_files(directory: Path) -> list[Path]:
    """The shards of a checkpoint: those the index names, or every *.safetensors file."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (directory / n).exists()]
        if missing:
            raise CheckpointError(f"{index} names missing shard(s): {', '.join(missing)}")
        return [directory / n for n in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files")
    return files


def read_tensors(directory: Path) -> dict[str, Callable[[], np.ndarray]]:
    """Lazy readers for every tensor, keyed by name with the K2.5 ``language_model.`` prefix stripped."""
    readers: dict[str, Callable[[], np.ndarray]] = {}
    for file in safetensors_files(directory):
        with safe_open(file, framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name.endswith(IGNORED_SUFFIXES) or name.startswith(IGNORED_PREFIXES):
                    continue
                key = name.removeprefix(WRAPPER_PREFIX)
                readers[key] = lambda file=file, name=name: safe_open(file, framework="numpy").get_tensor(name)
    return readers


class Mapping(NamedTuple):
    """One jaxdd parameter built from HF tensors that all have ``hf_shape``."""

    path: tuple
    hf_names: list[str]
    hf_shape: tuple[int, ...]
    build: Callable[..., np.ndarray]


def hf_to_jaxdd(config: KimiConfig) -> Iterator[Mapping]:
    """How every jaxdd target parameter is built from the HF checkpoint's tensors."""
    c = config
    d, h, dn, dr, dv = c.hidden_size, c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim

    def same(w):
        return w

    def t(w):
        return w.T

    def heads_in(w):  # [H*d, in] -> [in, H, d]
        return w.T.reshape(w.shape[1], h, -1)

    yield Mapping(("embed",), ["model.embed_tokens.weight"], (c.vocab_size, d), same)
    yield Mapping(("lm_head",), ["lm_head.weight"], (c.vocab_size, d), t)
    yield Mapping(("final_norm", "weight"), ["model.norm.weight"], (d,), same)
    for i in range(c.num_hidden_layers):
        hf, jx = f"model.layers.{i}.", ("layers", i)
        a = hf + "self_attn."
        yield Mapping((*jx, "attn_norm", "weight"), [hf + "input_layernorm.weight"], (d,), same)
        yield Mapping((*jx, "mlp_norm", "weight"), [hf + "post_attention_layernorm.weight"], (d,), same)
        attn = (*jx, "attn")
        yield Mapping((*attn, "q_a_proj"), [a + "q_a_proj.weight"], (c.q_lora_rank, d), t)
        yield Mapping((*attn, "q_a_norm", "weight"), [a + "q_a_layernorm.weight"], (c.q_lora_rank,), same)
        yield Mapping((*attn, "q_b_proj"), [a + "q_b_proj.weight"], (h * (dn + dr), c.q_lora_rank), heads_in)
        yield Mapping((*attn, "kv_a_proj"), [a + "kv_a_proj_with_mqa.weight"], (c.kv_lora_rank + dr, d), t)
        yield Mapping((*attn, "kv_a_norm", "weight"), [a + "kv_a_layernorm.weight"], (c.kv_lora_rank,), same)
        kv_b = [a + "kv_b_proj.weight"], (h * (dn + dv), c.kv_lora_rank)
        yield Mapping((*attn, "k_up"), *kv_b, lambda w: heads_in(w)[..., :dn])
        yield Mapping((*attn, "v_up"), *kv_b, lambda w: heads_in(w)[..., dn:])
        yield Mapping((*attn, "o_proj"), [a + "o_proj.weight"], (d, h * dv), lambda w: w.T.reshape(h, dv, d))
        m, mlp = hf + "mlp.", (*jx, "mlp")
        if not c.is_moe_layer(i):
            f = c.intermediate_size
            for proj, shape in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
                yield Mapping((*mlp, proj), [f"{m}{proj}_proj.weight"], shape, t)
            continue
        yield Mapping((*mlp, "router", "weight"), [m + "gate.weight"], (c.n_routed_experts, d), t)
        yield Mapping((*mlp, "router", "bias"), [m + "gate.e_score_correction_bias"], (c.n_routed_experts,), same)
        f, shared = c.moe_intermediate_size, c.moe_intermediate_size * c.n_shared_experts
        for proj, shape, shared_shape in (
            ("gate", (f, d), (shared, d)),
            ("up", (f, d), (shared, d)),
            ("down", (d, f), (d, shared)),
        ):
            names = [f"{m}experts.{e}.{proj}_proj.weight" for e in range(c.n_routed_experts)]
            yield Mapping((*mlp, proj), names, shape, lambda *ws: np.stack([w.T for w in ws]))
            if c.n_shared_experts:
                yield Mapping((*mlp, "shared", proj), [f"{m}shared_experts.{proj}_proj.weight"], shared_shape, t)


def drafter_hf_to_jaxdd(config: DrafterConfig) -> Iterator[Mapping]:
    """How every drafter parameter is built from a z-lab ``DFlashDraftModel`` checkpoint."""
    c = config
    d, n, k, h = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim

    def same(w):
        return w

    def t(w):
        return w.T

    def heads_out(w):  # [heads*h, d] -> [d, heads, h]
        return w.T.reshape(d, -1, h)

    yield Mapping(("fc",), ["fc.weight"], (d, len(c.target_layer_ids) * d), t)
    yield Mapping(("hidden_norm", "weight"), ["hidden_norm.weight"], (d,), same)
    yield Mapping(("norm", "weight"), ["norm.weight"], (d,), same)
    for i in range(c.num_hidden_layers):
        hf, jx = f"layers.{i}.", ("layers", i)
        a = hf + "self_attn."
        yield Mapping((*jx, "attn_norm", "weight"), [hf + "input_layernorm.weight"], (d,), same)
        yield Mapping((*jx, "mlp_norm", "weight"), [hf + "post_attention_layernorm.weight"], (d,), same)
        yield Mapping((*jx, "attn", "q_proj"), [a + "q_proj.weight"], (n * h, d), heads_out)
        yield Mapping((*jx, "attn", "k_proj"), [a + "k_proj.weight"], (k * h, d), heads_out)
        yield Mapping((*jx, "attn", "v_proj"), [a + "v_proj.weight"], (k * h, d), heads_out)
        yield Mapping((*jx, "attn", "o_proj"), [a + "o_proj.weight"], (d, n * h), lambda w: w.T.reshape(n, h, d))
        yield Mapping((*jx, "attn", "q_norm", "weight"), [a + "q_norm.weight"], (h,), same)
        yield Mapping((*jx, "attn", "k_norm", "weight"), [a + "k_norm.weight"], (h,), same)
        f = c.intermediate_size
        for proj, shape in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
            yield Mapping((*jx, "mlp", proj), [f"{hf}mlp.{proj}_proj.weight"], shape, t)


def _config_path(directory: Path) -> Path:
    if not (directory / "config.json").exists():
        raise CheckpointError(f"{directory}: no config.json (is this an HF checkpoint directory?)")
    return directory / "config.json"


def load_hf_target(directory: str | Path, dtype: jnp.dtype = jnp.bfloat16) -> KimiTarget:
    """Build a ``KimiTarget`` from an HF checkpoint directory; every tensor is checked against the config."""
    directory = Path(directory)
    config = KimiConfig.from_json_file(_config_path(directory))
    readers = read_tensors(directory)
    quantized = sorted(n for n in readers if n.endswith(("weight_scale_inv", "weight_packed")))
    if quantized:
        raise CheckpointError(
            f"{directory} holds quantized tensors (e.g. {quantized[0]}); convert it with `python -m convert` first"
        )
    # MTP (next-n) layers beyond num_hidden_layers are not part of the target.
    mtp = {n for n in readers if n.startswith("model.layers.") and int(n.split(".")[2]) >= config.num_hidden_layers}
    return _build(directory, readers, hf_to_jaxdd(config), abstract_target(config, dtype), ignored=mtp)


def load_hf_drafter(directory: str | Path, dtype: jnp.dtype = jnp.bfloat16) -> DFlashDrafter:
    """Build a ``DFlashDrafter`` from a z-lab DFlash checkpoint directory (config.json + safetensors)."""
    directory = Path(directory)
    config = DrafterConfig.from_json_file(_config_path(directory))
    readers = read_tensors(directory)
    return _build(directory, readers, drafter_hf_to_jaxdd(config), abstract_drafter(config, dtype))


def _build(directory: Path, readers, plan, abstract_model, ignored=frozenset()) -> nnx.Module:
    """Fill an abstract model from HF tensors after checking names and shapes; one error lists all misfits."""
    graphdef, abstract = abstract_model
    plan = list(plan)
    wanted = {name for mapping in plan for name in mapping.hf_names}
    missing = sorted(wanted - readers.keys())
    unexpected = sorted(readers.keys() - wanted - ignored)
    if missing or unexpected:
        lines = [f"{directory}: tensors do not match the config"]
        lines += [f"  missing: {n}" for n in missing[:20]]
        lines += [f"  ... {len(missing) - 20} more missing"] if len(missing) > 20 else []
        lines += [f"  unexpected: {n}" for n in unexpected[:20]]
        raise CheckpointError("\n".join(lines))

    values = nnx.to_pure_dict(abstract)
    for mapping in plan:
        tensors = [readers[n]() for n in mapping.hf_names]
        for name, tensor in zip(mapping.hf_names, tensors, strict=True):
            if tuple(tensor.shape) != mapping.hf_shape:
                raise CheckpointError(f"{name}: shape {tuple(tensor.shape)}, the config needs {mapping.hf_shape}")
        leaf = _get(values, mapping.path)
        _set(values, mapping.path, jnp.asarray(mapping.build(*tensors), leaf.dtype))
    nnx.replace_by_pure_dict(abstract, values)
    return nnx.merge(graphdef, abstract)


def _get(tree: dict, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple, value) -> None:
    _get(tree, path[:-1])[path[-1]] = value
