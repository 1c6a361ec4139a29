"""The gathered INT4 expert matvec as an XLA:CPU custom call (``int4_matvec.cc``, XLA's FFI).

XLA:CPU gathers the chosen experts' INT4 words, unpacks them to a dense copy and then multiplies (a projection of
8 experts: 2.7-3.9 ms; benchmarks/moe_bandwidth.py). The kernel unpacks in registers and multiplies as it reads
(0.63-0.74 ms). Pallas has no CPU backend, so it is C++, compiled on first use with this
machine's C++ compiler for this machine's vector units (``-march=native``) and cached by source, compiler, flags,
CPU and jax version. Where no compiler works, ``available()`` is False and the MoE keeps XLA's form.
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

SOURCE = Path(__file__).with_name("int4_matvec.cc")
TARGET = "jaxdd_int4_gathered_matvec"
GROUP_MULTIPLE = 32  # the kernel's scale groups are whole 4-word half-blocks (every Kimi INT4 checkpoint: 32)
# No FMA contraction: the kernel's bf16 rounding (a Veltkamp split) needs each product rounded on its own.
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off")
log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where compiled kernels are kept: $JAXDD_CACHE, else ~/.cache/jaxdd (XDG)."""
    base = os.environ.get("JAXDD_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxdd"
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
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def build(compiler: str) -> Path:
    """The kernel's shared library, compiled unless the cache has it (written atomically: a temporary file
    renamed into place, so concurrent processes and interrupted builds leave no partial library)."""
    flags = (*FLAGS, "-march=native", "-I", jax.ffi.include_dir())
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), compiler, " ".join(flags), _cpu_flags(), jax.__version__):
        key.update(part if isinstance(part, bytes) else part.encode())
    library = cache_dir() / f"int4_matvec-{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        built = Path(scratch) / library.name
        subprocess.run([compiler, *flags, str(SOURCE), "-o", str(built)], check=True, capture_output=True, text=True)
        os.replace(built, library)
    return library


def load(compiler: str | None) -> ctypes.CDLL | None:
    """The built library, or None with one warning where there is no compiler or the build fails."""
    if compiler is None:
        log.warning("jaxdd: no C++ compiler found; INT4 experts on CPU use XLA's slower dequantization")
        return None
    try:
        return ctypes.CDLL(str(build(compiler)))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", None) or error
        log.warning("jaxdd: the INT4 CPU kernel did not build (%s); using XLA's dequantization", str(detail)[-500:])
        return None


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered with XLA:CPU (once per process)."""
    library = load(compiler())
    if library is not None:
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(getattr(library, TARGET)), platform="cpu")
    return library is not None


def gathered_int4_matvec(rows: jax.Array, packed: jax.Array, scale: jax.Array, chosen: jax.Array) -> jax.Array:
    """rows [P, K] through experts ``chosen`` [P] of packed [E, N, K/8] int32 with scale [E, N, K/group] bf16
    (``jaxdd.quant.Int4Experts``): [P, N] in rows' dtype, each weight dequantized as ``dequantize_int4_groups``
    does (bf16(q x scale)) and the products summed in fp32. Call only where ``available()``, for groups that
    are a multiple of ``GROUP_MULTIPLE``."""
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((rows.shape[0], packed.shape[1]), jnp.float32))
    return call(rows.astype(jnp.float32), packed, scale, chosen.astype(jnp.int32)).astype(rows.dtype)
