"""Test-only fault injection: with ``JAXDD_SERVE_FAULTS=1`` in the environment the server
gets ``POST /debug/fault {"rounds": N, "fatal": false}``, which makes its next N round
dispatches raise inside the engine (the decode state deleted first, as a fault mid-call
would leave it); ``fatal`` also makes the pool's reset raise, so the engine cannot
recover. Without the variable nothing is installed: the normal path runs unwrapped.
"""

from __future__ import annotations

import os

import jax
from fastapi import FastAPI
from pydantic import BaseModel, Field

from jaxdd.decoding.rows import RowPool

ENV = "JAXDD_SERVE_FAULTS"


class InjectedFault(RuntimeError):
    """Raised by an armed round."""


class FaultPlan(BaseModel):
    rounds: int = Field(1, ge=1)
    fatal: bool = False


class Injector:
    def __init__(self, pool: RowPool):
        self.rounds = 0
        self.fatal = False
        dispatch = pool.dispatch
        reset = pool.reset

        def faulty_dispatch():
            if self.rounds > 0:
                self.rounds -= 1
                jax.tree.map(
                    lambda leaf: leaf.delete() if isinstance(leaf, jax.Array) else None, pool.state
                )
                raise InjectedFault("injected fault in a round")
            dispatch()

        def faulty_reset():
            if self.fatal:
                raise InjectedFault("injected fault: the pool cannot be reset")
            reset()

        # On the instance: the class's methods stay as they are.
        pool.dispatch = faulty_dispatch
        pool.reset = faulty_reset


def install_from_env(app: FastAPI, pool: RowPool) -> None:
    """Add the fault endpoint when ``JAXDD_SERVE_FAULTS=1``; otherwise do nothing."""
    if os.environ.get(ENV) != "1":
        return
    injector = Injector(pool)

    @app.post("/debug/fault")
    async def arm(plan: FaultPlan):
        injector.rounds = plan.rounds
        injector.fatal = plan.fatal
        return {"armed": plan.rounds, "fatal": plan.fatal}
