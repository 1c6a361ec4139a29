"""Plans of the tiny pair shared by the planning tests: each set of options compiles once per
worker (the deviceless compiles are most of these modules' time)."""

from collections.abc import Callable

import pytest

from jaxdd.planning import fit
from jaxdd.planning.fit import PlanOptions

Planned = tuple[dict, list[str]]


@pytest.fixture(scope="session")
def planned(tiny_plan_configs) -> Callable[[PlanOptions], Planned]:
    """``planned(options)``: (the plan of the tiny pair, the optimized HLO of every round it
    compiled), made at the first ask; callers read them and change neither."""
    plans: dict[PlanOptions, Planned] = {}

    def plan_once(options: PlanOptions) -> Planned:
        if options not in plans:
            texts, account = [], fit.compiled_traffic

            def keep(compiled, names):
                texts.append(compiled.as_text())
                return account(compiled, names)

            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(fit, "compiled_traffic", keep)
                plans[options] = (fit.plan(*tiny_plan_configs, options), texts)
        return plans[options]

    return plan_once
