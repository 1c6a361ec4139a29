"""The project's small vocabularies, each a ``Literal`` with
its choices derived once (CLIs and checks use these)."""

from __future__ import annotations

from typing import Literal, get_args

Method = Literal["ar", "dflash", "ddtree"]  # plain decoding, linear DFlash, DDTree
# how MLA attends (``jaxdd.models.target.MLAttention``)
Attention = Literal["naive", "absorbed", "pallas"]
# what a decoder may be asked for (auto: the platform's)
AttentionChoice = Literal["auto", "absorbed", "pallas"]
MoeMode = Literal["tp", "ep"]  # routed experts split by FFN width, or as whole experts
Platform = Literal["cpu", "gpu", "tpu"]
# ``jaxdd.models.moe``
Dispatch = Literal["dense", "gathered", "grouped", "scan", "skipping", "tiled"]
TreeLogits = Literal["scaled", "raw"]  # what a sampled DDTree round builds its tree from
# the MLA latent cache on a mesh: whole on every device, or its pages dealt over them
CacheLayout = Literal["striped", "replicated"]
# the drafter's context K/V: in the models' dtype, or 8-bit floats (e4m3; drafts only)
DrafterKV = Literal["model", "fp8"]

METHODS: tuple[Method, ...] = get_args(Method)
ATTENTIONS: tuple[Attention, ...] = get_args(Attention)
ATTENTION_CHOICES: tuple[AttentionChoice, ...] = get_args(AttentionChoice)
MOE_MODES: tuple[MoeMode, ...] = get_args(MoeMode)
DISPATCHES: tuple[Dispatch, ...] = get_args(Dispatch)
TREE_LOGITS: tuple[TreeLogits, ...] = get_args(TreeLogits)
LAYOUTS: tuple[CacheLayout, ...] = get_args(CacheLayout)
DRAFTER_KVS: tuple[DrafterKV, ...] = get_args(DrafterKV)


def verified_tokens(method: Method, block: int, budget: int | None) -> int:
    """Tokens one round verifies per request: AR its one
    token, DFlash its block, DDTree its tree and root."""
    if method == "ddtree":
        return budget + 1
    return 1 if method == "ar" else block
