"""The host-side API: load a target, run jitted forwards over a latent cache (inputs checked by
``jaxdd.decoding.checks``), generate.

The jitted step takes the model as a flat list of arrays (``jaxdd.runtime.jit_state``)
and donates the cache so XLA writes the new rows in place.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxdd.cache import LatentCache
from jaxdd.config import KimiConfig
from jaxdd.decoding.checks import check_positions, check_tokens, check_visible
from jaxdd.decoding.engine import Generation, SpeculativeDecoder
from jaxdd.decoding.sampling import GREEDY, Sampling
from jaxdd.errors import CheckpointError, InputError, checkpoint_directory
from jaxdd.models.drafter import DFlashDrafter
from jaxdd.models.target import KimiTarget
from jaxdd.runtime.backend import Backend
from jaxdd.runtime.jit_state import split_module
from jaxdd.runtime.sharding import Placement, abstract_shardings, make_mesh, place
from jaxdd.types import Attention, CacheLayout, DrafterKV, Method, MoeMode
from jaxdd.weights.checkpoint import (
    abstract_model,
    cast_model,
    is_jaxdd_checkpoint,
    load_checkpoint,
)
from jaxdd.weights.hf_loader import load_hf_drafter, load_hf_target


class ForwardOptions(NamedTuple):
    """A forward's static choices: the layers whose output to return, the MLA form, the platform's
    choices and whether the new tokens are committed."""

    taps: tuple[int, ...]
    attention: Attention
    backend: Backend
    commit: bool


class ForwardResult(NamedTuple):
    logits: jax.Array  # [B, T, vocab] fp32
    taps: jax.Array | None  # [B, T, len(taps) * hidden]
    cache: LatentCache


def load_target(
    path: str | Path,
    dtype: str | jnp.dtype = "bfloat16",
    verify: bool = False,
    mesh: Mesh | None = None,
    moe: MoeMode = "tp",
) -> Target:
    """Load a target from a jaxdd checkpoint or an HF checkpoint directory
    (config.json + safetensors, plain or with FP8 / INT4 routed experts, which
    stay quantized). ``verify``: check a jaxdd checkpoint's checksums first (reads
    every byte once). ``mesh``: load straight into its shardings (``moe``: how the
    routed experts are split), each process reading only its devices' parts."""
    path = _checkpoint(path, verify)
    placement = None if mesh is None else (mesh, moe)
    if is_jaxdd_checkpoint(path):
        return Target(_restore(path, "target", jnp.dtype(dtype), verify, placement))
    return Target(load_hf_target(path, jnp.dtype(dtype), placement=placement))


def load_drafter(
    path: str | Path,
    dtype: str | jnp.dtype = "bfloat16",
    verify: bool = False,
    mesh: Mesh | None = None,
    moe: MoeMode = "tp",
) -> DFlashDrafter:
    """Load a DFlash drafter from a jaxdd checkpoint or a z-lab checkpoint directory (config.json
    with dflash_config + safetensors); ``verify``, ``mesh`` and ``moe`` as in ``load_target``."""
    path = _checkpoint(path, verify)
    placement = None if mesh is None else (mesh, moe)
    if is_jaxdd_checkpoint(path):
        return _restore(path, "drafter", jnp.dtype(dtype), verify, placement)
    return load_hf_drafter(path, jnp.dtype(dtype), placement=placement)


def load_pair(
    target_path: str | Path,
    drafter_path: str | Path | None,
    dtype: str | jnp.dtype = "bfloat16",
    devices: int = 1,
    moe: MoeMode = "tp",
    verify: bool = False,
) -> tuple[Target, DFlashDrafter | None]:
    """A target and its drafter (None without ``drafter_path``) on the first
    ``devices`` of this job's devices: as loaded on one, straight into their
    shardings on several (``moe`` and ``verify`` as in ``load_target``)."""
    placed = {
        "dtype": dtype,
        "verify": verify,
        "mesh": make_mesh(devices) if devices > 1 else None,
        "moe": moe,
    }
    target = load_target(target_path, **placed)
    return target, None if drafter_path is None else load_drafter(drafter_path, **placed)


def _restore(path: Path, kind: str, dtype: jnp.dtype, verify: bool, placement: Placement | None):
    if placement is None:
        return load_checkpoint(path, kind, dtype, verify=verify)
    shardings = abstract_shardings(*abstract_model(path, kind), *placement)
    model = load_checkpoint(path, kind, dtype, shardings=shardings, verify=verify)
    place(model, *placement)
    return model


def _checkpoint(path: str | Path, verify: bool) -> Path:
    path = checkpoint_directory(path)
    if verify and not is_jaxdd_checkpoint(path):
        raise CheckpointError(
            f"{path}: an HF checkpoint, which records no checksums (jaxdd checkpoints do)"
        )
    return path


@functools.partial(jax.jit, static_argnames=("spec", "options"), donate_argnames=("cache",))
def _forward(
    spec, weights, tokens, positions, cache, visible, options: ForwardOptions
) -> ForwardResult:
    model = spec.merge(weights)
    taps, attention, backend, commit = options
    out = model(tokens, positions, cache, visible, taps=taps, attention=attention, backend=backend)
    cache = out.cache
    if commit:
        cache = cache.commit(jnp.full_like(cache.length, tokens.shape[1]))
    return ForwardResult(model.logits(out.hidden, backend), out.taps, cache)


