"""Weight conversion between HF safetensors checkpoints and jaxdd checkpoints."""

import jaxdd.runtime.startup  # noqa: F401  (JAX imported quietly before the converters import it)
