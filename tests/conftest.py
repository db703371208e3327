import os

# The tests check behaviour and XLA's HLO-level figures (bytes accessed, copies), not
# the speed of the generated CPU code: skipping LLVM's optimization of it halves the
# compile time that dominates the suite. Set before the first computation, when JAX
# reads XLA_FLAGS; subprocesses started by the tests inherit it.
_FAST_COMPILE = "--xla_backend_optimization_level=0"
if _FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):  # pytest-xdist workers inherit it
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

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
