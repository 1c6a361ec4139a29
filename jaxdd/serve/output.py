"""A request's output as it grows: the token ids, the text released so far, and stop strings.

Text comes from an ``IncrementalDecoder`` (a partial UTF-8 character waits for the token that
completes it); text that could be the start of a stop string is held back until it cannot. With
stop strings the tokens are decoded one at a time, so the output ends at the token that completed
the first stop string to complete, as vLLM's does. Stop ids end the row on the device; they are
kept in ``token_ids`` (as ``jaxdd.generate`` returns them) but never spelled in the text.
"""

from __future__ import annotations

from jaxdd.weights.tokenizer import IncrementalDecoder, TextTokenizer


class Output:
    def __init__(
        self, tokenizer: TextTokenizer | None, stop_ids: set[int], stop_strings: list[str]
    ):
        self.decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
        self.stop_ids = stop_ids
        self.stop_strings = stop_strings
        self.token_ids: list[int] = []
        self.held = ""  # decoded, not released: it could be the start of a stop string
        self.stopped = False  # a stop string was found: the request ends here

    def add(self, tokens: list[int], final: bool) -> str:
        """Take a round's tokens; return the text to release now (all of it when ``final``)."""
        if self.stopped:
            return ""
        if self.decoder is None:
            self.token_ids += tokens
            return ""
        pieces = ([[t] for t in tokens] if self.stop_strings else []) or [tokens]
        for n, piece in enumerate(pieces):
            self.token_ids += piece
            last = final and n == len(pieces) - 1
            self.held += self.decoder.push([t for t in piece if t not in self.stop_ids], last)
            ends = [
                (self.held.find(s) + len(s), -len(s)) for s in self.stop_strings if s in self.held
            ]
            if ends:  # the stop string that completed first (the longest of those ending together)
                end, minus_length = min(ends)
                self.stopped = True
                return self.held[: end + minus_length]
        keep = 0 if final else max(map(self._started, self.stop_strings), default=0)
        released = self.held[: len(self.held) - keep]
        self.held = self.held[len(self.held) - keep :]
        return released

    def _started(self, stop: str) -> int:
        """How many of ``held``'s last characters begin ``stop``."""
        return next(
            (
                n
                for n in range(min(len(stop) - 1, len(self.held)), 0, -1)
                if self.held.endswith(stop[:n])
            ),
            0,
        )
