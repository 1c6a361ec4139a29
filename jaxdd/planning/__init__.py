"""Planning for hardware that is not here: the hardware table, deviceless compiles,
the traffic floor, the latent cache's layouts and their capacity, and the fit planner
behind ``python -m jaxdd.plan``."""
