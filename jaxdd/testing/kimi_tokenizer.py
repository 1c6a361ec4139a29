"""A Kimi-style tokenizer directory (tiktoken
ranks + tokenizer_config.json) for tests that need one."""

from __future__ import annotations

import base64
import json

# Shaped like Kimi K2's template: role markers, <|im_middle|>
# before the content, <|im_end|> after each turn.
KIMI_STYLE_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
SPECIAL = [
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
]


def write_kimi_tokenizer(
    directory, ranks: dict[bytes, int], template: str | None = KIMI_STYLE_TEMPLATE
):
    """tiktoken.model + tokenizer_config.json as MoonshotAI
    ships them (special ids right after the ranks)."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in ranks.items()]
    (directory / "tiktoken.model").write_text("\n".join(lines) + "\n")
    base = len(ranks)
    config = {
        "added_tokens_decoder": {
            str(base + i): {"content": t, "special": True} for i, t in enumerate(SPECIAL)
        },
        "bos_token": "[BOS]",
        "eos_token": {"content": "[EOS]", "special": True},
        "tokenizer_class": "TikTokenTokenizer",
    }
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return base
