"""Decode's matvecs as XLA:CPU custom calls (``cpu_kernels.cc``, XLA's FFI):
the gathered INT4 expert matvec, the few-row dense matvec and the row dot
(decode attention's products with weights and cache rows stored [rows, K]); and the
tree-verify attention over pools of pages (``cpu_attention.cc``), which reads each row's
committed pages in place where XLA:CPU gathers them into a copy per layer.

XLA:CPU gathers the chosen experts' INT4 words, unpacks them to a dense copy and then multiplies;
the kernel unpacks in registers as it reads (benchmarks/README.md, "Decode against its floor").
XLA:CPU runs a one-row matmul on one thread, which cannot draw the memory bandwidth of all cores;
the dense kernel and the row dot split the weight's rows across XLA's threads. Pallas has no CPU
backend, so it is C++, compiled on first use with this machine's C++ compiler for this machine's
vector units (``-march=native``) and cached by source, compiler, flags, CPU and jax version. Where
no compiler works, ``available()`` is False and the model keeps XLA's forms.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.tree_operands import TreeOperands

HERE = Path(__file__).parent
SOURCES = (HERE / "cpu_kernels.cc", HERE / "cpu_attention.cc")
HEADERS = (HERE / "cpu_kernels.h",)
INT4_TARGET = "jaxdd_int4_gathered_matvec"
DENSE_TARGETS = {
    jnp.dtype(jnp.float32): "jaxdd_dense_matvec_f32",
    jnp.dtype(jnp.bfloat16): "jaxdd_dense_matvec_bf16",
}
ROW_DOT_TARGETS = {
    jnp.dtype(jnp.float32): "jaxdd_row_dot_f32",
    jnp.dtype(jnp.bfloat16): "jaxdd_row_dot_bf16",
}
ATTENTION_TARGET = "jaxdd_tree_attention"
ATTENTION_CACHE_DTYPES = tuple(map(jnp.dtype, (jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn)))
# the kernel's scale groups are whole 4-word half-blocks (every Kimi INT4 checkpoint: 32)
GROUP_MULTIPLE = 32
# No FMA contraction: the portable INT4 path's bf16 rounding
# (a Veltkamp split) needs each product rounded alone.
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off")
log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where compiled kernels are kept: $JAXDD_CACHE, else ~/.cache/jaxdd (XDG)."""
    base = (
        os.environ.get("JAXDD_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxdd"
    )
    return Path(base) / "native"


def _cpu_flags() -> str:
    """The CPU's feature flags (``-march=native`` code is only valid on a CPU that has them)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in info.splitlines() if line.startswith(("flags", "Features"))), "")


def compiler() -> str | None:
    """$CXX, else the first C++ compiler on PATH."""
    return (
        os.environ.get("CXX")
        or shutil.which("c++")
        or shutil.which("g++")
        or shutil.which("clang++")
    )


def build(compiler: str, extra_flags: tuple[str, ...] = ()) -> Path:
    """The kernels' shared library, compiled unless the cache has it (written
    atomically: a temporary file renamed into place, so concurrent processes
    and interrupted builds leave no partial library). ``extra_flags`` e.g.
    ``-mno-avx512f`` builds the portable form on an AVX-512 host (tests)."""
    flags = (*FLAGS, "-march=native", *extra_flags, "-I", jax.ffi.include_dir())
    key = hashlib.sha256()
    code = [path.read_bytes() for path in (*SOURCES, *HEADERS)]
    for part in (*code, compiler, " ".join(flags), _cpu_flags(), jax.__version__):
        key.update(part if isinstance(part, bytes) else part.encode())
    library = cache_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        built = Path(scratch) / library.name
        subprocess.run(
            [compiler, *flags, *map(str, SOURCES), "-o", str(built)],
            check=True,
            capture_output=True,
            text=True,
        )
        os.replace(built, library)
    return library


def load(compiler: str | None) -> ctypes.CDLL | None:
    """The built library, or None with one warning where there is no compiler or the build fails."""
    if compiler is None:
        log.warning("jaxdd: no C++ compiler found; decode on CPU uses XLA's slower matvecs")
        return None
    try:
        return ctypes.CDLL(str(build(compiler)))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", None) or error
        log.warning(
            "jaxdd: the CPU kernels did not build (%s); using XLA's matvecs", str(detail)[-500:]
        )
        return None


@functools.cache
def available() -> bool:
    """Whether the kernels are built and registered with XLA:CPU (once per process)."""
    library = load(compiler())
    if library is not None:
        tables = (DENSE_TARGETS, ROW_DOT_TARGETS)
        singles = (INT4_TARGET, ATTENTION_TARGET)
        for target in (*singles, *(name for table in tables for name in table.values())):
            jax.ffi.register_ffi_target(
                target, jax.ffi.pycapsule(getattr(library, target)), platform="cpu"
            )
    return library is not None


def gathered_int4_matvec(
    rows: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    chosen: jax.Array,
    target: str = INT4_TARGET,
) -> jax.Array:
    """rows [P, K] through experts ``chosen`` [P] of packed [E, N, K/8] int32 with
    scale [E, N, K/group] bf16 (``jaxdd.models.quant.Int4Experts``): [P, N] in
    rows' dtype, each weight dequantized as ``dequantize_int4_groups`` does (bf16(q
    x scale)) and the products summed in fp32. Call only where ``available()``, for
    groups that are a multiple of ``GROUP_MULTIPLE``. ``target``: the FFI target it
    is registered as (tests register another build of it under another name)."""
    call = jax.ffi.ffi_call(
        target, jax.ShapeDtypeStruct((rows.shape[0], packed.shape[1]), jnp.float32)
    )
    return call(rows.astype(jnp.float32), packed, scale, chosen.astype(jnp.int32)).astype(
        rows.dtype
    )


def dense_matvec(rows: jax.Array, weight: jax.Array) -> jax.Array:
    """rows [P, K] @ weight [K, N] (fp32 or bf16) for a few rows: [P, N] in rows' dtype,
    products summed in fp32, each weight read once. Call only where ``available()``."""
    out = jax.ShapeDtypeStruct((rows.shape[0], weight.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(DENSE_TARGETS[weight.dtype], out)(
        rows.astype(jnp.float32), weight
    ).astype(rows.dtype)


def row_dot(x: jax.Array, weight: jax.Array) -> jax.Array:
    """x [G, P, K] . weight [G, N, K] (fp32 or bf16) -> [G, P, N] in x's dtype:
    every row of group g's weight dotted with the P rows of x[g], products summed
    in fp32, each weight row read once. Call only where ``available()``."""
    out = jax.ShapeDtypeStruct((*x.shape[:2], weight.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(ROW_DOT_TARGETS[weight.dtype], out)(
        x.astype(jnp.float32), weight
    ).astype(x.dtype)


def tree_attention(
    ops: TreeOperands, *, scale: float, with_lse: bool = False
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``pallas_kernels.tree_attention.tree_attention_reference``'s arguments and results, in
    fp32, each row's committed pages read in place (a cache of fp32, bf16 or e4m3 widened to fp32
    as it is read). Without pages each row's own buffer is one page of its table. Call only
    where ``available()``."""
    cache_latent, cache_rope = ops.cache_latent, ops.cache_rope
    if cache_latent.dtype != cache_rope.dtype or cache_latent.dtype not in ATTENTION_CACHE_DTYPES:
        raise ValueError(
            f"tree attention: a cache of one dtype of {[d.name for d in ATTENTION_CACHE_DTYPES]}"
            f" expected, got {cache_latent.dtype} and {cache_rope.dtype}"
        )
    b, t, h, r = ops.q_latent.shape
    if ops.pages is None:
        pages, fold = jnp.arange(b, dtype=jnp.int32)[:, None], 1
    else:
        ops.check_pages()
        pages, fold = ops.pages, ops.fold
    f32 = lambda x: x.astype(jnp.float32)
    call = jax.ffi.ffi_call(
        ATTENTION_TARGET,
        (
            jax.ShapeDtypeStruct((b, t * h, r), jnp.float32),
            jax.ShapeDtypeStruct((b, t * h), jnp.float32),
        ),
    )
    out, lse = call(
        f32(ops.q_latent.reshape(b, t * h, r)),
        f32(ops.q_rope.reshape(b, t * h, -1)),
        cache_latent,
        cache_rope,
        ops.length.astype(jnp.int32),
        f32(ops.tail_latent),
        f32(ops.tail_rope),
        ops.tail_mask.astype(bool),
        pages.astype(jnp.int32),
        scale=np.float32(scale),
        fold=np.int64(fold),
    )
    out = out.reshape(b, t, h, r)
    return (out, lse.reshape(b, t, h)) if with_lse else out
