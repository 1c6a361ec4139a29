"""The plan as text (``python -m jaxdd.plan`` without ``--json``): the round's traffic floor
per layout, the caches' capacity, and with a compile the bytes per device, the verdict and what
the compiled round moves."""

from __future__ import annotations

from typing import Any

from jaxdd.decoding.memory_maps import HEADROOM
from jaxdd.planning.hardware import GPUS
from jaxdd.planning.traffic import format_table

GB = 1e9
# of each GPU's memory that JAX's allocator takes (XLA_PYTHON_CLIENT_MEM_FRACTION)
DEFAULT_GPU_FRACTION = 0.75


def report(result: dict[str, Any]) -> str:
    where = result["hardware"]
    round_name = {
        "ar": "AR step",
        "dflash": "DFlash round",
        "ddtree": f"DDTree round (budget {result['budget']})",
    }
    lines = [
        f"{result['config']}: {result['layers']} layers, routed experts "
        f"{result['routed_experts']}, "
        f"{result['devices']} x {where['device_kind']} ({where['name']}), MoE {result['moe']}, "
        f"batch {result['batch']}, max length {result['max_len']} ({result['cache_slots']} "
        f"cache slots), the drafter's K/V in {result['drafter_kv']}",
        f"per round and device at {result['max_len']} tokens of context (the floor, a roofline: "
        f"max(bytes / bandwidth, FLOPs / peak) + link; c: compute-bound):",
        format_table(result["traffic"]),
        "most tokens/s at the floor: "
        + ", ".join(f"{GPUS[gpu].name} {name}" for gpu, name in result["fastest_round"].items()),
        *layout_report(result),
        *maps_report(result.get("memory_maps"), result["batch"], result["max_len"]),
    ]
    if "per_device_bytes" not in result:
        return "\n".join(lines)
    sampled = "sampled" if result["sampled"] else "greedy"
    lines.append(
        f"{round_name[result['method']]}, {sampled}, attention {result['attention']}, "
        f"MoE dispatch {result['dispatch']}, per device:"
    )
    notes = {}
    if result["cache_layout"] == "striped":
        devices = result["devices"]
        notes["target_cache"] = f" (striped over {devices} devices: one page in {devices} on each)"
    lines += [
        f"  {name:<16} {value / GB:9.2f} GB{notes.get(name, '')}"
        for name, value in result["per_device_bytes"].items()
    ]
    compiled = result["compiled"]
    lines.append(f"compiled for {where['platform']} in {compiled['compile_seconds']} s")
    memory = where["memory_bytes"] / GB
    total = result["per_device_bytes"]["total"] / GB
    verdict = "fits" if result["fits"] else "does not fit"
    lines.append(f"{verdict} {where['name']}: needs {total:.1f} of {memory:.0f} GB per device")
    if "compiled_traffic" in result:
        lines += traffic_report(result["compiled_traffic"])
    if not compiled["fits_compiler"]:
        lines[-1] += " (the compiler ran out of memory)"
    elif (
        where["platform"] == "gpu"
        and result["fits"]
        and result["memory_fraction"] > DEFAULT_GPU_FRACTION
    ):
        lines.append(
            f"run with XLA_PYTHON_CLIENT_MEM_FRACTION={result['memory_fraction']:.2f} or "
            f"more: JAX preallocates "
            f"{DEFAULT_GPU_FRACTION:.0%} of each GPU by default"
        )
    return "\n".join(lines)


def layout_report(result: dict[str, Any]) -> list[str]:
    """The latent cache's layout and why, the other layout's rounds, and what
    context each layout's pages hold in the memory left per device."""
    chosen = result["cache_layout"]
    other = next(name for name in result["traffic_by_layout"] if name != chosen)
    lines = [
        *merge_report(result["traffic"]),
        f"latent cache {chosen}: {result['cache_layout_reason']}",
    ]
    lines += [
        f"the latent cache {other} instead:",
        format_table(result["traffic_by_layout"][other]),
    ]
    lines += merge_report(result["traffic_by_layout"][other])
    return lines + capacity_report(result["cache_capacity"], result["devices"])


