import ctypes.util
import importlib.metadata
import importlib.util
import os

# The tests check behaviour and XLA's HLO-level figures (bytes accessed, copies), not
# the speed of the generated CPU code: skipping LLVM's optimization of it halves the
# compile time that dominates the suite, and on jaxlib 0.10 XLA:CPU's older kernel
# emitters compile the suite's small programs several times faster than its fusion emitters
# (later jaxlibs have only the latter, and refuse the flag). Set before the first
# computation, when JAX reads XLA_FLAGS; subprocesses started by the tests inherit it.
# The flags as the user set them, for the few tests that need XLA's default code
# generator (tests/test_docs.py's DEFAULT_CODEGEN pages).
os.environ.setdefault("JMP_POLICY_TESTS_USER_XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
_FAST_COMPILE = ["--xla_backend_optimization_level=0"]
if tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 11):
    _FAST_COMPILE.append("--xla_cpu_use_fusion_emitters=false")
for _flag in _FAST_COMPILE:
    if _flag not in os.environ.get("XLA_FLAGS", ""):  # pytest-xdist workers inherit them
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

# Child interpreters (the tests' scripts, the examples, tests/support's workers) import
# this checkout's jmp_policy, as the tests do, not one installed from another checkout.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [_ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

# The deviceless XLA:GPU tier (tests/test_xla_gpu.py) compiles with the CUDA plugin's
# compiler. Without a GPU driver the plugin's version check can only fail, and the plugin
# then does not register: skip the check there, before JAX starts its backends.
if importlib.util.find_spec("jax_plugins") is not None and not ctypes.util.find_library("cuda"):
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

# Many tests compile the same programs (a model's step under several tests, both
# pytest-xdist workers compiling the same fixtures): XLA's persistent cache, keyed by
# the program's fingerprint, lets each be compiled once per machine.
_CACHE = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"jmp_policy_tests_xla_cache_{os.getuid()}")
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# The worker is a script run in subprocesses by test_distributed.py, not a module to
# import: keep --doctest-modules (pyproject) from importing it (it reads sys.argv).
collect_ignore = ["support/distributed_worker.py"]


@pytest.fixture
def xla_cpu():
    """Runs the test on the CPU backend, also where JAX's default is a GPU or TPU.

    For tests that assert XLA:CPU's own figures (bytes accessed, fusions,
    copies): other backends fuse differently, and their figures are measured in
    benchmarks/, not asserted here.
    """
    with jax.default_device(jax.devices("cpu")[0]):
        yield


_EMULATED_GPU = "excess precision as on a GPU"  # the emulated variants' test id


@pytest.hookimpl(tryfirst=True)  # before -m reads the marks
def pytest_collection_modifyitems(config, items):
    """The docstrings' examples (``--doctest-modules``, pyproject) are documentation, as
    docs/'s pages are (test_docs.py::test_page_blocks_run): system tests, marked slow. Run
    eagerly, as users paste them, they compile one program per operation. So are the
    variants compiled with the emulation of XLA:GPU's float rewrites
    (``support.excess_precision``): another backend's tier, as the deviceless one is.

    The modules of system tests alone (the zoo, the examples, the child interpreters on 8
    devices, the type checkers) run first, each whole: pytest-xdist hands out tests in
    this order, and one of them last (test_sharded_training's 20 s child interpreter) kept
    one worker busy after the other had finished."""
    for item in items:
        if isinstance(item, pytest.DoctestItem) or _EMULATED_GPU in item.nodeid:
            item.add_marker(pytest.mark.slow)
    modules = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    first = {m for m, its in modules.items()
             if not m.startswith("jmp_policy") and all(i.get_closest_marker("slow") for i in its)}
    items.sort(key=lambda i: i.nodeid.split("::")[0] not in first)  # stable: order within kept
