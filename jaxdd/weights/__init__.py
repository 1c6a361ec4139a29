"""Weights on disk: the HF layout tables and reader, orbax checkpoints
written atomically, file checksums and the tokenizer files."""
