"""The errors jaxdd raises for bad input; each message names the field, tensor or limit at fault."""

from pathlib import Path


class ConfigError(ValueError):
    """A config.json field is missing, of the wrong type, unsupported or inconsistent."""


class CheckpointError(ValueError):
    """A checkpoint directory is missing files or tensors, or holds tensors that do not fit the config."""


class InputError(ValueError):
    """Token ids, positions, masks, cache sizes or generation settings that the model cannot take."""


def checkpoint_directory(path: str | Path) -> Path:
    """``path`` as a Path, or a CheckpointError when it is not a directory (the loaders' first check)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    return path
