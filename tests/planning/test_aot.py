"""Deviceless compiles for the real targets (``jaxdd.planning.aot``, ``jaxdd.plan
--target``): the rounds ``jaxdd.generate`` runs there compile with the GPU's or
TPU's own compiler on this CPU host, each with a memory analysis inside a bound
computed from the shapes, and the full-width Kimi K2.6 layers fit on the GPU."""

import functools

import jax
import jax.numpy as jnp
import pytest

from jaxdd.errors import InputError
from jaxdd.planning.aot import find_machine
from jaxdd.planning.fit import PlanOptions, plan
from jaxdd.planning.hlo_text import array_shapes, parse_module
from jaxdd.runtime.backend import Backend
from jaxdd.testing.reference import TINY_K2
from pallas_kernels.tree_attention import tree_attention
from pallas_kernels.tree_attention_tpu import SMEM_TABLE_BYTES, table_groups
from pallas_kernels.tree_operands import TreeOperands

# (method, sampled, devices): every round sharded over 8 devices but
# greedy DDTree, which runs on 1 (one device compiles the same program
# less its collectives; the suite's time goes to these compiles).
ROUNDS = [("ar", False, 8), ("dflash", False, 8), ("ddtree", False, 1), ("ddtree", True, 8)]
# The RTX PRO 6000 differs from the H200 in the kernel's
# tiles (its shared memory): only its sampled tree round.
CASES = [
    (target, *r)
    for target in ("h200", "rtx-pro-6000", "v5p:2x2x2")
    for r in ROUNDS
    if target != "rtx-pro-6000" or r == ("ddtree", True, 8)
]
CASE_IDS = [f"{t}-{m}{'-sampled' if s else ''}-{d}" for t, m, s, d in CASES]
TOKENS = {"ar": 1, "dflash": 8, "ddtree": 17}  # verified per round: block 8, budget 16
CUBLAS_WORKSPACE = 4 * 2**20  # XLA:GPU's scratch for cuBLAS matmuls, whatever their size
# TPU layouts pad rows to 128 lanes, and the pools are row-major (the kernel's layout): the tiny
# pair's 8-wide rope rows take 16 times their bytes
TPU_TILE_PADDING = 16


def _check_memory(result: dict) -> None:
    """What the round reads is what it takes (its weights and caches,
    TPU tile padding aside), and its temporaries stay within twice
    that plus a few hundred activation rows of scores and logits."""
    per_device, compiled, method = result["per_device_bytes"], result["compiled"], result["method"]
    reads = per_device["target_weights"] + per_device["target_cache"]
    if method != "ar":
        reads += per_device["drafter_weights"] + per_device["drafter_cache"]
    tpu = result["hardware"]["platform"] == "tpu"
    padding = TPU_TILE_PADDING if tpu else 1
    assert reads <= compiled["argument_bytes"] <= padding * reads + 64 * 1024
    scores = TINY_K2["vocab_size"] + TINY_K2["num_attention_heads"] * result["cache_slots"]
    # one fp32 row of logits and attention scores per verified token
    activations = TOKENS[method] * scores * 4
    workspace = 0 if tpu else CUBLAS_WORKSPACE
    assert 0 <= compiled["temp_bytes"] <= workspace + padding * (2 * reads + 256 * activations)
    assert result["fits"] and compiled["fits_compiler"]


@pytest.mark.slow
@pytest.mark.parametrize(("target", "method", "sampled", "devices"), CASES, ids=CASE_IDS)
def test_rounds_compile_for_the_target(planned, target, method, sampled, devices):
    """AR, DFlash and DDTree (greedy and sampled, budget 16) of a tiny Kimi
    K2.6-style pair (INT4 experts) on 8 devices (greedy DDTree on 1), with the
    attention the target's platform gets: the Pallas kernel, its Triton form
    on GPUs and its Mosaic form on TPU (per device under shard_map on 8)."""
    result, _ = planned(PlanOptions(target, devices, "ep", method, 16, 256, sampled=sampled))
    platform = "tpu" if target.startswith("v5p") else "gpu"
    assert result["hardware"]["platform"] == platform and result["devices"] == devices
    assert result["attention"] == "pallas"
    _check_memory(result)


# (tree tokens, heads per device, cache slots)
KIMI_KERNEL_SHAPES = [(17, 8, 4096), (257, 64, 131072)]
KERNEL_TARGETS = ["v5e:2x2", "v5p:2x2x2", "v6e:2x2", "h200", "rtx-pro-6000"]


