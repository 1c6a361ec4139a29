"""jaxdd: DFlash / DDTree speculative decoding for Kimi K2.x targets in JAX.

The stable Python API:

    import jaxdd
    target = jaxdd.load_target("checkpoint_dir", dtype="float32")   # HF directory or jaxdd checkpoint
    logits = target.logits([[1, 2, 3]])                              # [batch, T, vocab] fp32 numpy
    cache = target.new_cache(batch=1, max_len=128)                   # static-shape MLA latent cache
    out = target.forward([[1, 2, 3]], cache)                         # logits, tapped hidden states, cache
    jaxdd.save_target(target.model, "new_checkpoint_dir")            # orbax checkpoint, written atomically
"""

from jaxdd.api import ForwardResult, InputError, Target, load_target
from jaxdd.cache import LatentCache
from jaxdd.checkpoint import save_target
from jaxdd.config import ConfigError, KimiConfig
from jaxdd.hf_weights import CheckpointError

__all__ = [
    "CheckpointError",
    "ConfigError",
    "ForwardResult",
    "InputError",
    "KimiConfig",
    "LatentCache",
    "Target",
    "load_target",
    "save_target",
]
