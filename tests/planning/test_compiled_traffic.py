"""``jaxdd.compiled_traffic`` on small programs whose traffic is known by construction, compiled
by XLA:CPU and, deviceless, by XLA:GPU (H200) and XLA:TPU (v5p): gathers and dynamic slices read
their rows, donated updates write their update, loops count their trips, conditionals their
larger branch, collectives what they send and receive, custom calls what they declare (a Pallas
TPU kernel's cost estimate, from its grid and index maps) or their operands and outputs."""

import math
import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdd
from jaxdd.planning.aot import find_machine
from jaxdd.planning.fit import PlanOptions, plan
from jaxdd.runtime import cpu_kernels
from pallas_kernels.block_traffic import block_fetches, grid_bytes

MACHINES = ["cpu", "h200", "v5p:2x2x2"]
ROW = 7168 * 2  # one bf16 row of K2.6's hidden size
INDEX_SLACK = 64 * 1024  # index arithmetic, predicates, TPU's padded index vectors


def _compile(machine: str, f, shapes, donate=()):
    where = find_machine(machine, 1)
    device = jax.sharding.SingleDeviceSharding(where.devices[0])
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=device) for shape, dtype in shapes]
    lowered = jax.jit(f, donate_argnums=donate).lower(*args)
    return lowered.compile(compiler_options=where.compiler_options or None)


@pytest.mark.parametrize("machine", MACHINES)
def test_gathers_and_dynamic_slices_read_their_rows(machine):
    """8 rows gathered and 4 dynamically sliced from a [16384,
    7168] bf16 table read 12 rows of it, not the table (235 MB)."""

    def f(table, ids, start):
        return jnp.take(table, ids, axis=0, mode="clip"), jax.lax.dynamic_slice_in_dim(
            table, start, 4
        )

    shapes = [((16384, 7168), jnp.bfloat16), ((8,), jnp.int32), ((), jnp.int32)]
    account = jaxdd.compiled_traffic(_compile(machine, f, shapes))
    assert account["by_weight"]["table"] == 12 * ROW
    # the rows read, and written out
    assert 2 * 12 * ROW <= account["bytes"] <= 2 * 12 * ROW + INDEX_SLACK


@pytest.mark.parametrize("machine", MACHINES)
def test_donated_buffer_updated_in_place_moves_the_update(machine):
    """A [1, 1024] f32 row written into a donated [4096, 1024] buffer reads and writes
    the row; the same update of a buffer that is not donated copies the buffer first."""
    f = lambda buffer, row, at: jax.lax.dynamic_update_slice(buffer, row, (at, 0))
    shapes = [((4096, 1024), jnp.float32), ((1, 1024), jnp.float32), ((), jnp.int32)]
    row, buffer = 1024 * 4, 4096 * 1024 * 4
    donated = jaxdd.compiled_traffic(_compile(machine, f, shapes, donate=(0,)))
    assert 2 * row <= donated["bytes"] <= 2 * row + 64
    assert donated["by_weight"]["row"] == row and "buffer" not in donated["by_weight"]
    copied = jaxdd.compiled_traffic(_compile(machine, f, shapes))
    assert copied["bytes"] >= 2 * buffer


@pytest.mark.parametrize("machine", MACHINES)
def test_8_bit_floats_are_a_byte_each(machine):
    """A [4096, 1024] table in fp8 (e4m3, as the drafter's K/V with ``drafter_kv="fp8"``)
    widened and summed: a byte per element read, not nothing (HLO's f8e4m3fn names its width
    first)."""
    f = lambda table: table.astype(jnp.float32).sum(0)
    account = jaxdd.compiled_traffic(_compile(machine, f, [((4096, 1024), jnp.float8_e4m3fn)]))
    assert account["by_weight"]["table"] == 4096 * 1024
    assert account["bytes"] >= 4096 * 1024
    if machine != "cpu":  # XLA:CPU widens the table into a copy first
        assert account["bytes"] <= 4096 * 1024 + 1024 * 4 + INDEX_SLACK