class Target:
    """A loaded target model.

    >>> target = jaxdd.load_target("path/to/checkpoint", dtype="float32")
    >>> logits = target.logits([[1, 2, 3]])                   # [1, 3, vocab] fp32 numpy
    >>> cache = target.new_cache(batch=1, max_len=64)
    >>> out = target.forward([[1, 2, 3]], cache)              # prefill; out.cache holds 3 tokens
    >>> out = target.forward([[4]], out.cache)                # one-token decode
    """

    def __init__(self, model: KimiTarget):
        self.model = model
        # the platform's choices, from where the weights live
        self.backend = Backend.of_module(model)
        self.backend.prepare_host()
        self._spec, self._weights = split_module(model)

    @property
    def config(self) -> KimiConfig:
        return self.model.config

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.model.dtype)

    def astype(self, dtype: str | jnp.dtype) -> Target:
        return Target(cast_model(self.model, jnp.dtype(dtype)))

    def new_cache(self, batch: int = 1, max_len: int = 256) -> LatentCache:
        if batch < 1 or max_len < 1:
            raise InputError.at(
                "new_cache", f"batch and max_len must be >= 1, got batch={batch}, max_len={max_len}"
            )
        return LatentCache.zeros(self.config, batch, max_len, self.dtype)

    def forward(
        self,
        token_ids,
        cache: LatentCache,
        *,
        positions=None,
        visible=None,
        taps: tuple[int, ...] = (),
        attention: Attention | None = None,
        commit: bool = True,
    ) -> ForwardResult:
        """Run new tokens [B, T] against ``cache`` (which is consumed: use the returned one).

        positions: [B, T], default ``length + arange(T)``; visible: [B, T, T] bool, default
        causal (a tree forward passes its ancestor-or-self mask and positions ``start +
        depth``). taps: layers whose output to return, concatenated. attention: "naive",
        "absorbed" or "pallas" MLA; default naive for a prefill into an empty cache, absorbed
        otherwise. commit: advance the cache length by T (False leaves the rows uncommitted).
        """
        tokens = check_tokens(token_ids, self.config.vocab_size, cache.batch)
        b, t = tokens.shape
        length = np.asarray(cache.length)
        overflow = np.flatnonzero(length + t > cache.slots)
        if overflow.size:
            r = overflow[0]
            raise InputError(
                f"cache overflow: row {r} holds {length[r]} tokens, {t} more need "
                f"{length[r] + t} slots, "
                f"but the cache has {cache.slots}; create it with a larger max_len"
            )
        if positions is None:
            positions = length[:, None] + np.arange(t)[None, :]
        positions = check_positions(
            positions, (b, t), cache.slots, self.config.max_position_embeddings
        )
        visible = check_visible(visible, b, t)
        bad_taps = [i for i in taps if not 0 <= i < self.config.num_hidden_layers]
        if bad_taps:
            raise InputError.at(
                "taps", f"layer(s) {bad_taps} outside [0, {self.config.num_hidden_layers})"
            )
        if attention is None:
            attention = "naive" if t > 1 and not length.any() else "absorbed"
        options = ForwardOptions(tuple(taps), attention, self.backend, commit)
        return _forward(self._spec, self._weights, tokens, positions, cache, visible, options)

    def generate(
        self,
        prompt_ids,
        *,
        drafter: DFlashDrafter | None = None,
        method: Method | None = None,
        max_new_tokens: int = 64,
        stop_token_ids: list[int] | None = None,
        block_size: int | None = None,
        budget: int | Literal["auto"] | None = None,
        max_children: int | None = None,
        sampling: Sampling = GREEDY,
        on_tokens: Callable[[list[int]], None] | None = None,
        cache_layout: CacheLayout = "replicated",
        drafter_kv: DrafterKV = "model",
        prefill_chunk: int | None = None,
    ) -> Generation:
        """Generation: ``dflash`` when a drafter is given, else ``ar``; ``ddtree``
        with a node ``budget``, or "auto" (see ``SpeculativeDecoder.generate_batch``). Greedy
        unless ``sampling`` says otherwise.

        Returns the new tokens, the tokens produced per round and timings.
        Stops at ``stop_token_ids`` (default: the config's EOS ids; ``[]``
        for none) or after ``max_new_tokens``. ``on_tokens(new_tokens)``
        is called as tokens are accepted (to stream them). ``cache_layout``: the latent cache
        on a mesh, ``replicated`` or ``striped`` over its devices. ``drafter_kv``: the drafter's
        context K/V in the models' dtype or ``fp8`` (the same greedy tokens). ``prefill_chunk``: a
        longer prompt is prefilled that many tokens at a time (the same tokens).
        """
        stream = None if on_tokens is None else (lambda request, tokens: on_tokens(tokens))
        decoder = SpeculativeDecoder(
            self, drafter, cache_layout=cache_layout, drafter_kv=drafter_kv
        )
        return decoder.generate(
            prompt_ids,
            sampling=sampling,
            on_tokens=stream,
            method=method or ("dflash" if drafter is not None else "ar"),
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop_token_ids,
            block_size=block_size,
            budget=budget,
            max_children=max_children,
            prefill_chunk=prefill_chunk,
        )

    def logits(self, token_ids, attention: Attention | None = None) -> np.ndarray:
        """fp32 logits [B, T, vocab] of a causal forward over ``token_ids`` from an empty cache."""
        tokens = check_tokens(token_ids, self.config.vocab_size)
        cache = self.new_cache(tokens.shape[0], tokens.shape[1])
        return np.asarray(self.forward(tokens, cache, attention=attention).logits)