def kimi_kernel_args(where, tokens: int, heads: int, slots: int) -> TreeOperands:
    """The kernel's arguments at Kimi's latent sizes (512 + 64, bf16) on where's first device."""
    device = jax.sharding.SingleDeviceSharding(where.devices[0])
    spec = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=device)
    t, h = tokens, heads
    shapes = [(1, t, h, 512), (1, t, h, 64), (1, slots, 512), (1, slots, 64)]
    args = [spec(s) for s in shapes] + [spec((1,), jnp.int32), spec((1, t, 512)), spec((1, t, 64))]
    return TreeOperands(*args, spec((1, t, t), jnp.bool_))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tokens", "heads", "slots"), KIMI_KERNEL_SHAPES, ids=["17x8x4k", "257x64x128k"]
)
@pytest.mark.parametrize("target", KERNEL_TARGETS)
def test_kernel_compiles_at_kimi_sizes(target, tokens, heads, slots):
    """Kimi's latent sizes (512 + 64, bf16) with the form and tiles each platform gets:
    Mosaic streams the cache through VMEM (the GPU form's whole-cache block failed at 16k
    slots there), Triton reads it through pointers; 128k slots compile for every chip."""
    where = find_machine(target, 1)
    args = kimi_kernel_args(where, tokens, heads, slots)
    kernel = jax.jit(functools.partial(where.backend.tree_attention(), scale=0.1))
    compiled = kernel.lower(args).compile(compiler_options=where.compiler_options)
    assert compiled.memory_analysis() is not None
    if where.platform == "tpu":
        assert "mla_tree_attention_tpu" in kernel.lower(args).as_text()


@pytest.mark.slow
@pytest.mark.parametrize("target", KERNEL_TARGETS)
def test_kernel_with_lse_compiles_at_kimi_sizes(target):
    """with_lse, each query row's log-sum-exp leaves the kernel too (a block one lane
    wide): Mosaic and Triton compile it for a 257-token tree over 64 heads."""
    where = find_machine(target, 1)
    args = kimi_kernel_args(where, 257, 64, 4096)
    kernel = jax.jit(functools.partial(where.backend.tree_attention(), scale=0.1, with_lse=True))
    compiled = kernel.lower(args).compile(compiler_options=where.compiler_options)
    out, lse = compiled.out_info
    assert out.shape == (1, 257, 64, 512) and lse.shape == (1, 257, 64)
    assert lse.dtype == jnp.float32 and compiled.memory_analysis() is not None


def paged_kernel_args(
    where, batch: int, tokens: int, heads: int, slots: int, page: int
) -> TreeOperands:
    """``kimi_kernel_args`` for ``batch`` rows of ``slots`` over one pool of 64-slot pages (and
    the null page), read through page tables."""
    device = jax.sharding.SingleDeviceSharding(where.devices[0])
    spec = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=device)
    b, t, h, row_pages = batch, tokens, heads, slots // page
    pool = 1 + b * row_pages
    shapes = [(b, t, h, 512), (b, t, h, 64), (pool, page, 512), (pool, page, 64)]
    args = [spec(s) for s in shapes] + [spec((b,), jnp.int32), spec((b, t, 512)), spec((b, t, 64))]
    return TreeOperands(*args, spec((b, t, t), jnp.bool_), spec((b, row_pages), jnp.int32))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("batch", "tokens", "heads", "slots", "with_lse"),
    [(2, 17, 8, 4096, False), (1, 257, 64, 131072, True)],
    ids=["2x17x8x4k", "257x64x128k-lse"],
)
@pytest.mark.parametrize("target", KERNEL_TARGETS)
def test_paged_kernel_compiles_at_kimi_sizes(target, batch, tokens, heads, slots, with_lse):
    """The kernel over a pool of 64-slot pages (a 128k-slot row: a table of 2048 pages) with the
    form and tiles each platform gets: Mosaic reads the tables from SMEM in its index maps,
    Triton loads each page id inside its key loop."""
    where = find_machine(target, 1)
    ops = paged_kernel_args(where, batch, tokens, heads, slots, 64)
    kernel = jax.jit(
        functools.partial(where.backend.tree_attention(), scale=0.1, with_lse=with_lse)
    )
    lowered = kernel.lower(ops)
    compiled = lowered.compile(compiler_options=where.compiler_options)
    assert compiled.memory_analysis() is not None
    out = compiled.out_info[0] if with_lse else compiled.out_info
    assert out.shape == (batch, tokens, heads, 512)
    tpu = where.platform == "tpu"
    names = ["mla_tree_attention_tpu_paged"] if tpu else ["mla_tree_attention_paged", "triton"]
    assert all(name in lowered.as_text() for name in names)


def test_tables_past_smem_compile_in_several_calls():
    """256 rows of 128k slots: 2 MiB of page tables, twice a TPU core's SMEM (one call that
    prefetched them all was refused on v5p): the kernel reads them in calls whose tables fit."""
    where = find_machine("v5p:2x2x2", 1)
    ops = paged_kernel_args(where, 256, 1, 8, 131072, 64)
    # a smaller pool (the tables' size is what matters): each row's 2,048 pages would be 38 GB
    smaller = lambda x: jax.ShapeDtypeStruct((4097, *x.shape[1:]), x.dtype, sharding=x.sharding)
    ops = ops.replace(cache_latent=smaller(ops.cache_latent), cache_rope=smaller(ops.cache_rope))
    kernel = jax.jit(functools.partial(where.backend.tree_attention(), scale=0.1))
    lowered = kernel.lower(ops)
    compiled = lowered.compile(compiler_options=where.compiler_options)
    assert compiled.out_info.shape == (256, 1, 8, 512)
    calls = lowered.as_text().count('name = "mla_tree_attention_tpu_paged"')
    assert calls == len(table_groups(ops.pages.shape, SMEM_TABLE_BYTES)) == 4


