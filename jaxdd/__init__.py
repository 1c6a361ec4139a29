"""jaxdd: DFlash / DDTree speculative decoding for Kimi K2.x targets in JAX.

The stable Python API:

    import jaxdd
    target = jaxdd.load_target("checkpoint_dir",
        dtype="float32")  # HF directory or jaxdd checkpoint
    logits = target.logits([[1, 2, 3]])  # [batch, T, vocab] fp32 numpy
    cache = target.new_cache(batch=1, max_len=128)  # static-shape MLA latent cache
    out = target.forward([[1, 2, 3]], cache)  # logits, tapped hidden states, cache
    jaxdd.save_target(target.model, "new_checkpoint_dir")  # orbax checkpoint, written atomically

    drafter = jaxdd.load_drafter("drafter_dir", dtype="float32")  # z-lab DFlash or jaxdd checkpoint
    result = target.generate([1, 2, 3], drafter=drafter, max_new_tokens=32)  # greedy DFlash
    result.tokens, result.acceptance_lengths  # new tokens; tokens per round
    sampled = target.generate([1, 2, 3], drafter=drafter, sampling=jaxdd.Sampling(temperature=0.7,
        seed=1))
"""

# first: imports JAX without the CUDA plugin's start-up lines
import jaxdd.runtime.startup  # noqa: F401
from jaxdd.api import ForwardResult, Target, load_drafter, load_pair, load_target
from jaxdd.cache import LatentCache
from jaxdd.config import DrafterConfig, KimiConfig
from jaxdd.decoding.engine import Generation, SpeculativeDecoder
from jaxdd.decoding.sampling import Sampling
from jaxdd.errors import CheckpointError, ConfigError, InputError, LargeRoundWarning
from jaxdd.planning.compiled_traffic import compiled_traffic
from jaxdd.weights.checkpoint import save_drafter, save_target

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DrafterConfig",
    "ForwardResult",
    "Generation",
    "InputError",
    "KimiConfig",
    "LargeRoundWarning",
    "LatentCache",
    "Sampling",
    "SpeculativeDecoder",
    "Target",
    "compiled_traffic",
    "load_drafter",
    "load_pair",
    "load_target",
    "save_drafter",
    "save_target",
]
