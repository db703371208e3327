"""The deviceless XLA:GPU tier's tools: compile for an H100 without one, and read its HLO.

XLA:GPU rewrites programs in ways XLA:CPU, where the suite runs, does not: with
``xla_allow_excess_precision`` (its default) it removes float round trips
``convert(convert(x, narrow), wide)``, and it turns float8 products into
cuBLASLt calls. JAX's ahead-of-time path compiles for a GPU described by a
target description, with the CUDA plugin's compiler and no GPU
(`benchmarks.harness`'s ``H100_TARGET``, which ``bench_xla_gpu_memory``
uses too), so the optimized H100 program can be read on any machine.

The CUDA plugin is a 4 GB install the ordinary suite does not need: without it
every test of the tier skips with `SKIP_REASON`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib.util
import re
import time
from typing import Any, Callable, Counter, Dict, Iterator, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import jaxpr_walk
from benchmarks import harness  # the H100's description (one place for it)

SKIP_REASON = "needs the CUDA plugin: pip install -e '.[test,xla-gpu]' — no GPU needed"


def plugin_missing() -> Optional[str]:
    """Why the tier cannot run here, or None. Looks the plugin up without importing it,
    so the ordinary suite pays nothing."""
    if importlib.util.find_spec("jax_plugins") is None:
        return SKIP_REASON
    if any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") is not None for v in (12, 13)):
        return None
    return SKIP_REASON


requires_plugin = pytest.mark.skipif(plugin_missing() is not None, reason=SKIP_REASON)


def benchmark(name: str) -> Any:
    """``benchmarks.<name>`` (its programs, built the way it builds them)."""
    return importlib.import_module(f"benchmarks.{name}")


@functools.lru_cache(maxsize=None)
def h100() -> Any:
    """The sharding of one deviceless H100; on a machine with a GPU, of that GPU."""
    if jax.default_backend() == "gpu":
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    try:
        return harness.h100_sharding()
    except NotImplementedError as e:  # the plugin did not register: its version check failed
        raise RuntimeError(
            "JAX has no CUDA topology: without a GPU driver the CUDA plugin registers only "
            "with JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 set before JAX starts (tests/conftest.py "
            "sets it where no driver is found)") from e


def on_h100(tree: Any) -> Any:
    """``jax.ShapeDtypeStruct`` s of ``tree`` 's arrays (or of its specs), on the H100."""
    return harness.on_target(tree, h100())


@contextlib.contextmanager
def compilation_cache_off() -> Iterator[None]:
    """No persistent compilation cache (the suite's conftest turns one on): a compile
    time read from the cache measures nothing."""
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)


# The suite's conftest sets --xla_backend_optimization_level=0 for XLA:CPU's sake; it
# would skip LLVM's optimization of the GPU kernels too, which is part of the compile
# users wait for. Restored per compile.
_GPU_DEFAULTS = {"xla_backend_optimization_level": 3}


def compile_for_h100(fn: Callable[..., Any], *arg_specs: Any,
                     options: Optional[Dict[str, Any]] = None) -> Tuple[str, float]:
    """``fn`` jitted and compiled for an H100: its optimized HLO text and XLA's compile
    time in seconds (tracing and lowering excluded; persistent cache off).

    ``arg_specs``: arrays or ``ShapeDtypeStruct`` s (pytrees of them); put on the H100
    here. ``options``: XLA debug options for this compile
    (``{"xla_allow_excess_precision": False}``).
    """
    return compile_traced(jax.jit(fn).trace(*on_h100(arg_specs)), options)


def compile_traced(traced: Any, options: Optional[Dict[str, Any]] = None) -> Tuple[str, float]:
    """`compile_for_h100` of a traced function whose arguments already say their devices
    (a mesh of deviceless GPUs, say)."""
    lowered = traced.lower()
    with compilation_cache_off():
        start = time.perf_counter()
        compiled = lowered.compile({**_GPU_DEFAULTS, **(options or {})})
        seconds = time.perf_counter() - start
    return compiled.as_text(), seconds


# --- HLO readers ------------------------------------------------------------------------

# HLO's element types, by the dtype names JAX uses.
_HLO_TYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64",
              "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2",
              "f8e8m0fnu": "float8_e8m0fnu", "f4e2m1fn": "float4_e2m1fn",
              "f8e4m3fnuz": "float8_e4m3fnuz", "f8e5m2fnuz": "float8_e5m2fnuz",
              "f8e4m3b11fnuz": "float8_e4m3b11fnuz", "f8e4m3": "float8_e4m3",
              "f8e3m4": "float8_e3m4"}


