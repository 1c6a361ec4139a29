"""Planning for hardware that is not here: the hardware table, deviceless compiles,
the traffic floor and the fit planner behind ``python -m jaxdd.plan``."""
