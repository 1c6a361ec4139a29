"""A byte-level BPE tokenizer trained on the corpus with the ``tokenizers`` library, saved as HF
users expect: ``tokenizer.json`` and a ``tokenizer_config.json`` naming its BOS / EOS and carrying a
chat template (so chat clients and transformers' ``AutoTokenizer`` work on the trained target)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

END_OF_TEXT = "<|endoftext|>"  # separates files; the target's EOS
MASK = "<|mask|>"  # the DFlash drafter's mask token
# A base model's chat: the turns as plain text (the vocabulary has no turn tokens), the
# assistant's reply after "assistant:"; a reply in the history ends with EOS, as it was generated.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}"
    # a newline right after a block tag is trimmed (trim_blocks): it is written as an expression
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096) -> Tokenizer:
    """Byte-level BPE (GPT-2 style: every byte is a token, so
    any text encodes), special tokens first (ids 0, 1)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT, MASK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def tokenizer_config(tokenizer: Tokenizer, max_length: int) -> dict:
    """transformers' ``tokenizer_config.json`` for ``tokenizer``: its special tokens, BOS and EOS
    (both END_OF_TEXT, which separates the training files), the longest sequence, the chat
    template."""
    added = {
        str(i): {
            "content": token.content,
            "lstrip": token.lstrip,
            "normalized": token.normalized,
            "rstrip": token.rstrip,
            "single_word": token.single_word,
            "special": token.special,
        }
        for i, token in sorted(tokenizer.get_added_tokens_decoder().items())
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": END_OF_TEXT,
        "eos_token": END_OF_TEXT,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tokenizer: Tokenizer, directory: Path, max_length: int) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` in ``directory``."""
    tokenizer.save(str(directory / "tokenizer.json"))
    config = tokenizer_config(tokenizer, max_length)
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
