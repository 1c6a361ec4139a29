"""Model configuration: the target's and the drafter's, each a frozen dataclass read from an HF
``config.json`` (``jaxdd.config.target``, ``jaxdd.config.drafter``); a missing or inconsistent
field raises ``ConfigError`` naming the field."""

from jaxdd.config.drafter import DrafterConfig, default_target_layer_ids
from jaxdd.config.fields import in_file
from jaxdd.config.rope import YarnConfig, yarn_mscale
from jaxdd.config.target import KimiConfig

__all__ = [
    "DrafterConfig",
    "KimiConfig",
    "YarnConfig",
    "default_target_layer_ids",
    "in_file",
    "yarn_mscale",
]