@pytest.mark.parametrize("machine", MACHINES)
def test_loop_counts_every_trip(machine):
    """A 10-step fori_loop of w @ x reads w (4 MB) ten times."""

    def f(w, x):
        return jax.lax.fori_loop(0, 10, lambda i, x: jnp.tanh(w @ x), x)

    account = jaxdd.compiled_traffic(
        _compile(machine, f, [((1024, 1024), jnp.float32), ((1024,), jnp.float32)])
    )
    (loop,) = account["loops"]
    assert loop["trip_count"] == 10
    weight = 1024 * 1024 * 4
    assert account["by_weight"]["w"] == 10 * weight
    # plus the vector's reads and writes
    assert 10 * weight <= account["bytes"] <= 10 * weight + 200 * 1024 * 4


@pytest.mark.parametrize("machine", MACHINES)
def test_conditional_counts_its_larger_branch(machine):
    """lax.cond between summing a 16 MB matrix twice and a 32 MB one
    twice moves the larger branch's bytes, once (each branch a loop of
    matvecs, which keeps XLA:GPU from computing both and selecting)."""

    def f(p, small, large):
        step = lambda w: lambda i, c: jnp.tanh(w @ c[: w.shape[1]])
        twice = lambda w: jax.lax.fori_loop(0, 2, step(w), jnp.ones(4096))
        return jax.lax.cond(p, lambda: twice(small), lambda: twice(large))

    shapes = [((), jnp.bool_), ((4096, 1024), jnp.float32), ((4096, 2048), jnp.float32)]
    account = jaxdd.compiled_traffic(_compile(machine, f, shapes))
    large = 2 * 4096 * 2048 * 4
    (conditional,) = account["conditionals"]
    larger = max(range(2), key=lambda k: conditional["branch_bytes"][k])
    assert conditional["counted"] == f"branch {larger} (the larger)"
    vectors = 16 * 4096 * 4  # the carried vector's reads and writes
    assert large <= max(conditional["branch_bytes"]) <= large + vectors
    assert min(conditional["branch_bytes"]) < large / 1.9
    assert large <= account["bytes"] <= large + vectors


