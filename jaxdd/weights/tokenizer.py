"""The tokenizer a checkpoint directory ships, behind one small interface.

Two layouts exist: a ``tokenizer.json`` (the ``tokenizers`` library; the bundled demo model) and
Kimi's own ``tiktoken.model`` + ``tokenizer_config.json`` (MoonshotAI repos ship no
tokenizer.json). Kimi's ``tokenization_kimi.py`` builds a tiktoken ``Encoding`` from the BPE ranks
and Kimi's pre-tokenizer pattern, and reserves the 256 ids after the ranks for special tokens:
those named in ``added_tokens_decoder``, the rest ``<|reserved_token_{id}|>``. The chat template
(``chat_template`` in tokenizer_config.json, or a ``chat_template.jinja`` file) is rendered the way
transformers renders it: a sandboxed jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``.
"""

from __future__ import annotations

import abc
import base64
import binascii
import json
from pathlib import Path

import jinja2
import jinja2.sandbox
import tiktoken
import tokenizers

from jaxdd.errors import CheckpointError, InputError, checkpoint_directory, read_json

# From tokenization_kimi.py: Han runs, cased words with English
# contractions, up to 3 digits, punctuation runs, newlines, spaces.
KIMI_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}"
        r"\p{M}&&[^\p{Han}]]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}"
        r"\p{M}&&[^\p{Han}]]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
KIMI_RESERVED_SPECIAL_TOKENS = 256
CHAT_END_TOKENS = ("<|im_end|>",)  # Kimi's end of an assistant turn: generation stops there too


class TextTokenizer(abc.ABC):
    """Text <-> ids for one checkpoint, with its special
    tokens and (for instruct models) its chat template."""

    def __init__(self, special: dict[str, int], config: dict, chat_template: str | None):
        self.special = special
        self.chat_template = chat_template
        self._config = config

    @abc.abstractmethod
    def encode(self, text: str, *, special: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in
        it count as those tokens only when ``special``."""

    @abc.abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (special tokens spelled out; a cut UTF-8 sequence as U+FFFD)."""

    def token_id(self, token: str) -> int | None:
        return self.special.get(token)

    def named_token(self, field: str) -> str | None:
        """A special token named in tokenizer_config.json
        (``bos_token``, ``eos_token``): plain or AddedToken dict."""
        value = self._config.get(field)
        return value.get("content") if isinstance(value, dict) else value

    @property
    def stop_ids(self) -> list[int]:
        """The end-of-sequence token and, for chat models, the end of a turn."""
        names = [self.named_token("eos_token"), *(CHAT_END_TOKENS if self.chat_template else ())]
        return sorted({self.special[n] for n in names if n in self.special})

    def chat_prompt(self, user: str, system: str | None = None) -> list[int]:
        """Ids of a one-turn conversation rendered with the
        chat template, ready for the assistant's reply."""
        if self.chat_template is None:
            raise InputError(
                "this tokenizer has no chat template (tokenizer_config.json chat_template)"
            )
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user}
        ]
        text = render_chat_template(
            self.chat_template,
            messages,
            bos_token=self.named_token("bos_token") or "",
            eos_token=self.named_token("eos_token") or "",
        )
        return self.encode(text, special=True)


class IncrementalDecoder:
    """A growing sequence's text, released piece by piece (vLLM's incremental detokenization): each
    call decodes the tokens since the last piece together with that piece's tokens (a token's
    spelling can depend on its neighbour) and releases what they add to that piece's text. A piece
    ending in U+FFFD (a BPE token can end mid-character) waits for the next tokens unless ``final``.
    Each call decodes a few tokens, not the whole output, and released text is never revised."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.context = 0  # ids[context:released]: the last piece's tokens; ids[released:]: pending
        self.released = 0

    def push(self, ids: list[int], final: bool = False) -> str:
        """Take ``ids``; return the text they release."""
        self.ids += ids
        before = self.tokenizer.decode(self.ids[self.context : self.released])
        text = self.tokenizer.decode(self.ids[self.context :])
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self.context = self.released
        self.released = len(self.ids)
        return text[len(before) :]


class HFTokenizer(TextTokenizer):
    """A ``tokenizer.json`` read by the ``tokenizers`` library."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, config: dict, chat_template: str | None):
        special = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()}
        super().__init__(special, config, chat_template)
        self.backend = tokenizer

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        # tokenizers always matches added tokens in the text;
        # a plain prompt that spells one is rare enough.
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)


class KimiTokenizer(TextTokenizer):
    """Kimi's tiktoken BPE (``tiktoken.model``) with
    the special tokens of ``tokenizer_config.json``."""

    def __init__(self, ranks: dict[bytes, int], config: dict, chat_template: str | None):
        base = len(ranks)
        named = {
            int(i): token["content"] for i, token in config.get("added_tokens_decoder", {}).items()
        }
        outside = sorted(i for i in named if not base <= i < base + KIMI_RESERVED_SPECIAL_TOKENS)
        if outside:
            raise CheckpointError(
                f"tokenizer_config.json: added token id(s) {outside} outside the special range "
                f"[{base}, {base + KIMI_RESERVED_SPECIAL_TOKENS}) after the {base} BPE "
                f"ranks of tiktoken.model"
            )
        ids = range(base, base + KIMI_RESERVED_SPECIAL_TOKENS)
        special = {named.get(i, f"<|reserved_token_{i}|>"): i for i in ids}
        super().__init__(special, config, chat_template)
        self.backend = tiktoken.Encoding(
            name="kimi", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=special
        )

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        if special:
            return self.backend.encode(text, allowed_special="all")
        return self.backend.encode(text, allowed_special=set(), disallowed_special=())

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(list(ids), errors="replace")


def render_chat_template(template: str, messages: list[dict], **variables) -> str:
    """``template`` rendered as transformers'
    ``apply_chat_template`` renders it (generation prompt added)."""

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(
        x, ensure_ascii=False, indent=indent, **kw
    )
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(
            messages=messages, add_generation_prompt=True, **variables
        )
    except jinja2.exceptions.TemplateError as error:
        raise InputError(f"chat template: {error}") from None


# What a checkpoint's tokenizer is made of: conversions carry these files along.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tiktoken.model",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def tokenizer_files(directory: str | Path) -> list[Path]:
    """The tokenizer files present in a checkpoint directory."""
    return [
        Path(directory) / name for name in TOKENIZER_FILES if (Path(directory) / name).is_file()
    ]


def load_tokenizer(directory: str | Path) -> TextTokenizer | None:
    """The checkpoint's tokenizer (tokenizer.json, else
    Kimi's tiktoken.model), or None when it ships none."""
    directory = checkpoint_directory(directory)
    config_path = directory / "tokenizer_config.json"
    config = read_json(config_path) if config_path.is_file() else {}
    template_file = directory / "chat_template.jinja"
    template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if (directory / "tokenizer.json").is_file():
        try:
            backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        # the Rust library raises plain Exceptions for any malformed file
        except Exception as error:
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise CheckpointError(
                f"{directory / 'tokenizer.json'}: not a tokenizers file ({reason})"
            ) from None
        return HFTokenizer(backend, config, template)
    if (directory / "tiktoken.model").is_file():
        return KimiTokenizer(read_tiktoken_ranks(directory / "tiktoken.model"), config, template)
    return None


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """The BPE ranks of a tiktoken file: one ``base64(token) rank`` per line. (tiktoken's own loader
    caches local files by path in a temp dir, so a file rewritten in place would be read stale.)"""
    ranks = {}
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise CheckpointError(f"{path}: line {number} is not 'base64-token rank'") from None
    return ranks
