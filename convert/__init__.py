"""Weight conversion between HF safetensors checkpoints and jaxdd checkpoints."""
