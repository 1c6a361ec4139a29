"""The errors jaxdd raises: for bad input, each message naming the field, tensor or limit at
fault; for a caller that broke an invariant (a bug, not bad input), ``InvariantError``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class FieldError(ValueError):
    """Bad input; ``field`` names the field, flag or tensor at fault when there is one (the server
    reports it as the error's ``param``), so no caller reads it back out of the message."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field

    @classmethod
    def at(cls, field: str, detail: str) -> FieldError:
        """The error "``field``: ``detail``", naming ``field``."""
        return cls(f"{field}: {detail}", field)


class ConfigError(FieldError):
    """A config.json field is missing, of the wrong type, unsupported or inconsistent."""


class CheckpointError(FieldError):
    """A checkpoint directory is missing files or tensors,
    or holds tensors that do not fit the config."""


class InputError(FieldError):
    """Token ids, positions, masks, cache sizes or
    generation settings that the model cannot take."""


class RequestRefused(InputError):
    """A request its pool cannot run, and why: ``reason`` "too_long" (past the pool's lengths) or
    "invalid" (anything else), so no caller works out again why it was refused."""

    def __init__(self, message: str, field: str, reason: str = "invalid"):
        super().__init__(message, field)
        self.reason = reason


class InvariantError(RuntimeError):
    """A caller broke an invariant the library keeps (a bug in jaxdd, not bad input): not a
    ``FieldError``, so no entry point reports it to a user as their mistake."""


class Refusal(Exception):
    """What a command refuses to do, said in one line (exit code 2)."""


class LargeRoundWarning(UserWarning):
    """A round that verifies far more tokens than it
    can accept (slow; the CLI prints it as a note)."""


def read_json(
    path: str | Path, error: type[ValueError] = CheckpointError, what: str = "file"
) -> Any:
    """The JSON in ``path``, or ``error`` naming the file when it is missing ("no
    such ``what``"), not text or not JSON, or unreadable (the OS's reason)."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise error(f"{path}: no such {what}") from None
    except OSError as e:  # unreadable: permissions, a directory in its place
        raise error(f"{path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise error(f"{path}: not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e})") from None


def checkpoint_directory(path: str | Path) -> Path:
    """``path`` as a Path, or a CheckpointError when it
    is not a directory (the loaders' first check)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    return path
