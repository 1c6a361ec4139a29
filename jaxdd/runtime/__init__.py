"""What runs the models: the per-platform policy, the mesh and its rules
table, processes, compiled-state plumbing and the XLA:CPU kernels.
Imports nothing above ``jaxdd.types`` / ``config`` / ``errors``."""
