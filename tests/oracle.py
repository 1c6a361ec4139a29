"""A partly-right "oracle" drafter, for both jaxdd and the dflash reference.

Random drafters accept almost nothing. The oracle drafts, for absolute position p, the target's own greedy token
G[p] where right[p], and a wrong token elsewhere, so rounds accept anything from 0 to block-1 drafts and every
commit path runs. The same rule drives the PyTorch reference loop (by patching its drafter) and jaxdd (as a
drafter module with the same methods as ``DFlashDrafter``), so acceptance lengths can be compared exactly.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from jaxdd.config import DrafterConfig
from jaxdd.drafter import DraftCache


def oracle_drafts(greedy: np.ndarray, right: np.ndarray, positions, vocab: int):
    """Draft token for each absolute position: greedy[p] if right[p] else a different token."""
    truth = greedy[positions]
    return np.where(right[positions], truth, (truth + 1) % vocab)


class OracleDrafter(nnx.Module):
    """Duck-types ``DFlashDrafter`` (inject / propose) for the jitted DFlash round."""

    def __init__(self, config: DrafterConfig, greedy: np.ndarray, right: np.ndarray, vocab: int):
        self.config = config
        self.greedy = nnx.Variable(jnp.asarray(greedy, jnp.int32))
        self.right = nnx.Variable(jnp.asarray(right))
        self.vocab = vocab

    def inject(self, cache: DraftCache, features, positions, count) -> DraftCache:
        return cache.replace(length=cache.length + count)

    def propose(self, target, cache, bonus, start, block_len, block):
        positions = start[:, None] + jnp.arange(1, block)[None, :]
        truth = self.greedy[...][positions]
        return jnp.where(self.right[...][positions], truth, (truth + 1) % self.vocab).astype(jnp.int32)


def patch_reference_drafter(drafter, greedy: np.ndarray, right: np.ndarray, vocab: int):
    """Make a dflash DFlashDraftModel draft by the oracle rule (its forward still runs, so its cache stays right)."""
    forward, seen = drafter.forward, {}

    def recording_forward(*args, position_ids, **kwargs):
        seen["positions"] = position_ids[0].numpy()
        return forward(*args, position_ids=position_ids, **kwargs)

    def oracle_logits(hidden, head):
        block_positions = seen["positions"][-hidden.shape[1] :]
        drafts = oracle_drafts(greedy, right, block_positions, vocab)
        return torch.nn.functional.one_hot(torch.from_numpy(drafts), vocab).float()[None]

    drafter.forward = recording_forward
    drafter.compute_logits = oracle_logits
    return drafter
