"""Where the target's MLA latent cache lives under TP, and what each placement costs a round.

Replicated (the runtime's layout, ``state_shardings``): every device stores every latent row and
reads all of them in every round, since each of its heads attends over the whole context.
Striped (decode context parallelism): the cache is cut into ``PAGE_TOKENS``-token pages dealt
round-robin over the devices; each device attends, for all heads, over its own pages only, and
the partial outputs merge exactly by their log-sum-exp. Striping divides the cache reads by the
devices and adds, per layer, the merge's collectives: the absorbed queries of all heads gathered
to every device, then either one all-to-all of (partial output, log-sum-exp) merged locally, or
an all-gather of the log-sum-exps and a reduce-scatter of the rescaled outputs. The link model
(``jaxdd.planning.hardware``) picks the cheaper merge; the cheaper layout is the default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jaxdd.cache.paging import PAGE_TOKENS, tokens_on
from jaxdd.config import KimiConfig
from jaxdd.planning.hardware import Hardware
from jaxdd.types import LAYOUTS, CacheLayout, Method

BF16 = 2
# partial outputs and log-sum-exps cross the link in float32, so the
# merge is the one-device attention up to float32 rounding
FLOAT32 = 4
ALL_TO_ALL = "all-to-all"
GATHER_SCATTER = "all-gather + reduce-scatter"


def latent_row_bytes(config: KimiConfig) -> int:
    """One token's latent rows over all layers (kv_lora_rank + rope values, bf16)."""
    return (config.kv_lora_rank + config.qk_rope_head_dim) * BF16 * config.num_hidden_layers


def tokens_read(context: int, devices: int, layout: CacheLayout) -> int:
    """Context tokens whose latent rows the busiest device reads: all of them replicated;
    striped, those of the device with the most of the pages dealt to it."""
    if layout == "replicated":
        return context
    return max(tokens_on(context, device, PAGE_TOKENS, devices) for device in range(devices))


def merge_costs(config: KimiConfig, tokens: int, devices: int) -> dict[str, dict[str, float]]:
    """Per merge scheme, the bytes one device sends in a round verifying ``tokens`` tokens and
    the collectives it runs (ring conventions: an all-gather, reduce-scatter or all-to-all of a
    result of M bytes per device sends (c - 1) / c M)."""
    if devices == 1:
        return {}
    share = (devices - 1) / devices
    token_heads = tokens * config.num_attention_heads
    # the absorbed queries, [T, heads, latent + rope]
    queries = share * token_heads * (config.kv_lora_rank + config.qk_rope_head_dim) * BF16
    outputs = share * token_heads * config.kv_lora_rank * FLOAT32
    # every device's log-sum-exps [T, heads] reach every device
    lse_gather = (devices - 1) * token_heads * FLOAT32
    layers = config.num_hidden_layers
    return {
        ALL_TO_ALL: {
            "bytes": layers * (queries + outputs + share * token_heads * FLOAT32),
            "collectives": 2 * layers,
        },
        GATHER_SCATTER: {
            "bytes": layers * (queries + lse_gather + outputs),
            "collectives": 3 * layers,
        },
    }


def link_seconds(sent: float, collectives: float, hardware: Hardware) -> float:
    """Time on the link: the bytes a device sends, and a latency per collective."""
    return sent / hardware.link + collectives * hardware.collective_latency


def cheapest_merge(merges: Mapping[str, Mapping[str, float]], hardware: Hardware) -> str | None:
    """The merge scheme with the least link time on ``hardware`` (None: nothing to merge)."""
    if not merges:
        return None
    cost = lambda name: link_seconds(merges[name]["bytes"], merges[name]["collectives"], hardware)
    return min(merges, key=cost)


@dataclasses.dataclass(frozen=True)
class LayoutChoice:
    """The layout a plan accounts and why."""

    layout: CacheLayout
    reason: str


def round_name(method: Method, budget: int, batch: int) -> str:
    """How a plan names its round: AR, DFlash or DDTree-``budget``, and its batch above 1."""
    name = {"ar": "AR", "dflash": "DFlash", "ddtree": f"DDTree-{budget}"}[method]
    return name + (f" (batch {batch})" if batch > 1 else "")


def choose_layout(
    requested: CacheLayout | None,
    floors: Mapping[str, float],
    capacity: Mapping[str, int],
    needed: int,
    hardware: Hardware | None,
    devices: int,
    round_name: str,
) -> LayoutChoice:
    """``requested``, or the layout whose floor of the plan's round (``floors``: seconds per
    layout on the plan's hardware, all its rows together) is lower; striped when only its
    pages (``capacity``: context tokens per layout) hold the ``needed`` tokens (batch x max
    length)."""
    if requested is not None:
        return LayoutChoice(requested, f"--cache-layout {requested}, as asked")
    if devices == 1:
        return LayoutChoice("replicated", "one device: nothing to stripe over")
    if capacity["replicated"] < needed <= capacity["striped"]:
        return LayoutChoice(
            "striped",
            f"replicated rows hold {capacity['replicated']:,} context tokens, the batch needs "
            f"{needed:,}; striped holds {capacity['striped']:,}",
        )
    short = ""
    if capacity["striped"] < needed:
        short = f" (neither layout holds the batch's {needed:,} context tokens)"
    if hardware is None:
        return LayoutChoice(
            "replicated",
            "the simulated CPU devices have no link model (jaxdd.planning.hardware) to weigh "
            f"the merge's collectives against the cache reads striping saves{short}",
        )
    layout = min(LAYOUTS, key=lambda name: floors[name])
    return LayoutChoice(
        layout,
        f"the {round_name} floor on {hardware.name}: {floors['striped'] * 1e3:.2f} ms striped "
        f"vs {floors['replicated'] * 1e3:.2f} ms replicated{short}",
    )