def merge_report(rows: list[dict]) -> list[str]:
    """Striped rounds: each merge scheme the link model chose, on which GPUs, its collectives
    and the MB it sends per round (one figure per row of the table)."""
    if not rows[0].get("merges"):
        return []
    lines = []
    for merge in sorted({t["merge"] for row in rows for t in row["targets"].values()}):
        where = [
            GPUS[key].name
            for key in rows[0]["targets"]
            if any(row["targets"][key]["merge"] == merge for row in rows)
        ]
        gpus = "every GPU" if len(where) == len(rows[0]["targets"]) else ", ".join(where)
        collectives = rows[0]["merges"][merge]["collectives"]
        sent = " / ".join(f"{row['merges'][merge]['bytes'] / 1e6:.1f}" for row in rows)
        lines.append(
            f"  merge by {merge} (the link model's choice on {gpus}), "
            f"{collectives} collectives per round, MB sent per round: {sent}"
        )
    return lines


def capacity_report(capacity: dict[str, Any], devices: int) -> list[str]:
    """Context tokens per layout in the memory left after weights (and temporaries)."""
    slot = capacity["slot_bytes"]
    replicated, striped = capacity["replicated"]["tokens"], capacity["striped"]["tokens"]
    after = "weights and temporaries" if capacity["activations_bytes"] else "weights"
    lines = [
        f"cache capacity ({capacity['free_bytes'] / GB:.2f} GB per device after {after}, "
        f"{capacity['page_tokens']}-token pages): replicated {replicated:,} context tokens, "
        f"striped {striped:,}"
    ]
    if replicated:
        lines[-1] += (
            f" ({striped / replicated:.2f}x: striping divides the latent rows, "
            f"{slot['latent']:,.0f} B per token, over {devices} devices, not the drafter's K/V, "
            f"{slot['drafter']:,.0f} B per token and device, already split by heads)"
        )
    return lines


def traffic_report(account: dict[str, Any], top: int = 10) -> list[str]:
    """The compiled round's bytes beside the floor's
    parts: per stage, and its largest instructions."""
    mb = lambda n: f"{n / 1e6:.1f} MB"
    floor = account["floor"]
    parts = {
        "weights": "weights",
        "experts": "experts",
        "kv": "caches",
        "drafter": "drafter + lm_head again",
        "drafter_kv": "drafter's context K/V",
    }
    lines = [
        f"compiled traffic per device: {account['bytes'] / GB:.3f} GB, "
        f"{account['ratio']:.2f}x the floor's "
        f"{account['floor_bytes'] / GB:.3f} GB",
        "  floor:    "
        + ", ".join(f"{name} {mb(floor[key])}" for key, name in parts.items())
        + f", all-reduces {mb(2 * floor['allreduce_bytes'])}",
        "  compiled: "
        + ", ".join(f"{stage} {mb(n)}" for stage, n in account["by_stage"].items() if n)
        + f" (collectives {mb(account['collective_bytes'])})",
        "  largest instructions:",
    ]
    lines += [
        f"    {op['bytes'] / 1e6:9.1f} MB  {op['op']:<14} {op['stage']:<7} {op['name']} "
        f"({op['scope'][-60:]})"
        for op in account["top_ops"][:top]
    ]
    return lines


def maps_report(maps: dict[str, Any] | None, batch: int, max_len: int) -> list[str]:
    """On a CPU host: the memory maps a server of the plan's batch and length compiles into,
    against this host's vm.max_map_count (``jaxdd.decoding.memory_maps``)."""
    if maps is None:
        return []
    limit = maps["limit"]
    verdict = "fits" if maps["fits"] else "does not fit"
    host = "no vm.max_map_count here" if limit is None else f"vm.max_map_count {limit:,}"
    return [
        f"memory maps: a server of {batch} rows at {max_len} tokens compiles {maps['programs']} "
        f"programs, {maps['maps']:,} maps on XLA:CPU; {verdict} {HEADROOM:.0%} of this host's "
        + host
    ]
