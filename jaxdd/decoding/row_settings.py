"""The host's copy of each row's settings (its length limit, stop ids, sampling, whether it waits
for pages this round) and the one device copy the rounds read: a few hundred bytes, sent whole at
the first round after a change. A free row keeps its last request's settings: a done row changes
nothing whatever they say."""

from __future__ import annotations

import jax
import numpy as np

from jaxdd.cache.pages import PageTable
from jaxdd.decoding.checks import MAX_STOP_TOKENS
from jaxdd.decoding.requests import RowRequest
from jaxdd.decoding.sampling import GREEDY, SamplingArrays
from jaxdd.decoding.state import RowSettings


class HostSettings:
    """The settings of ``rows`` rows whose page tables ``pages`` holds."""

    def __init__(self, rows: int, pages: PageTable):
        self._max_length = np.full((rows,), 2, np.int32)
        self._stop_ids = np.full((rows, MAX_STOP_TOKENS), -1, np.int32)
        self._sampling = [GREEDY] * rows
        self.paused = np.zeros((rows,), bool)  # rows waiting this round for pages
        self._pages = pages
        self._device: RowSettings | None = None

    def hold(self, row: int, request: RowRequest) -> None:
        """``row`` runs ``request`` from the next round on."""
        self._max_length[row] = len(request.prompt) + request.max_new_tokens
        self._stop_ids[row] = -1
        self._stop_ids[row, : len(request.stop_ids)] = request.stop_ids
        self._sampling[row] = request.sampling
        self.changed()

    def free(self, row: int | slice = slice(None)) -> None:
        """``row`` (default: every row) waits for pages no more."""
        self.paused[row] = False
        self.changed()

    def pause(self, paused: np.ndarray) -> None:
        """This round, the rows ``paused`` says wait for pages; the others run."""
        if (paused != self.paused).any():
            self.changed()
        self.paused = paused

    def changed(self) -> None:
        """The device copy is stale (a row's settings or page table changed)."""
        self._device = None

    def sampled(self, rows: list[int]) -> bool:
        """Whether a row of ``rows`` samples (the round must be the sampled one)."""
        return any(not self._sampling[row].greedy for row in rows)

    def host(self, rows: slice = slice(None)) -> RowSettings:
        """The settings of ``rows`` as host arrays."""
        sampling = SamplingArrays.of(self._sampling[rows])
        pages, paused = self._pages.table[rows].copy(), self.paused[rows].copy()
        return RowSettings(self._max_length[rows], self._stop_ids[rows], sampling, pages, paused)

    def device(self) -> RowSettings:
        """Every row's settings on the device, sent again only after a change."""
        if self._device is None:
            self._device = jax.device_put(self.host())
        return self._device
