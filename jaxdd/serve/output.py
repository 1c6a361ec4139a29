"""A request's output as it grows: the token ids, the text released so far, and stop strings.

The whole output is decoded each time (a BPE token can end mid-character or change how its neighbour reads); text
that ends in a partial UTF-8 character or could be the start of a stop string is held back until it cannot.
Stop ids end the row on the device; they are kept in ``token_ids`` (as ``jaxdd.generate`` returns them) but never
spelled in the text.
"""

from __future__ import annotations

from jaxdd.weights.tokenizer import TextTokenizer


class Output:
    def __init__(self, tokenizer: TextTokenizer | None, stop_ids: set[int], stop_strings: list[str]):
        self.tokenizer, self.stop_ids, self.stop_strings = tokenizer, stop_ids, stop_strings
        self.token_ids: list[int] = []
        self.sent = ""  # text released to the client
        self.stopped = False  # a stop string was found: the request ends here

    def _text(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([t for t in ids if t not in self.stop_ids])

    def add(self, tokens: list[int], final: bool) -> str:
        """Take a round's tokens; return the text to release now (all of it when ``final``)."""
        if self.stopped:
            return ""
        self.token_ids += tokens
        text = self._text(self.token_ids)
        found = [(text.find(s), s) for s in self.stop_strings if s in text]
        if found:
            at, stop = min(found)
            # Keep the tokens up to the one that completed the stop string.
            while len(self.token_ids) > 1 and stop in self._text(self.token_ids[:-1]):
                self.token_ids.pop()
            self.stopped, text = True, text[:at]
        elif not final:
            text = text.removesuffix("\ufffd")
            held = max((n for s in self.stop_strings for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
            text = text[: len(text) - held]
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta
