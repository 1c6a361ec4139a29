"""A partly-right "oracle" drafter, for both jaxdd and the dflash reference.

Random drafters accept almost nothing. The oracle drafts, for absolute position p, the target's
own greedy token G[p] where right[p], and the real drafter's token elsewhere, so rounds accept
anything from 0 to block-1 drafts and every commit path runs, while the real drafter still does
all its work. The same rule drives the PyTorch reference loop (by patching its drafter) and jaxdd
(a wrapper with ``DFlashDrafter``'s methods), so acceptance lengths can be compared exactly.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from jaxdd.models.drafter import DFlashDrafter


class OracleDrafter(nnx.Module):
    """Duck-types ``DFlashDrafter`` (config / inject / draft_logits) for the jitted rounds.

    Where right[p], the greedy token's logit is lifted above the row's maximum: it
    becomes the argmax (DFlash) and the top-ranked child (DDTree), while the rest of
    the row keeps the real drafter's ranking. With ``second=True`` it is placed just
    below the maximum instead: DFlash misses it, a DDTree finds it as a second child.
    """

    def __init__(
        self, drafter: DFlashDrafter, greedy: np.ndarray, right: np.ndarray, second: bool = False
    ):
        self.drafter = drafter
        self.lift = -1e-3 if second else 10.0
        self.config = drafter.config
        self.greedy = nnx.Variable(jnp.asarray(greedy, jnp.int32))
        self.right = nnx.Variable(jnp.asarray(right))

    def inject(self, cache, features, positions, count):
        return self.drafter.inject(cache, features, positions, count)

    def draft_logits(self, target, cache, bonus, start, block_len, block, kernel=None):
        logits, cache = self.drafter.draft_logits(
            target, cache, bonus, start, block_len, block, kernel
        )
        positions = start[:, None] + jnp.arange(1, block)[None, :]
        lifted = jnp.max(logits, axis=-1, keepdims=True) + self.lift
        truth = jax.nn.one_hot(self.greedy[...][positions], logits.shape[-1], dtype=bool)
        return jnp.where(self.right[...][positions][..., None] & truth, lifted, logits), cache


def patched_reference_drafter(drafter, greedy: np.ndarray, right: np.ndarray, second: bool = False):
    """A copy of a dflash DFlashDraftModel whose logits get the same lift as
    ``OracleDrafter`` (its own forward still runs, so its cache stays right)."""
    drafter = copy.deepcopy(drafter)
    forward = drafter.forward
    compute_logits = drafter.compute_logits
    seen = {}
    lift = -1e-3 if second else 10.0

    def recording_forward(*args, position_ids, **kwargs):
        seen["positions"] = position_ids[0].numpy()
        return forward(*args, position_ids=position_ids, **kwargs)

    def oracle_logits(hidden, head):
        logits = compute_logits(hidden, head)
        positions = seen["positions"][-hidden.shape[1] :]  # the drafted block positions start+1 ..
        truth = torch.nn.functional.one_hot(
            torch.from_numpy(greedy[positions]), logits.shape[-1]
        ).bool()[None]
        lifted = logits.amax(-1, keepdim=True) + lift
        return torch.where(
            torch.from_numpy(right[positions])[None, :, None] & truth, lifted, logits
        )

    drafter.forward = recording_forward
    drafter.compute_logits = oracle_logits
    return drafter