@pytest.mark.parametrize("machine", MACHINES)
def test_psum_over_8_devices_sends_and_receives_its_ring_share(machine):
    """A psum of 256 KB per device over 8 sends 2 x 7/8 of it and
    receives as much (a ring's reduce-scatter then all-gather)."""
    where = find_machine(machine, 8)
    mesh = Mesh(where.devices, ("x",))
    f = jax.shard_map(lambda x: jax.lax.psum(x, "x"), mesh=mesh, in_specs=P("x"), out_specs=P())
    x = jax.ShapeDtypeStruct((8, 65536), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    account = jaxdd.compiled_traffic(
        jax.jit(f).lower(x).compile(compiler_options=where.compiler_options or None)
    )
    assert account["collective_bytes"] == 4 * 7 * 65536 * 4 // 8


def test_block_fetches_count_changes_of_block_index():
    assert block_fetches((8,), lambda i: (i, 0)) == 8
    assert block_fetches((8,), lambda i: (i // 2, 0)) == 4
    assert block_fetches((2, 4), lambda i, j: (i, 0)) == 2
    assert block_fetches((2, 4), lambda i, j: (0, j)) == 8  # revisited after each row of the grid
    assert block_fetches((4,), lambda i, n: (min(i, n),), scalars=(1,)) == 2


IN_BLOCK, OUT_BLOCK = (16, 1024), (8, 1024)


def _kernel_call(platform: str):
    """A kernel over 8 grid steps that reads input blocks 0, 0, 1, 1, ..., 3, 3 (4 fetches of 64 KB
    of a 1 MB input) and writes output blocks 0..7 (8 x 32 KB), declaring what its blocks move."""
    blockings = [
        (IN_BLOCK, lambda i: (jax.lax.div(i, 2), 0), jnp.float32),
        (OUT_BLOCK, lambda i: (i, 0), jnp.float32),
    ]
    params = pltpu.CompilerParams() if platform == "tpu" else pltriton.CompilerParams(num_warps=4)

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[pl.ds(0, 8), :] * 2.0

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((256, 1024), jnp.float32),
        grid=(8,),
        in_specs=[pl.BlockSpec(*blockings[0][:2])],
        out_specs=pl.BlockSpec(*blockings[1][:2]),
        compiler_params=params,
        cost_estimate=pl.CostEstimate(
            flops=0, transcendentals=0, bytes_accessed=grid_bytes((8,), blockings)
        ),
    )


@pytest.mark.parametrize("machine", ["h200", "v5p:2x2x2"])
def test_pallas_kernel_counts_what_it_declares_or_its_operands(machine):
    """On TPU the kernel's custom call carries its cost estimate: the blocks
    it fetches (4 x 64 KB in, 8 x 32 KB out); Triton drops the estimate, so on
    GPU the call counts its operand and output once, listed as defaulted."""
    platform = "tpu" if machine.startswith("v5p") else "gpu"
    account = jaxdd.compiled_traffic(
        _compile(machine, _kernel_call(platform), [((256, 1024), jnp.float32)])
    )
    ((target, call),) = account["custom_calls"].items()
    if platform == "tpu":
        assert (target, call["counted"]) == ("tpu_custom_call", "declared")
        assert call["bytes"] == account["bytes"] == 4 * 16 * 1024 * 4 + 8 * 8 * 1024 * 4
    else:
        assert call["counted"] == "defaulted"
        assert call["bytes"] == account["bytes"] == 2 * 256 * 1024 * 4


# XLA:TPU prefetching a pool into VMEM (S(1)) before a kernel that declares reading it
PREFETCHED = """HloModule m

ENTRY %main (param.0: bf16[161,64,512], param.1: f32[1,32,512]) -> f32[1,32,512] {
  %param.0 = bf16[161,64,512]{2,1,0:T(8,128)(2,1)} parameter(0)
  %param.1 = f32[1,32,512]{2,1,0:T(8,128)} parameter(1)
  %copy-start = (bf16[161,64,512]{2,1,0:T(8,128)(2,1)S(1)}, bf16[161,64,512]{2,1,0:T(8,128)(2,1)}, \
u32[]{:S(2)}) copy-start(%param.0)
  %copy-done = bf16[161,64,512]{2,1,0:T(8,128)(2,1)S(1)} copy-done(%copy-start)
  ROOT %kernel = f32[1,32,512]{2,1,0:T(8,128)} custom-call(%param.1, %copy-done, %copy-done), \
custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"cost_estimate":\
{"bytes_accessed":"DECLARED"}}}
}
"""


def test_a_kernel_reading_a_pool_prefetched_on_chip_counts_the_prefetch_once():
    """The copy-start reads the pool from HBM; the kernel's declared bytes less the pool (one
    operand, passed twice) are what it moves besides: the pool counts once, not twice."""
    pool, queries = 161 * 64 * 512 * 2, 32 * 512 * 4
    account = jaxdd.compiled_traffic(PREFETCHED.replace("DECLARED", str(pool + 2 * queries)))
    call = account["custom_calls"]["tpu_custom_call"]
    assert (call["bytes"], call["on_chip"]) == (2 * queries, pool)
    assert account["bytes"] == pool + 2 * queries


@pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels need a C++ compiler")
def test_cpu_ffi_kernel_counts_its_operands_and_output():
    """A CPU FFI matvec (rows [2, 4096] fp32 times a [4096, 1024] bf16 weight)
    declares nothing: its operands and output, once, listed as defaulted."""
    f = cpu_kernels.dense_matvec
    account = jaxdd.compiled_traffic(
        _compile("cpu", f, [((2, 4096), jnp.float32), ((4096, 1024), jnp.bfloat16)])
    )
    (call,) = [c for c in account["custom_calls"].values() if c["counted"] == "defaulted"]
    assert call["bytes"] == 2 * 4096 * 4 + 4096 * 1024 * 2 + 2 * 1024 * 4
    assert account["by_weight"]["weight"] == 4096 * 1024 * 2


@pytest.mark.parametrize("machine", MACHINES)
def test_stages_come_from_named_scopes(machine):
    """Bytes go to the round's stage that the op's named scope says: a 16
    MB sum in "verify", a gathered row in "draft", the rest in "other"."""

    def f(table, ids, w):
        with jax.named_scope("draft"):
            rows = jnp.take(table, ids, axis=0, mode="clip")
        with jax.named_scope("verify"):
            total = w.sum(0)
        return rows, total

    shapes = [((16384, 7168), jnp.bfloat16), ((1,), jnp.int32), ((4096, 1024), jnp.float32)]
    account = jaxdd.compiled_traffic(_compile(machine, f, shapes))
    stages = account["by_stage"]
    assert 4096 * 1024 * 4 <= stages["verify"] <= 4096 * 1024 * 4 + INDEX_SLACK
    assert 2 * ROW <= stages["draft"] <= 2 * ROW + INDEX_SLACK
    assert sum(stages.values()) == account["bytes"]
    assert account["top_ops"][0]["stage"] == "verify"


@pytest.mark.slow
@pytest.mark.parametrize("machine", MACHINES)
@pytest.mark.parametrize(
    ("method", "sampled"), [("ar", False), ("dflash", False), ("ddtree", True)]
)
def test_rounds_copy_no_weight(planned, machine, method, sampled):
    """A round reads its weights where they are stored: no instruction copies, concatenates or
    relays one out (XLA:GPU's dot merger concatenated the MLP's gate and up, and the drafter's q,
    k and v, inside every round), and every weight read is attributed to the model's own name."""
    options = PlanOptions(machine, 8, "tp", method, 16, 256, sampled=sampled)
    account = planned(options)[0]["compiled_traffic"]
    assert account["weight_copies"] == []
    assert "target/lm_head" in account["by_weight"]
    assert account["bytes"] >= account["by_weight"]["target/lm_head"] > 0


@pytest.mark.slow
def test_the_floor_is_the_compiled_rounds_batch(planned):
    """A plan of a batch compares its compiled round, which runs every row, with the floor of
    that many rows: each row's cache once, the weights once for all (and each token's embedding
    row)."""
    floors = {  # batch 1: test_rounds_copy_no_weight's H200 DFlash round
        batch: planned(PlanOptions("h200", 8, "tp", "dflash", 16, 256, batch))[0][
            "compiled_traffic"
        ]["floor"]
        for batch in (1, 2)
    }
    assert floors[2]["kv"] == 2 * floors[1]["kv"] > 0
    assert floors[1]["weights"] <= floors[2]["weights"] < 1.1 * floors[1]["weights"]


@pytest.mark.slow
def test_sampled_tree_round_updates_the_cache_in_place_on_rtx_pro_6000():
    """K2.6 at full width (one layer), the sampled DDTree round for RTX PRO 6000: the
    tree-attention kernel reads the cache before the new rows are written into it, so
    the donated cache is updated in place. Unordered, XLA:GPU wrote first, into a
    copy of the cache (``weight_copies`` names it), and copied the result back."""
    options = PlanOptions("rtx-pro-6000", 8, "tp", "ddtree", 16, 8192, layers=1, sampled=True)
    account = plan(
        "tests/fixtures/kimi_k25_config.json", "tests/fixtures/kimi_k26_dflash_config.json", options
    )
    assert account["compiled_traffic"]["weight_copies"] == []


@pytest.mark.parametrize("machine", ["h200", "v5p:2x2x2"])
def test_bf16_router_gate_is_read_as_stored(machine):
    """K2.6's router gate (7168 x 384, bf16 as stored) for a DDTree verify's 17 tokens is
    read once, in bf16 (the rest: x's parts and the scores). A matmul of fp32 x with it
    made XLA:GPU write an fp32 copy of the gate and read that (5x the gate's bytes)."""
    from flax import nnx

    from jaxdd.config import KimiConfig
    from jaxdd.models.moe import Router
    from jaxdd.runtime.backend import Backend

    config = KimiConfig.from_json_file("tests/fixtures/kimi_k25_config.json")
    graphdef = nnx.split(nnx.eval_shape(lambda: Router(config, "bfloat16", nnx.Rngs(0))))[0]
    where = find_machine(machine, 1)
    backend = Backend.of_devices(where.devices)

    def f(weight, bias, x):
        router = nnx.merge(
            graphdef, nnx.State({"weight": nnx.Param(weight), "bias": nnx.Param(bias)})
        )
        return router(x, backend)

    gate = 7168 * 384 * 2
    shapes = [((7168, 384), jnp.bfloat16), ((384,), jnp.float32), ((17, 7168), jnp.float32)]
    compiled = _compile(machine, f, shapes)
    account = jaxdd.compiled_traffic(compiled)
    assert account["by_weight"]["weight"] == gate
    assert account["bytes"] <= 1.5 * gate
    # x's parts survive the compiler (XLA:GPU folds a bf16
    # round trip away, which made the low parts x - x).
    assert not re.search(r"subtract\((%[\w.-]+), \1\)", compiled.as_text())


def test_gathered_int4_experts_are_read_once_on_gpu():
    """The MoE's gathered dispatch on XLA:GPU: a DFlash block's 64 (token,
    slot) pairs through K2.6's 384 INT4 experts (TP8 shards, gate / up / down)
    read each pair's expert about once. With the words unpacked by a bitcast
    to uint4, XLA writes the gathered experts out and reads them again."""
    from flax import nnx

    from jaxdd.models.expert_dispatch import gathered_pairs
    from jaxdd.models.quant import Int4Experts
    from jaxdd.runtime.backend import Backend

    experts, hidden, ffn, pairs = 384, 7168, 256, 64
    axes = ("experts", "embed", "expert_mlp")
    make = lambda shape: nnx.eval_shape(lambda: Int4Experts(shape, jnp.bfloat16, axes, 32))
    projections = [
        make((experts, hidden, ffn)),
        make((experts, hidden, ffn)),
        make((experts, ffn, hidden)),
    ]
    where = find_machine("h200", 1)
    # the platform pair_experts unpacks by shifts on
    assert Backend.of_devices(where.devices).platform == "gpu"
    pieces_shapes = [
        [(p.packed.shape, jnp.int32), (p.scale.shape, jnp.bfloat16)] for p in projections
    ]

    def moved(shifts: bool) -> int:
        def f(rows, chosen, *flat):
            return gathered_pairs(
                rows, chosen, projections, [flat[0:2], flat[2:4], flat[4:6]], shifts=shifts
            )

        shapes = [
            ((pairs, hidden), jnp.bfloat16),
            ((pairs,), jnp.int32),
            *(s for p in pieces_shapes for s in p),
        ]
        return jaxdd.compiled_traffic(_compile("h200", f, shapes))["bytes"]

    per_expert = sum(
        math.prod(shape[1:]) * jnp.dtype(dtype).itemsize
        for p in pieces_shapes
        for shape, dtype in p
    )
    assert pairs * per_expert <= moved(shifts=True) <= 1.3 * pairs * per_expert
    assert moved(shifts=False) >= 2 * pairs * per_expert


@pytest.mark.parametrize("machine", ["h200", "rtx-pro-6000"])
@pytest.mark.parametrize("pairs", [64, 136])
def test_gathered_int4_experts_through_the_gpu_kernel_are_read_once(machine, pairs):
    """The MoE's gathered dispatch as the GPU backend runs it (``pair_experts``: the
    Pallas INT4 kernel) at a DFlash block's 64 and a DDTree verify's 136 (token, slot)
    pairs through K2.6's 384 INT4 experts (TP8 shards): each pair's expert is read
    once, plus the rows, on sm_90 and on sm_120, where XLA's own form wrote the
    gathered experts out and read them again (1.4-1.6x the floor of a whole round)."""
    from flax import nnx

    from jaxdd.models.expert_dispatch import pair_experts
    from jaxdd.models.quant import Int4Experts

    experts, hidden, ffn = 384, 7168, 256
    axes = ("experts", "embed", "expert_mlp")
    make = lambda shape: nnx.eval_shape(lambda: Int4Experts(shape, jnp.bfloat16, axes, 32))
    projections = [
        make((experts, hidden, ffn)),
        make((experts, hidden, ffn)),
        make((experts, ffn, hidden)),
    ]
    where = find_machine(machine, 1)
    pieces_shapes = [
        [(p.packed.shape, jnp.int32), (p.scale.shape, jnp.bfloat16)] for p in projections
    ]

    def f(rows, chosen, *flat):
        through = pair_experts(projections, [flat[0:2], flat[2:4], flat[4:6]], where.backend)
        return through(rows, chosen)

    shapes = [
        ((pairs, hidden), jnp.bfloat16),
        ((pairs,), jnp.int32),
        *(s for p in pieces_shapes for s in p),
    ]
    account = jaxdd.compiled_traffic(_compile(machine, f, shapes))
    call = account["custom_calls"]["__gpu$xla.gpu.triton"]
    # gate, up and down through the kernel
    assert (call["count"], call["counted"]) == (3, "declared")
    per_expert = sum(
        math.prod(shape[1:]) * jnp.dtype(dtype).itemsize
        for p in pieces_shapes
        for shape, dtype in p
    )
    assert pairs * per_expert <= account["bytes"] <= 1.1 * pairs * per_expert
