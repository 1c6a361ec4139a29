"""OpenAI's logprobs for a choice, shaped as its tokens come: ``/v1/completions``' ``{tokens,
token_logprobs, top_logprobs, text_offset}`` (with ``echo``, the prompt's tokens first, the first
of them without a logprob) and chat's ``{content: [{token, logprob, bytes, top_logprobs}]}``, each
stream chunk with its own tokens'. The values are the target's distribution before temperature and
cut-offs (vLLM's default), whatever the request samples with. A token is spelled as the tokenizer
decodes it alone (a cut UTF-8 character as U+FFFD, ``bytes`` its UTF-8), ``token_id:N`` without a
tokenizer (vLLM's spelling); ``text_offset`` counts the spellings' characters from the choice's
start, the echoed prompt's included (as vLLM's; a cut character's pieces count one each). A
completion's ``top_logprobs`` holds the token itself beside the top ones (OpenAI's "up to
logprobs + 1"), chat's ``top_logprobs`` the top ones alone. A log-probability below ``FLOOR`` is
given as it (JSON has no -Infinity), as vLLM does.
"""

from __future__ import annotations

import functools
from typing import Literal

from jaxdd.decoding.report import TokenLogprob
from jaxdd.weights.tokenizer import TextTokenizer

COMPLETION_FIELDS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
FLOOR = -9999.0
SPELLINGS = 1 << 16  # single-id spellings memoized: the ids in use, not a whole vocabulary


def finite(logprob: float) -> float:
    return max(logprob, FLOOR)


@functools.lru_cache(maxsize=SPELLINGS)
def spelled(tokenizer: TextTokenizer, token: int) -> str:
    """``token`` as ``tokenizer`` decodes it alone (each top id of each token is spelled)."""
    return tokenizer.decode([token])


class ChoiceLogprobs:
    """One choice's logprobs: ``add`` (``add_prompt``) gives the part of new (prompt) tokens;
    ``joined`` makes one of parts."""

    def __init__(self, tokenizer: TextTokenizer | None, kind: Literal["completion", "chat"]):
        self.tokenizer = tokenizer
        self.chat = kind == "chat"
        self.offset = 0  # text_offset of the next token

    def spell(self, token: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token}"
        return spelled(self.tokenizer, token)

    def add(self, tokens: list[int], entries: list[TokenLogprob | None]) -> dict:
        """The part of ``tokens`` (``entries``: one each; None for a prompt's first token)."""
        if self.chat:
            part = {
                "content": [self._chat_entry(t, e) for t, e in zip(tokens, entries, strict=True)]
            }
        else:
            part = {field: [] for field in COMPLETION_FIELDS}
            for token, entry in zip(tokens, entries, strict=True):
                text = self.spell(token)
                part["tokens"].append(text)
                part["token_logprobs"].append(None if entry is None else finite(entry.logprob))
                part["top_logprobs"].append(None if entry is None else self._top(text, entry))
                part["text_offset"].append(self.offset)
                self.offset += len(text)
        return part

    def add_prompt(self, prompt: list[int], entries: list[TokenLogprob]) -> dict:
        """The echoed prompt's part (``entries``: its tokens' after the first)."""
        return self.add(prompt, [None, *entries])

    def joined(self, parts: list[dict]) -> dict:
        """``parts`` as one, in their order."""
        keys = ("content",) if self.chat else COMPLETION_FIELDS
        return {key: [x for part in parts for x in part[key]] for key in keys}

    def _top(self, text: str, entry: TokenLogprob) -> dict[str, float]:
        """Completions' top: spelling -> logprob, the token's own (spelled ``text``) first, then
        the top ones best first (OpenAI's up to logprobs + 1); two spelled alike: the best."""
        top = {text: finite(entry.logprob)}
        for token, logprob in entry.top:
            other = self.spell(token)
            top[other] = max(top.get(other, FLOOR), finite(logprob))
        return top

    def _chat_entry(self, token: int, entry: TokenLogprob) -> dict:
        top = [self._chat_token(t, logprob) for t, logprob in entry.top]
        return {**self._chat_token(token, entry.logprob), "top_logprobs": top}

    def _chat_token(self, token: int, logprob: float) -> dict:
        text = self.spell(token)
        return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}