def instructions(text: str) -> List[Any]:
    """Every instruction of an HLO module, in all its computations (fusion bodies, loop
    bodies, branches)."""
    return harness.parse_hlo(text)


def element_type(shape: str) -> Optional[str]:
    """The dtype name of an array type (``"f8e4m3fn[4,8]{1,0}"`` -> ``"float8_e4m3fn"``);
    None for tuples and types that are not floats."""
    m = re.match(r"([a-z]\w*)\[", shape)
    return _HLO_TYPES.get(m.group(1)) if m else None


def opcodes(text: str) -> Counter[str]:
    """Instructions by opcode."""
    return collections.Counter(i.opcode for i in instructions(text))


def custom_call_targets(text: str) -> Counter[str]:
    """Custom calls by target (``"__cublas$lt$matmul$f8"``)."""
    return collections.Counter(
        m.group(1) for i in instructions(text) if i.opcode == "custom-call"
        for m in [re.search(r'custom_call_target="([^"]+)"', i.attributes)] if m)


def _bits(dtype: str) -> int:
    return np.dtype(dtype).itemsize * 8 if "float4" not in dtype else 4


def narrowing_converts(text: str) -> Counter[str]:
    """``convert`` s from a float type to a narrower float type, by result type."""
    listing = instructions(text)
    types = {i.name: element_type(i.shape) for i in listing}
    out: Counter[str] = collections.Counter()
    for i in listing:
        result = types[i.name]
        source = types.get(i.operands[0]) if i.opcode == "convert" and i.operands else None
        if result and source and _bits(result) < _bits(source):
            out[result] += 1
    return out


def float8_dots(text: str) -> int:
    """``dot`` s (in any computation: a Triton GEMM fusion's included) whose operands are
    all float8."""
    listing = instructions(text)
    types = {i.name: element_type(i.shape) or "" for i in listing}
    return sum(i.opcode == "dot" and bool(i.operands)
               and all(types.get(o, "").startswith("float8") for o in i.operands)
               for i in listing)


def reduce_precisions(text: str) -> Counter[int]:
    """``reduce-precision`` instructions by the mantissa bits they keep."""
    return collections.Counter(
        int(m.group(1)) for i in instructions(text) if i.opcode == "reduce-precision"
        for m in [re.search(r"mantissa_bits=(\d+)", i.attributes)] if m)


def mantissa_bits(dtype: Any) -> int:
    """Explicit mantissa bits of a float dtype (3 for float8_e4m3fn)."""
    return int(jnp.finfo(dtype).nmant)


def roundings_kept(text: str, dtype: Any) -> int:
    """The roundings to ``dtype`` left in an optimized HLO module: conversions from a
    wider float to it (a native float8 GEMM's operands among them), and
    ``reduce-precision`` s to its mantissa (the library's rounding in float32,
    `jmp_policy.formats`). A ``round-nearest-even`` is not counted: in that rounding it
    goes with a ``reduce-precision`` (subnormals), and counting both would count one
    rounding twice."""
    name = np.dtype(dtype).name
    return narrowing_converts(text)[name] + reduce_precisions(text)[mantissa_bits(name)]


# --- jaxpr readers ----------------------------------------------------------------------

