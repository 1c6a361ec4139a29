"""Reading an HF ``config.json``: typed fields whose errors name the field as the file spells it,
and the file's path on any error."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from jaxdd.errors import ConfigError, read_json

Parsed = TypeVar("Parsed")


def read_config_json(path: str | Path) -> Any:
    return read_json(path, ConfigError, "config file")


def in_file(
    path: str | Path, parse: Callable[[Mapping[str, Any]], Parsed], raw: Mapping[str, Any]
) -> Parsed:
    """``parse(raw)``, a ConfigError naming the file ``path`` it was read from."""
    try:
        return parse(raw)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None


class FieldReader:
    """Typed field access with error messages that name the field as it appears in the file."""

    def __init__(self, data: Mapping[str, Any], prefix: str):
        self.data = data
        self.prefix = prefix

    def fail(self, key: str, msg: str) -> ConfigError:
        return ConfigError(f"{self.prefix}{key}: {msg}")

    def get(self, key: str, kind: type, default: Any = dataclasses.MISSING) -> Any:
        if key not in self.data or (self.data[key] is None and kind is not type(None)):
            if default is dataclasses.MISSING:
                raise self.fail(key, "missing")
            return default
        value = self.data[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
            raise self.fail(key, f"expected {kind.__name__}, got {value!r}")
        return value

    def positive(self, key: str) -> int:
        value = self.get(key, int)
        if value <= 0:
            raise self.fail(key, f"must be positive, got {value}")
        return value

    def equal(self, key: str, expected: Any, default: Any = dataclasses.MISSING) -> None:
        value = self.data.get(key, default)
        if value is dataclasses.MISSING:
            raise self.fail(key, "missing")
        if value != expected:
            raise self.fail(key, f"only {expected!r} is supported, got {value!r}")
