"""Test set-up: 8 CPU devices in every test process, set before jax is imported."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A test started inside a SLURM allocation must not join that job.
for _name in [n for n in os.environ if n.startswith("SLURM_")]:
    del os.environ[_name]

# Tests prepare the built-in dataset in their own directory, not in the user's home.
if "TFDS_DATA_DIR" not in os.environ:
    import tempfile

    os.environ["TFDS_DATA_DIR"] = tempfile.mkdtemp(prefix="jdp-tfds-")