def _float_bits(aval: Any) -> Optional[int]:
    dtype = getattr(aval, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        return None
    return _bits(np.dtype(dtype).name)


def quantization_sites(closed_jaxpr: Any) -> Counter[str]:
    """The roundings a jaxpr asks for, nested jaxprs included, by format: its
    ``convert_element_type`` s from a float to a float below float32 with fewer bits.

    Left out: a conversion back to the format a value was widened from (exact: XLA
    removes it on every backend, rightly), and scale formats without a mantissa
    (``float8_e8m0fnu``: their values are powers of two, which the conversion of a
    power of two holds exactly).
    """
    eqns = list(jaxpr_walk.eqns(closed_jaxpr))
    producers = {id(v): e for e in eqns for v in e.outvars}
    out: Counter[str] = collections.Counter()
    for eqn in eqns:
        if eqn.primitive.name != "convert_element_type":
            continue
        source, result = _float_bits(eqn.invars[0].aval), _float_bits(eqn.outvars[0].aval)
        dtype = np.dtype(eqn.outvars[0].aval.dtype)
        if not (source and result and result < min(source, 32) and mantissa_bits(dtype) > 0):
            continue
        producer = producers.get(id(eqn.invars[0]))
        widened = producer is not None and producer.primitive.name == "convert_element_type"
        if not (widened and np.dtype(producer.invars[0].aval.dtype) == dtype):
            out[dtype.name] += 1
    return out


# --- the numerics inspector's program ----------------------------------------------------

@contextlib.contextmanager
def _recording_jit(calls: List[Tuple[Callable[..., Any], tuple]]) -> Iterator[None]:
    """``jax.jit`` recording the functions it jits and the arguments of their calls made
    outside any trace."""
    original = jax.jit

    def jit(fun: Callable[..., Any], *options: Any, **keywords: Any) -> Callable[..., Any]:
        jitted = original(fun, *options, **keywords)

        def call(*args: Any) -> Any:
            if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
                calls.append((fun, args))
            return jitted(*args)
        return call

    jax.jit = jit
    try:
        yield
    finally:
        jax.jit = original


def _callbacks_as_outputs(fun: Callable[..., Any]) -> Callable[..., Any]:
    """``fun`` with each ``jax.debug.callback`` made an output: ``fun(*args)`` and the
    arguments of the callbacks it would make. A deviceless compile cannot lower host
    callbacks; as outputs, what they would receive is still computed."""
    def program(*args: Any) -> Any:
        delivered: List[Any] = []
        original = jax.debug.callback
        jax.debug.callback = lambda callback, *values, **kw: delivered.append(values)
        try:
            out = fun(*args)
        finally:
            jax.debug.callback = original
        return out, delivered
    return program


def inspector_program(inspect: Callable[..., Any], *args: Any, callbacks_as_outputs: bool = True
                      ) -> Tuple[Callable[..., Any], tuple]:
    """The program an inspection (``jmp_policy.inspect_numerics(...)``) compiles, with its
    host callbacks as outputs, and the arguments it was called with.

    The inspection runs once here (on the default backend), recording every function it
    jits; the program is the one of them that delivers statistics by callbacks.
    ``callbacks_as_outputs=False``: the program as it is, its callbacks kept (compile it
    under `host_callbacks_lowered`).
    """
    calls: List[Tuple[Callable[..., Any], tuple]] = []
    with _recording_jit(calls):
        inspect(*args)
    for fun, call_args in calls:
        program = _callbacks_as_outputs(fun)
        if jax.eval_shape(program, *call_args)[1]:
            return (program if callbacks_as_outputs else fun), call_args
    raise AssertionError("the inspection jitted no program that makes host callbacks; "
                         "tests/support/xla_gpu.py's inspector_program needs updating")


@contextlib.contextmanager
def host_callbacks_lowered() -> Iterator[None]:
    """Host callbacks (``jax.debug.callback``) compiled by `compile_for_h100` as on a GPU,
    where they are side-effecting custom calls (``xla_ffi_python_gpu_callback``, which the
    CUDA plugin registers): XLA:GPU's passes see the program a GPU runs, which can differ
    from the one with the callbacks as outputs (the root of the entry computation among
    others). The compiled program cannot run here.

    Deviceless, JAX's lowering of a callback asks for the backend, which it uses only on a
    TPU, and there is none; the compile-only client takes no host callbacks (they are
    needed to run, not to compile). Both are worked around here, through JAX internals
    (jax 0.10 and 0.11); with a GPU nothing changes.
    """
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import _jax

    get_backend = mlir.ModuleContext.get_backend
    compile_and_load = compiler.backend_compile_and_load

    def backend(self: Any) -> Any:
        try:
            return get_backend(self)
        except RuntimeError:  # no GPU backend here
            return None

    def compile_only(client: Any, module: Any, devices: Any, options: Any,
                     host_callbacks: Any) -> Any:
        if isinstance(client, _jax.CompileOnlyPyClient):
            host_callbacks = ()
        return compile_and_load(client, module, devices, options, host_callbacks)

    mlir.ModuleContext.get_backend = backend
    compiler.backend_compile_and_load = compile_only
    try:
        yield
    finally:
        mlir.ModuleContext.get_backend = get_backend
        compiler.backend_compile_and_load = compile_and_load