def test_a_round_over_the_chips_memory_is_refused_by_the_compiler(tiny_plan_configs):
    """32M cache slots on one 16 GB v5e chip: XLA:TPU refuses the program inside
    the compile, and the plan reports what the compiler said it needs."""
    result = plan(*tiny_plan_configs, PlanOptions("v5e:2x2", 1, "ep", budget=16, max_len=2**25))
    assert not result["fits"] and not result["compiled"]["fits_compiler"]
    assert result["per_device_bytes"]["total"] > 16e9 > result["hardware"]["memory_bytes"] - 1e9


@pytest.mark.parametrize(
    ("target", "dtype"), [("rtx-pro-6000", jnp.bfloat16), ("rtx-pro-6000", jnp.float32)]
)
def test_kernel_tiles_fit_the_gpus_shared_memory(target, dtype):
    """Kimi's latent sizes (512 + 64, 8 heads per device, a 65-token tree over 32k
    slots) with the tiles the backend picks for a GPU of 99 KB shared memory per block:
    Triton's compile accepts them (H200's tiles ask for 166 KB and are refused)."""
    where = find_machine(target, 1)
    backend = Backend.of_devices(where.devices)
    assert backend.shared_memory == 99 * 1024
    device = jax.sharding.SingleDeviceSharding(where.devices[0])
    spec = lambda shape, dt=dtype: jax.ShapeDtypeStruct(shape, dt, sharding=device)
    t, h, slots = 65, 8, 32768
    shapes = [(1, t, h, 512), (1, t, h, 64), (1, slots, 512), (1, slots, 64)]
    args = [spec(s) for s in shapes] + [spec((1,), jnp.int32), spec((1, t, 512)), spec((1, t, 64))]
    args = TreeOperands(*args, spec((1, t, t), jnp.bool_))
    kernel = jax.jit(functools.partial(tree_attention, scale=0.1, **backend.kernel_options()))
    kernel.lower(args).compile(compiler_options=where.compiler_options)
    h200 = jax.jit(functools.partial(tree_attention, scale=0.1, **Backend("gpu").kernel_options()))
    if dtype == jnp.bfloat16:
        with pytest.raises(jax.errors.JaxRuntimeError, match="Shared memory size limit exceeded"):
            h200.lower(args).compile(compiler_options=where.compiler_options)


@pytest.mark.slow
def test_a_multi_host_slice_compiles_as_one_program(tiny_plan_configs):
    """TPU v5p:2x2x4 is 16 chips on 4 hosts (one JAX process each): the plan
    compiles the one SPMD program all four would run, from this single process."""
    result = plan(*tiny_plan_configs, PlanOptions("v5p:2x2x4", None, "tp", budget=16, max_len=256))
    assert result["devices"] == 16 and result["hardware"]["processes"] == 4
    _check_memory(result)


def test_unknown_targets_are_named():
    with pytest.raises(InputError, match="expected one of cpu, h200, rtx-pro-6000, b200"):
        find_machine("a100")
    with pytest.raises(InputError, match="v5p:9x9x9"):
        find_machine("v5p:9x9x9")
    with pytest.raises(InputError, match="has 8 devices, asked for 9"):
        find_machine("v5p:2x2x2", 9)


@pytest.mark.slow
def test_the_tpu_round_reads_the_pools_in_place(planned):
    """On TPU every program of the decode state names its pools of pages row-major, the Mosaic
    kernel's blocks (``jaxdd.decoding.programs``): XLA copies none around the kernel's calls, as
    it does a pool laid out to its own taste (the tiny pair's are all under 128 lanes wide; the
    DFlash round's pools were copied before their formats were named)."""
    # the options of test_rounds_compile_for_the_target's v5p DFlash round: compiled once
    result, texts = planned(PlanOptions("v5p:2x2x2", 8, "ep", "dflash", 16, 256))
    computations, entry = parse_module(texts[-1])
    main = computations[entry]
    pools = {
        name
        for name in main.parameters.values()
        if main.instructions[name].op_name.startswith(("state.target_cache", "state.draft_cache"))
        and len(array_shapes(main.instructions[name].shape)[0][1]) >= 3
    }
    copied = {
        operand
        for computation in computations.values()
        for ins in computation.instructions.values()
        if ins.opcode == "copy"
        for operand in ins.operands
    }
    assert len(pools) > 2 * result["layers"]  # each layer's latent and rope; the drafter's K/V
    assert not pools & copied
