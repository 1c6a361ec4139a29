"""Pallas kernels (tree attention for absorbed-MLA verify) and their pure-jnp references."""
