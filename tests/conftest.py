"""Test setup: CPU only, 8 simulated devices (set before JAX initialises its backends)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
