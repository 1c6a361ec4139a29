"""The errors jaxdd raises for bad input; each message names the field, tensor or limit at fault."""


class ConfigError(ValueError):
    """A config.json field is missing, of the wrong type, unsupported or inconsistent."""


class CheckpointError(ValueError):
    """A checkpoint directory is missing files or tensors, or holds tensors that do not fit the config."""


class InputError(ValueError):
    """Token ids, positions, masks, cache sizes or generation settings that the model cannot take."""
