import jax
import pytest

# The worker is a script run in subprocesses by test_distributed.py, not a test module:
# keep --doctest-modules (pyproject) from importing it.
collect_ignore = ["_distributed_worker.py"]


@pytest.fixture
def xla_cpu():
    """Runs the test on the CPU backend, also where JAX's default is a GPU or TPU.

    For tests that assert XLA:CPU's own figures (bytes accessed, fusions,
    copies): other backends fuse differently, and their figures are measured in
    benchmarks/, not asserted here.
    """
    with jax.default_device(jax.devices("cpu")[0]):
        yield
