"""The measuring code every benchmark script shares: compile, XLA figures, wall time, JSON.

``benchmarks`` is a package: the scripts run from the repository root as
``python -m benchmarks.<script>``, and they and the tests import this module
as ``from benchmarks import harness``. The harness uses the library's public
API only, and holds no figures. What it holds, in one place each:

* measuring: `Case`, `build`, `measure`, `Runner`, `time_interleaved`;
* reading XLA's programs: `xla_figures`, `hlo_figures`, `parse_hlo`,
  `kernels` (every kernel a program launches, its GEMM FLOPs and bytes),
  `gemm_counts`, `kernel_bytes`, `distinct_kernels`, `count_stablehlo_ops`;
* compiling for an H100 without one: `H100_TARGET`, `h100_sharding`,
  `gpu_target`, `on_target`, `callbacks_on_device`;
* child processes: `run_child` runs a script's task in a fresh process (its
  own XLA flags, device context or library checkout), `child_result` hands the
  result back; `xla_flags_error` says whether XLA accepts a set of flags;
* files outside the package: `load_file` (``examples/*.py``, ``tests/*.py``);
* reports: `Report`, `Table`, `Column`, `render_table`, `render_markdown`,
  `environment`, `add_common_arguments`.

A benchmark describes each thing to measure as a `Case` (a function to jit,
its arguments, what it donates and which outputs feed the next call), calls
`measure`, puts the rows into a `Report` table and writes the report::

    from benchmarks import harness
    report = harness.Report("bench_example", settings={"n": 1000})
    cases = [harness.Case("plain", f, (x,)), harness.Case("ours", g, (x,))]
    rows, failed = harness.measure(cases, compile_rounds=3, rounds=10, iters=5)
    table = report.table("main", "f against g", baseline="plain")
    table.add_rows(rows)
    report.failed(failed)
    print(report.markdown())
    report.write(harness.default_json_path("bench_example"))

What it measures (`measure`):

* compile time: XLA's compile of a fresh lowering (JAX's caches cleared
  first), median of ``compile_rounds`` rounds that interleave the cases, so
  that a shared machine's load hits every case alike, after a first pass
  that is not timed (one-off start-up costs land in the first case
  compiled); lowering (trace + StableHLO) time beside it;
* XLA figures (`xla_figures`, deterministic): ``cost_analysis()`` bytes
  accessed and flops; in the optimized HLO, every instruction (fusion bodies
  included), the top-level ops (what a step launches), fusions,
  conditionals, copies and parameter-sized copies; ``memory_analysis()``
  temp, argument, output, alias and peak bytes;
* wall time per call: median over ``rounds`` interleaved rounds of ``iters``
  calls each (round ``k`` starts at case ``k``), outputs fed back as the next
  inputs; ``enqueue_s`` is the time until the Python loop had dispatched the
  calls (close to ``wall_s``: the host is the bottleneck).

JSON (``SCHEMA``, written by `Report.write`)::

    {"schema": "jmp_policy-benchmark/1",
     "benchmark": "bench_loss_scaling",            # the script's name
     "description": "...",
     "command": "python -m benchmarks.bench_loss_scaling --quick",
     "environment": {"date", "git_commit", "git_dirty", "python", "platform",
                     "packages": {"jax": "0.10.2", ...}, "backend", "device_kind",
                     "device_count", "host_cpus", "load_average", "load_average_at_write",
                     "xla_flags", "compilation_cache", "library"},
     "settings": {...},                             # the script's arguments
     "tables": [{"id", "title", "description", "baseline",
                 "columns": [{"key", "label", "unit"}],   # unit: s, bytes, count, x, ...
                 "rows": [{"name", "note",
                           "figures": {key: number or null},
                           "ratios": {key: figure / baseline's figure},
                           "samples": {key: [numbers]}}]}],
     "failed": [{"name", "error"}],                 # cases that did not run, and why
     "notes": ["..."]}

Raw figures are in base units (seconds, bytes, counts); ratios are to the
baseline row of the same table, measured in the same run. ``python -m
benchmarks.harness render benchmarks/results/*.json`` prints the tables of JSON
files as markdown; ``python -m benchmarks.harness run --library PATH <script>
[args]`` runs a script with the library of another checkout.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import dataclasses
import datetime
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

SCHEMA = "jmp_policy-benchmark/1"
BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCHMARKS)
RESULTS = os.path.join(BENCHMARKS, "results")

# Distributions whose versions a report records, when installed.
PACKAGES = ("jax", "jaxlib", "optax", "flax", "numpy", "jmp_policy", "jmp", "keras",
            "mixed-precision-for-jax", "chex")


# --------------------------------------------------------------------------- #
# Cases and their compilation.
# --------------------------------------------------------------------------- #

@dataclasses.dataclass
class Case:
    """One thing to measure: ``jax.jit(fn, donate_argnums=donate_argnums)(*args)``.

    Attributes:
      name: the row's name.
      fn: the function to jit (not jitted yet).
      args: example arguments. The harness never donates these: it runs on
        private copies.
      donate_argnums: as for ``jax.jit``.
      carry: how many leading outputs become the leading arguments of the next
        call (2 for ``step(params, state, batch) -> (params, state, ...)``); 0
        calls ``fn`` on the same arguments every time (nothing may be donated then).
      note: shown beside the name.
      check: ``check(compiled, args)``, called once after compiling with fresh
        copies of ``args``; raises if the case computes something wrong.
      extra: ``extra(build) -> {key: number}``, more figures of the compiled case.
      make_fn: makes a fresh ``fn`` for every compile, for functions that keep
        their own trace caches (an ``autocast`` wrapper does); ``fn`` is still
        the one timed.
    """

    name: str
    fn: Callable[..., Any]
    args: Tuple[Any, ...]
    donate_argnums: Tuple[int, ...] = ()
    carry: int = 0
    note: str = ""
    check: Optional[Callable[[Any, Tuple[Any, ...]], None]] = None
    extra: Optional[Callable[["Build"], Dict[str, float]]] = None
    make_fn: Optional[Callable[[], Callable[..., Any]]] = None


@dataclasses.dataclass
class Build:
    """A compiled case: the ``jax.stages`` objects and how long each stage took."""

    lowered: Any
    compiled: Any
    lower_s: float
    compile_s: float


def copy_tree(tree: Any) -> Any:
    """Fresh device buffers for every array leaf (donation deletes the ones it gets)."""
    return jax.tree_util.tree_map(
        lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x, tree)


def warm_up_compiler() -> None:
    """Compiles a trivial function, so that the backend's start-up is in no case's time."""
    jax.jit(lambda x: x + 1).lower(jnp.float32(0)).compile()


def build(case: Case) -> Build:
    """Traces, lowers and compiles ``case`` afresh (JAX's in-memory caches cleared first).

    The persistent compilation cache, when configured, would make compile
    times meaningless; `environment` records whether it is.
    """
    fn = case.make_fn() if case.make_fn is not None else case.fn
    jax.clear_caches()
    t0 = time.perf_counter()
    lowered = jax.jit(fn, donate_argnums=case.donate_argnums).lower(*case.args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return Build(lowered, compiled, t1 - t0, t2 - t1)


# --------------------------------------------------------------------------- #
# XLA figures.
# --------------------------------------------------------------------------- #

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_SHAPE = re.compile(r"^([a-z]\w*)\[([\d,]*)\]")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
# Top-level instructions that launch nothing.
_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all",
         "opt-barrier", "partition-id", "replica-id"}
_HLO_DTYPES = {"pred": "bool", "s8": "int8", "s16": "int16", "s32": "int32", "s64": "int64",
               "u8": "uint8", "u16": "uint16", "u32": "uint32", "u64": "uint64",
               "f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64"}


@dataclasses.dataclass
class HloInstruction:
    computation: str
    name: str
    opcode: str
    shape: str  # the result type as printed, e.g. "f32[512,2048]{1,0}" or a tuple
    operands: Tuple[str, ...] = ()
    attributes: str = ""  # what follows the operands: "mantissa_bits=3", "calls=%f", ...


def parse_hlo(text: str) -> List[HloInstruction]:
    """The instructions of an HLO module's text, each with its computation's name."""
    out: List[HloInstruction] = []
    computation = None
    for line in text.splitlines():
        if computation is None:
            header = _HEADER.match(line)
            if header and not line.startswith((" ", "HloModule")):
                computation = header.group(1)
            continue
        if line.startswith("}"):
            computation = None
            continue
        m = _INSTRUCTION.match(line)
        if m:
            shape, rest = _split_shape(m.group(2))
            opcode = re.match(r"([\w\-]+)", rest)
            operands, attributes = (_split_shape(rest[len(opcode.group(1)):]) if opcode
                                    else ("", ""))
            out.append(HloInstruction(computation, m.group(1),
                                      opcode.group(1) if opcode else "", shape,
                                      tuple(re.findall(r"%([\w.\-]+)", operands)),
                                      attributes.lstrip(", ")))
    return out


def _split_shape(text: str) -> Tuple[str, str]:
    """``"f32[2]{0} add(...)"`` -> ``("f32[2]{0}", "add(...)")``; tuple shapes kept whole."""
    if text.startswith("("):
        depth = 0
        for i, ch in enumerate(text):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                return text[:i + 1], text[i + 1:].lstrip()
    shape, _, rest = text.partition(" ")
    return shape, rest


def fused_computations(text: str) -> set:
    """Names of the computations that are fusion bodies (called by a ``fusion``)."""
    return {m.group(1) for line in text.splitlines() if " fusion(" in line
            for m in _CALLS.finditer(line)}


def distinct_kernels(text: str) -> int:
    """Fusion bodies of an optimized HLO module that differ other than in their
    instructions' names and metadata: the kernels XLA compiles, once each where it
    reuses a kernel (XLA:GPU; XLA:CPU emits one per fusion, identical ones cheaper).
    A constant specific to one array inside a kernel (an index into an array of
    per-array seeds) makes the kernels of same-shaped arrays distinct."""
    bodies: Dict[str, List[str]] = {}
    name = None
    for line in text.splitlines():
        if name is None:
            header = _HEADER.match(line)
            if header and not line.startswith((" ", "HloModule", "ENTRY")):
                name, bodies[header.group(1)] = header.group(1), []
        elif line.startswith("}"):
            name = None
        else:
            bodies[name].append(re.sub(r", metadata=\{[^}]*\}", "", line))

    def canonical(lines: List[str]) -> str:
        names: Dict[str, str] = {}
        return "\n".join(re.sub(r"%([\w.\-]+)",
                                lambda m: "%" + names.setdefault(m.group(1), str(len(names))),
                                line) for line in lines)

    return len({canonical(bodies[f]) for f in fused_computations(text) if f in bodies})


def _shape_key(shape: str) -> Optional[Tuple[str, Tuple[int, ...]]]:
    m = _SHAPE.match(shape)
    if not m or m.group(1) not in _HLO_DTYPES:
        return None
    dims = tuple(int(d) for d in m.group(2).split(",") if d)
    return _HLO_DTYPES[m.group(1)], dims


def _argument_shapes(compiled: Any, min_elements: int) -> set:
    avals = jax.tree_util.tree_leaves(compiled.in_avals)
    return {(str(a.dtype), tuple(a.shape)) for a in avals
            if hasattr(a, "shape") and math.prod(a.shape) >= min_elements}


def hlo_figures(text: str, argument_shapes: Iterable[Tuple[str, Tuple[int, ...]]] = ()
                ) -> Dict[str, int]:
    """Counts in an optimized HLO module's text.

    ``hlo_instructions``: every instruction, fusion bodies included.
    ``top_level_ops``: instructions outside fusion bodies that do work
    (kernels, library calls, copies, control flow), roughly what a step
    launches. ``fusions``, ``conditionals``, ``while_loops``: top-level ops
    of those kinds. ``copies``: top-level ``copy`` / ``copy-start``;
    ``param_sized_copies``: those whose result has the shape and dtype of an
    argument in ``argument_shapes``, wherever they are (a copy inside a
    conditional's branch runs only when that branch is taken);
    ``entry_param_sized_copies``: those of the entry computation, which run
    on every call.
    """
    instructions = parse_hlo(text)
    fused = fused_computations(text)
    top = [i for i in instructions if i.computation not in fused]
    shapes = set(argument_shapes)
    copies = [i for i in top if i.opcode in ("copy", "copy-start")]
    entry = re.search(r"^ENTRY\s+%?([\w.\-]+)", text, re.M)
    return {
        "hlo_instructions": len(instructions),
        "top_level_ops": sum(i.opcode not in _FREE for i in top),
        "fusions": sum(i.opcode == "fusion" for i in top),
        "conditionals": sum(i.opcode == "conditional" for i in top),
        "while_loops": sum(i.opcode == "while" for i in top),
        "copies": len(copies),
        "param_sized_copies": sum(_shape_key(i.shape) in shapes for i in copies),
        "entry_param_sized_copies": sum(_shape_key(i.shape) in shapes for i in copies
                                        if entry and i.computation == entry.group(1)),
    }


def kernel_bytes(text: str) -> float:
    """Bytes the kernels of an optimized HLO module read and write: for each
    instruction outside fusion bodies that launches work, its operands' and its
    result's sizes (int4 and float4 at half a byte, as XLA stores them). A
    portable stand-in for ``bytes accessed`` where XLA gives no cost analysis
    (a deviceless compile); loop bodies count once."""
    instructions = parse_hlo(text)
    fused = fused_computations(text)
    sizes = {i.name: shape_bytes(i.shape) for i in instructions}
    return sum(sizes[i.name] + sum(sizes.get(o, 0.0) for o in i.operands)
               for i in instructions if i.computation not in fused
               and i.opcode not in _FREE | {"while", "conditional", "call"})


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO type (a tuple's elements summed): ``f32[4,8]{1,0}`` -> 128."""
    total = 0.0
    for dtype, dims in re.findall(r"([a-z][a-z0-9]*)\[([\d,]*)\]", shape):
        bits = 8 if dtype == "pred" else int(re.search(r"\d+", dtype).group())
        total += math.prod(int(d) for d in dims.split(",") if d) * bits / 8
    return total


@dataclasses.dataclass
class Kernel:
    """One launch of an optimized HLO module: its GEMM FLOPs (0 for other kernels) and bytes."""

    name: str
    opcode: str
    shape: str              # the result type (a cuBLAS call's workspace left out)
    op_name: str            # the JAX operation it came from (HLO metadata)
    bytes: float            # operands + result, as `kernel_bytes` counts them
    flops: float = 0.0
    gemm_dtype: str = ""    # "f8", "bf16", "f32": the GEMM's operand type; "" if no GEMM

    @property
    def is_gemm(self) -> bool:
        return bool(self.gemm_dtype)


# Top-level instructions that launch no kernel of their own (control flow launches its
# bodies' kernels).
_NO_KERNEL = _FREE | {"while", "conditional", "call"}
_CUBLAS = re.compile(r'custom_call_target="(__cublas[^"]*)"')
_CALLED = re.compile(r"(?:body|condition|to_apply|true_computation|false_computation)="
                     r"%?([\w.\-]+)")
# A cuBLAS call's second result is its workspace: scratch memory rather than traffic.
_WORKSPACE = re.compile(r",?\s*s8\[\d+\]\{0\}\)$")


def _dims(shape: str) -> Tuple[str, List[int]]:
    """``"f32[8,16]{1,0}"`` -> ``("f32", [8, 16])``; the first array of a tuple."""
    m = re.search(r"([a-z][a-z0-9]*)\[([\d,]*)\]", shape)
    assert m is not None, shape
    return m.group(1), [int(d) for d in m.group(2).split(",") if d]


def _operand_type(dtype: str) -> str:
    return "f8" if dtype.startswith("f8") else dtype


def _dot_flops(out_shape: str, lhs_shape: str, contracting: Sequence[int]) -> float:
    """2 x output elements x contracted length: 2*M*N*K, batch dimensions included."""
    _, out = _dims(out_shape)
    _, lhs = _dims(lhs_shape)
    return 2.0 * math.prod(out) * math.prod(lhs[d] for d in contracting)


def _cublas_gemm(inst: HloInstruction, shapes: Dict[str, str]) -> Tuple[float, str]:
    """FLOPs and operand type of a cuBLAS(Lt) custom call, from its backend config."""
    numbers = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', inst.attributes)
    contracting = [int(d) for d in re.findall(r"\d+", numbers.group(1))] if numbers else []
    lhs = shapes[inst.operands[0]]
    return _dot_flops(inst.shape, lhs, contracting), _operand_type(_dims(lhs)[0])


def _dot_gemm(inst: HloInstruction, shapes: Dict[str, str]) -> Tuple[float, str]:
    """FLOPs and operand type of a ``dot`` instruction."""
    dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.attributes)
    contracting = [int(d) for d in re.findall(r"\d+", dims.group(1))] if dims else []
    lhs = shapes[inst.operands[0]]
    return _dot_flops(inst.shape, lhs, contracting), _operand_type(_dims(lhs)[0])


def _fused_gemm(inst: HloInstruction, bodies: Dict[str, List[HloInstruction]],
                shapes: Dict[str, str]) -> Tuple[float, str]:
    """FLOPs and operand type of the ``dot`` s inside a fusion (a Triton GEMM), nested
    fusions followed; (0, "") when it holds none."""
    flops, dtype, todo = 0.0, "", _CALLS.findall(inst.attributes)
    while todo:
        for i in bodies.get(todo.pop(), []):
            todo += _CALLS.findall(i.attributes) if i.opcode == "fusion" else []
            if i.opcode == "dot":
                f, dtype = _dot_gemm(i, shapes)
                flops += f
    return flops, dtype


def _launch_computations(instructions: Sequence[HloInstruction], text: str) -> set:
    """The entry computation and the bodies of its loops, branches and calls: where
    kernels are launched from (a reduction's ``to_apply`` region is no launch)."""
    entry = re.search(r"^ENTRY\s+%?([\w.\-]+)", text, re.M)
    found: set = set()
    todo = [entry.group(1)] if entry else []
    by_computation: Dict[str, List[HloInstruction]] = collections.defaultdict(list)
    for i in instructions:
        by_computation[i.computation].append(i)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        for i in by_computation[name]:
            if i.opcode in ("while", "conditional", "call"):
                todo += _CALLED.findall(i.attributes)
                branches = re.search(r"branch_computations=\{([^}]*)\}", i.attributes)
                todo += re.findall(r"%?([\w.\-]+)", branches.group(1)) if branches else []
    return found


def kernels(text: str) -> List[Kernel]:
    """Every kernel an optimized HLO module launches, with its GEMM FLOPs and its bytes.

    A GEMM is a cuBLAS(Lt) custom call, a fusion holding a ``dot`` (a Triton GEMM) or
    a ``dot`` left unfused (XLA:CPU):
    ``2 * M * N * K`` FLOPs, from its operands' shapes and dot dimensions. Bytes:
    operands and result, a cuBLAS call's workspace left out. Kernels in a loop's
    body count once, as in `kernel_bytes`."""
    instructions = parse_hlo(text)
    shapes = {i.name: i.shape for i in instructions}
    bodies: Dict[str, List[HloInstruction]] = collections.defaultdict(list)
    for i in instructions:
        bodies[i.computation].append(i)
    launching = _launch_computations(instructions, text)
    out = []
    for i in instructions:
        if i.computation not in launching or i.opcode in _NO_KERNEL:
            continue
        op_name = re.search(r'op_name="([^"]*)"', i.attributes)
        target = _CUBLAS.search(i.attributes) if i.opcode == "custom-call" else None
        result = _WORKSPACE.sub(")", i.shape) if target else i.shape
        moved = shape_bytes(result) + sum(shape_bytes(shapes.get(o, "")) for o in i.operands)
        k = Kernel(i.name, i.opcode, result, op_name.group(1) if op_name else "", moved)
        if target:
            k.flops, k.gemm_dtype = _cublas_gemm(i, shapes)
        elif i.opcode == "fusion":
            k.flops, k.gemm_dtype = _fused_gemm(i, bodies, shapes)
        elif i.opcode == "dot":  # XLA:CPU leaves products unfused
            k.flops, k.gemm_dtype = _dot_gemm(i, shapes)
        out.append(k)
    return out


def gemm_counts(text: str) -> Dict[str, int]:
    """``gemms``: the GEMMs of an optimized HLO module (see `kernels`); ``f8_gemms``:
    those on float8 operands."""
    gemms = [k for k in kernels(text) if k.is_gemm]
    return {"gemms": len(gemms), "f8_gemms": sum(k.gemm_dtype == "f8" for k in gemms)}


def cuda_workspace_bytes(text: str) -> float:
    """Bytes of the cuBLAS calls' workspaces: what `kernel_bytes` counts and `kernels`
    leaves out."""
    return sum(float(n) for n in re.findall(r"s8\[(\d+)\]\{0\}\) custom-call", text))


def cost_figures(compiled: Any) -> Dict[str, Optional[float]]:
    """``bytes_accessed`` and ``flops`` from XLA's cost analysis (None where missing)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    cost = cost or {}
    get = lambda k: float(cost[k]) if k in cost else None  # noqa: E731
    return {"bytes_accessed": get("bytes accessed"), "flops": get("flops")}


def memory_figures(compiled: Any) -> Dict[str, Optional[int]]:
    """XLA's memory account of one call (bytes; None where the backend gives none)."""
    mem = compiled.memory_analysis()
    names = {"temp_bytes": "temp_size_in_bytes", "argument_bytes": "argument_size_in_bytes",
             "output_bytes": "output_size_in_bytes", "alias_bytes": "alias_size_in_bytes",
             "peak_bytes": "peak_memory_in_bytes"}
    out: Dict[str, Optional[int]] = {}
    for key, attr in names.items():
        value = getattr(mem, attr, None) if mem is not None else None
        out[key] = int(value) if value is not None else None
    if out["peak_bytes"] == 0:  # not computed by this backend
        out["peak_bytes"] = None
    return out


def xla_figures(compiled: Any, min_copy_elements: int = 1024) -> Dict[str, Any]:
    """Every deterministic figure of a compiled function (see `hlo_figures`).

    Parameter-sized copies are copies whose result has the shape and dtype of
    an argument leaf of at least ``min_copy_elements`` elements.
    """
    text = compiled.as_text()
    return {**cost_figures(compiled),
            **hlo_figures(text, _argument_shapes(compiled, min_copy_elements)),
            **memory_figures(compiled)}


def count_stablehlo_ops(text: str) -> int:
    """Ops in a lowered (StableHLO) module's text: ``%x = stablehlo.op`` and result-less ones."""
    return (len(re.findall(r"=\s*\"?stablehlo\.", text))
            + len(re.findall(r"^\s*\"?stablehlo\.", text, re.M)))


# --------------------------------------------------------------------------- #
# XLA:GPU without a GPU.
# --------------------------------------------------------------------------- #

# An H100 SXM as XLA:GPU's target description (GpuTargetConfigProto, text format): what
# JAX's deviceless ahead-of-time path compiles for when there is no GPU. Without a
# driver the CUDA plugin's version check fails: set JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1
# before JAX starts its backends (the compile needs only the plugin's compiler).
H100_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 84929347584 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 7 }
runtime_version { major: 12 minor: 8 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
H100_KIND = "NVIDIA H100 80GB HBM3 (deviceless compile: no GPU on this machine)"


def h100_sharding() -> Any:
    """A sharding on one deviceless H100 (needs the CUDA plugin, no GPU): arguments
    given as ``jax.ShapeDtypeStruct(..., sharding=h100_sharding())`` make
    ``jax.jit(f).trace(...).lower().compile()`` compile for an H100."""
    from jax.experimental import topologies
    topology = topologies.get_topology_desc(platform="cuda", target_config=H100_TARGET,
                                            topology="1x1x1")
    mesh = topologies.make_mesh(topology, (1,), ("x",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def on_target(tree: Any, sharding: Any) -> Any:
    """``jax.ShapeDtypeStruct`` s of ``tree`` 's arrays (or of its specs) placed by
    ``sharding``: arguments that make ``jax.jit(f).trace(...).lower().compile()``
    compile for that sharding's devices (a deviceless H100's, say)."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def gpu_target() -> Tuple[Any, str]:
    """A sharding on the local GPU, or on a deviceless H100; and what it is."""
    if jax.default_backend() == "gpu":
        device = jax.devices()[0]
        return jax.sharding.SingleDeviceSharding(device), device.device_kind
    return h100_sharding(), H100_KIND


@contextlib.contextmanager
def callbacks_on_device() -> Iterator[None]:
    """``jax.pure_callback`` returning zeros of its result type, on the device:
    JAX's deviceless compile cannot lower a host callback. The program differs from
    the real one only in what the callback returns."""
    original = jax.pure_callback

    def zeros(callback: Any, result: Any, *args: Any, **kwargs: Any) -> Any:
        return jax.tree.map(lambda r: jnp.zeros(r.shape, r.dtype), result)

    jax.pure_callback = zeros
    try:
        yield
    finally:
        jax.pure_callback = original


# --------------------------------------------------------------------------- #
# Wall time.
# --------------------------------------------------------------------------- #

class Runner:
    """Calls a compiled case again and again, feeding outputs back as `Case.carry` says."""

    def __init__(self, compiled: Any, args: Tuple[Any, ...], carry: int = 0):
        self.compiled, self.args, self.carry = compiled, copy_tree(args), carry
        self.out: Any = None

    def __call__(self) -> Any:
        self.out = self.compiled(*self.args)
        if self.carry:
            self.args = tuple(self.out[:self.carry]) + tuple(self.args[self.carry:])
        return self.out


def time_interleaved(calls: Dict[str, Callable[[], Any]], rounds: int, iters: int,
                     warmup: int = 0) -> Dict[str, Dict[str, List[float]]]:
    """Per-call times of each callable, in interleaved rounds.

    Each round calls every callable ``warmup`` times untimed (to re-warm
    caches another evicted), then ``iters`` times timed, blocking on the last
    result. Round ``k`` starts at the ``k``-th callable. Returns, per name,
    the samples (one per round) of ``wall_s`` and ``enqueue_s`` (until the
    calls were dispatched), both per call. Garbage collection is off while timing.
    """
    names = list(calls)
    samples: Dict[str, Dict[str, List[float]]] = {n: {"wall_s": [], "enqueue_s": []}
                                                  for n in names}
    for k in range(rounds):
        for name in names[k % len(names):] + names[:k % len(names)]:
            call = calls[name]
            for _ in range(warmup):
                jax.block_until_ready(call())
            gc.collect()
            gc.disable()
            try:
                t0 = time.perf_counter()
                for _ in range(iters):
                    out = call()
                t1 = time.perf_counter()
                jax.block_until_ready(out)
                t2 = time.perf_counter()
            finally:
                gc.enable()
            samples[name]["wall_s"].append((t2 - t0) / iters)
            samples[name]["enqueue_s"].append((t1 - t0) / iters)
    return samples


# --------------------------------------------------------------------------- #
# The whole measurement.
# --------------------------------------------------------------------------- #

Row = Dict[str, Any]


def measure(cases: Sequence[Case], *, compile_rounds: int = 1, rounds: int = 10,
            iters: int = 5, wall: bool = True,
            progress: Callable[[str], None] = lambda s: print(s, flush=True),
            ) -> Tuple[List[Row], List[Dict[str, str]]]:
    """Compiles, checks and times ``cases``; returns ``(rows, failed)``.

    A row is ``{"name", "note", "figures", "samples"}``: `xla_figures`, the
    case's extra figures, ``lower_s`` and ``compile_s`` (medians of
    ``compile_rounds`` interleaved fresh compiles after a first pass that
    compiles every case for its figures; with ``compile_rounds=1``, that
    first pass's times), ``wall_s`` and
    ``enqueue_s`` (medians of ``rounds`` interleaved rounds of ``iters``
    calls; absent with ``wall=False``). A case that fails to compile, to
    run or its check goes to ``failed`` with the error, and the others go on.
    """
    warm_up_compiler()
    built: Dict[str, Tuple[Case, Build]] = {}
    failed: List[Dict[str, str]] = []
    rows: Dict[str, Row] = {}
    for case in cases:
        try:
            b = build(case)
            if case.check is not None:
                case.check(b.compiled, copy_tree(case.args))
            figures = {**xla_figures(b.compiled), **(case.extra(b) if case.extra else {})}
        except Exception as e:  # noqa: BLE001 - a broken case must not stop the others
            failed.append({"name": case.name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            progress(f"  {case.name}: FAILED ({failed[-1]['error'][:120]})")
            continue
        built[case.name] = (case, b)
        rows[case.name] = {"name": case.name, "note": case.note, "figures": figures,
                           "samples": {"lower_s": [b.lower_s], "compile_s": [b.compile_s]}}
        progress(f"  compiled {case.name} ({b.compile_s:.2f} s)")
    if compile_rounds > 1:  # the first pass (for the figures) is then left out of the times
        for row in rows.values():
            row["samples"]["lower_s"], row["samples"]["compile_s"] = [], []
    for _ in range(compile_rounds if compile_rounds > 1 else 0):
        for name, (case, _) in built.items():
            b = build(case)
            rows[name]["samples"]["lower_s"].append(b.lower_s)
            rows[name]["samples"]["compile_s"].append(b.compile_s)
    if wall and rounds > 0 and built:
        runners = {}
        for name, (case, b) in list(built.items()):
            try:
                runner = Runner(b.compiled, case.args, case.carry)
                jax.block_until_ready(runner())  # warm-up
                runners[name] = runner
            except Exception as e:  # noqa: BLE001
                failed.append({"name": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                rows.pop(name)
        progress(f"  timing {len(runners)} cases: {rounds} interleaved rounds of {iters} calls")
        for name, s in time_interleaved(runners, rounds, iters).items():
            rows[name]["samples"].update(s)
        del runners
    for row in rows.values():
        for key, values in row["samples"].items():
            row["figures"][key] = statistics.median(values)
    return list(rows.values()), failed


# --------------------------------------------------------------------------- #
# Reports: tables, ratios, markdown, JSON.
# --------------------------------------------------------------------------- #

@dataclasses.dataclass
class Column:
    """A table column: figure ``key``, its ``label`` and ``unit``.

    ``unit`` is "s", "bytes", "KiB" (a figure already in KiB), "count", "x" (a ratio
    already), "bool" or "" (a plain number). ``ratio``: whether markdown shows the ratio to the baseline
    (the JSON always has it); not for figures whose baseline can be ~0.
    """

    key: str
    label: str
    unit: str
    ratio: bool = True


STEP_COLUMNS = [
    Column("bytes_accessed", "bytes accessed", "bytes"),
    Column("hlo_instructions", "HLO instructions", "count"),
    Column("top_level_ops", "top-level ops", "count"),
    Column("entry_param_sized_copies", "param-sized copies (every call)", "count", ratio=False),
    Column("compile_s", "compile time", "s"),
    Column("wall_s", "wall time", "s"),
    Column("temp_bytes", "temp memory", "bytes", ratio=False),
]


@dataclasses.dataclass
class Table:
    id: str
    title: str
    baseline: Optional[str]
    columns: List[Column]
    description: str = ""
    rows: List[Row] = dataclasses.field(default_factory=list)

    def add_row(self, name: str, figures: Dict[str, Any], note: str = "",
                samples: Optional[Dict[str, List[float]]] = None) -> None:
        self.rows.append({"name": name, "note": note, "figures": dict(figures),
                          "samples": dict(samples or {})})

    def add_rows(self, rows: Iterable[Row]) -> None:
        for r in rows:
            self.add_row(r["name"], r["figures"], r.get("note", ""), r.get("samples"))

    def to_json(self) -> Dict[str, Any]:
        base = next((r for r in self.rows if r["name"] == self.baseline), None)
        rows = []
        for r in self.rows:
            ratios = {} if base is None else {
                k: _ratio(v, base["figures"].get(k)) for k, v in r["figures"].items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)}
            rows.append({"name": r["name"], "note": r["note"], "figures": _clean(r["figures"]),
                         "ratios": _clean(ratios), "samples": _clean(r["samples"])})
        return {"id": self.id, "title": self.title, "description": self.description,
                "baseline": self.baseline,
                "columns": [dataclasses.asdict(c) for c in self.columns], "rows": rows}


def _ratio(a: Any, b: Any) -> Optional[float]:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return None
    if b == 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def _clean(x: Any) -> Any:
    """JSON-safe: NaN and inf become null, numpy scalars Python numbers."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, (np.generic,)):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


class Report:
    """What one run of a benchmark script writes: its environment, settings and tables."""

    def __init__(self, benchmark: str, description: str = "",
                 settings: Optional[Dict[str, Any]] = None, argv: Optional[Sequence[str]] = None,
                 env: Optional[Dict[str, Any]] = None):
        """``env``: the run's `environment`, when another process measured (default: this one's)."""
        self.benchmark, self.description = benchmark, description
        self.settings = dict(settings or {})
        self.command = command_line(argv)
        self.environment = env if env is not None else environment()
        self.tables: List[Table] = []
        self.failures: List[Dict[str, str]] = []
        self.notes: List[str] = []
        self.extra: Dict[str, Any] = {}

    def table(self, id: str, title: str, *, baseline: Optional[str],
              columns: Sequence[Column] = STEP_COLUMNS, description: str = "") -> Table:
        t = Table(id, title, baseline, list(columns), description)
        self.tables.append(t)
        return t

    def failed(self, failures: Iterable[Dict[str, str]], where: str = "") -> None:
        for f in failures:
            self.failures.append({"name": f"{f['name']} [{where}]" if where else f["name"],
                                  "error": f["error"]})

    def note(self, text: str) -> None:
        self.notes.append(text)

    def to_json(self) -> Dict[str, Any]:
        out = {"schema": SCHEMA, "benchmark": self.benchmark, "description": self.description,
               "command": self.command, "environment": self.environment,
               "settings": _clean(self.settings), "tables": [t.to_json() for t in self.tables],
               "failed": self.failures, "notes": self.notes}
        out.update(_clean(self.extra))
        return out

    def markdown(self) -> str:
        return render_markdown(self.to_json())

    def write(self, path: str) -> Dict[str, Any]:
        """Writes the JSON to ``path`` (folders made as needed) and returns it."""
        payload = self.to_json()
        if hasattr(os, "getloadavg"):  # load changes during a long run: record it at the end too
            payload["environment"]["load_average_at_write"] = [round(x, 2) for x in os.getloadavg()]
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(payload, f, indent=1, allow_nan=False)
            f.write("\n")
        return payload


def default_json_path(benchmark: str, quick: bool = False) -> str:
    """``benchmarks/results/<benchmark>.json`` (``.quick.json`` for smoke runs, not committed)."""
    return os.path.join(RESULTS, f"{benchmark}{'.quick' if quick else ''}.json")


def format_figure(value: Any, unit: str) -> str:
    """A raw figure for a table cell: seconds as ms, bytes as MiB."""
    if value is None:
        return "n/a"
    if unit == "s":
        ms = value * 1e3
        return f"{ms:.2f} ms" if ms < 10 else f"{ms:.1f} ms" if ms < 1000 else f"{value:.2f} s"
    if unit == "bytes":
        mib = value / 2**20
        return f"{mib:.1f} MiB" if mib < 100 else f"{mib:.0f} MiB"
    if unit == "KiB":
        return f"{value:.2f} KiB"
    if unit == "count":
        return f"{int(value)}"
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "bool":
        return "yes" if value else "no"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def render_table(table: Dict[str, Any]) -> str:
    """A table of a report's JSON as markdown: ``ratio (raw)`` per cell, raw where no ratio."""
    cols = table["columns"]
    lines = ["| " + " | ".join(["case"] + [c["label"] for c in cols]) + " |",
             "|" + "---|" * (len(cols) + 1)]
    for r in table["rows"]:
        name = r["name"] + (" (baseline)" if r["name"] == table.get("baseline") else "")
        name += f" ({r['note']})" if r.get("note") else ""
        cells = [name]
        for c in cols:
            value = r["figures"].get(c["key"])
            ratio = r.get("ratios", {}).get(c["key"])
            raw = format_figure(value, c["unit"])
            show_ratio = (ratio is not None and c.get("ratio", True)
                          and c["unit"] not in ("x", "bool", ""))
            cells.append(f"{ratio:.2f}x ({raw})" if show_ratio else raw)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_markdown(payload: Dict[str, Any]) -> str:
    """A whole report's JSON as markdown: command, environment, tables, failures, notes."""
    env = payload["environment"]
    pkgs = ", ".join(f"{k} {v}" for k, v in env.get("packages", {}).items())
    out = [f"### {payload['benchmark']}", "", payload.get("description", ""), "",
           f"Command: `{payload['command']}`", "",
           f"Measured {env.get('date')} at commit {env.get('git_commit') or 'unknown'}"
           f"{' (with uncommitted changes)' if env.get('git_dirty') else ''} on "
           f"{env.get('device_kind')} ({env.get('backend')}, {env.get('device_count')} "
           f"device(s); {env.get('host_cpus')} host CPUs, load average "
           f"{env.get('load_average')}); {pkgs}.", ""]
    for t in payload["tables"]:
        out += [f"**{t['title']}**" + (f" ({t['description']})" if t.get("description") else ""),
                "", render_table(t), ""]
    if payload.get("failed"):
        out += ["Did not run: " + "; ".join(f"{f['name']}: {f['error']}"
                                            for f in payload["failed"]), ""]
    out += [f"- {n}" for n in payload.get("notes", [])]
    return "\n".join(out).rstrip() + "\n"


# --------------------------------------------------------------------------- #
# Where and with what a run was made.
# --------------------------------------------------------------------------- #

def command_line(argv: Optional[Sequence[str]] = None) -> str:
    """The command that reproduces this run, from the repository's root:
    ``python -m benchmarks.<script> ...`` for a benchmark script."""
    script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else "?"
    if os.path.dirname(script) == BENCHMARKS and script.endswith(".py"):
        program = ["python", "-m", f"benchmarks.{os.path.basename(script)[:-3]}"]
    else:
        if script.startswith(REPO + os.sep):
            script = os.path.relpath(script, REPO)
        program = ["python", shlex.quote(script)]
    args = list(sys.argv[1:] if argv is None else argv)
    flags = os.environ.get("XLA_FLAGS")
    prefix = f"XLA_FLAGS={shlex.quote(flags)} " if flags else ""
    return prefix + " ".join(program + [shlex.quote(a) for a in args])


def _git(*args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def package_versions(names: Sequence[str] = PACKAGES) -> Dict[str, str]:
    """Installed versions of ``names`` and of any ``jax-cuda*`` / ``jax-rocm*`` plugin."""
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith(("jax-cuda", "jax_cuda", "jax-rocm")):
            out[name] = dist.version
    return out


def environment() -> Dict[str, Any]:
    """Date, commit, versions, backend and host of this run.

    The commit is ``git rev-parse HEAD`` of this checkout, or the
    ``BENCH_GIT_COMMIT`` environment variable where there is no git (a
    copy of the working tree on another machine); ``library`` is where the
    ``jmp_policy`` measured came from (another checkout's, under
    ``python -m benchmarks.harness run --library``).
    """
    commit = _git("rev-parse", "--short=12", "HEAD") or os.environ.get("BENCH_GIT_COMMIT")
    dirty = _git("status", "--porcelain", "--untracked-files=no", "--", "jmp_policy", "benchmarks")
    device = jax.devices()[0]
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit,
        "git_dirty": None if dirty is None else bool(dirty),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": package_versions(),
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "host_cpus": cpus,
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "compilation_cache": bool(jax.config.jax_compilation_cache_dir),
        "library": _library(),
    }


def _library() -> Optional[str]:
    """The folder of the ``jmp_policy`` this process imports (None if it has none)."""
    spec = importlib.util.find_spec("jmp_policy")
    if spec is None or not spec.origin:
        return None
    return os.path.dirname(os.path.realpath(spec.origin))


# --------------------------------------------------------------------------- #
# Child processes and files outside the package.
# --------------------------------------------------------------------------- #

# The environment variable naming the file where a child writes its result.
CHILD_OUT = "JMP_POLICY_BENCH_CHILD_OUT"


@contextlib.contextmanager
def child_environment(library: Optional[str] = None,
                      env: Optional[Dict[str, Optional[str]]] = None
                      ) -> Iterator[Tuple[Dict[str, str], str]]:
    """The environment of a child process that runs ``python -m benchmarks.<script>``
    from the repository root, and a scratch folder that lives as long as the context.

    ``library``: a checkout whose ``jmp_policy`` the child imports, with this
    checkout's benchmarks (only the library is taken from it: its own ``benchmarks/``
    would shadow these); ``env``: variables set for the child (``None`` unsets one).
    """
    with tempfile.TemporaryDirectory(prefix="jmp_policy_bench_") as tmp:
        child_env = dict(os.environ)
        for key, value in (env or {}).items():
            if value is None:
                child_env.pop(key, None)
            else:
                child_env[key] = value
        paths = [REPO]
        if library is not None:
            shim = os.path.join(tmp, "library")
            os.makedirs(shim)
            os.symlink(os.path.join(os.path.abspath(library), "jmp_policy"),
                       os.path.join(shim, "jmp_policy"))
            paths.insert(0, shim)
        if child_env.get("PYTHONPATH"):
            paths.append(child_env["PYTHONPATH"])
        child_env["PYTHONPATH"] = os.pathsep.join(paths)
        child_env["PYTHONSAFEPATH"] = "1"  # no current directory ahead of PYTHONPATH
        yield child_env, tmp


def run_child(module: str, args: Sequence[str] = (), *, python: Optional[str] = None,
              library: Optional[str] = None, env: Optional[Dict[str, Optional[str]]] = None,
              timeout: Optional[float] = None) -> Any:
    """Runs ``python -m benchmarks.<module> *args`` in a fresh process and returns what
    it gave `child_result`.

    A fresh process has its own XLA flags (XLA reads them once: ``env={"XLA_FLAGS":
    ...}``), its own device context (a GPU's peak memory is then one task's) and its
    own library (``library``, see `child_environment`); ``python``: the interpreter
    (default: this one), e.g. one with JAX's CUDA plugin. The child's output goes to
    this process's standard error as it comes. Raises `RuntimeError` if the child
    fails, `subprocess.TimeoutExpired` after ``timeout`` seconds.
    """
    with child_environment(library, env) as (child_env, tmp):
        child_env[CHILD_OUT] = out = os.path.join(tmp, "result.json")
        command = [python or sys.executable, "-m", f"benchmarks.{module}", *args]
        proc = subprocess.run(command, env=child_env, cwd=REPO, timeout=timeout,
                              stdout=sys.stderr)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(" ".join(command[2:])
                               + (f" (library {library})" if library else "")
                               + f": exited with status {proc.returncode}")
        with open(out) as f:
            return json.load(f)


def child_result(result: Any) -> None:
    """Hands ``result`` (JSON-able) to the `run_child` that started this process; run by
    hand, prints it."""
    path = os.environ.get(CHILD_OUT)
    if path is None:
        print(json.dumps(_clean(result), indent=1))
        return
    with open(path, "w") as f:
        json.dump(_clean(result), f)


def xla_flags_error(flags: str, python: Optional[str] = None) -> Optional[str]:
    """None if XLA accepts ``flags``, else why not: XLA aborts on a flag it does not
    know, so they are parsed in a CPU-only process of their own."""
    if not flags:
        return None
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run([python or sys.executable, "-c", "import jax; jax.devices()"],
                          env=env, capture_output=True, text=True, timeout=120)
    if proc.returncode == 0:
        return None
    lines = [ln for ln in proc.stderr.splitlines() if "flag" in ln.lower() and "--xla" in ln]
    return (lines[0] if lines else proc.stderr.strip()[-300:])[:300]


def load_file(path: str, name: Optional[str] = None) -> Any:
    """The Python file ``path`` (relative to the repository root: ``examples/x.py``,
    ``tests/test_real_models_autocast.py``) as a module named ``name`` (default: the
    file's stem), loaded once per process. Examples and test modules are scripts, not
    packages: the modules and packages of the same folder that it imports (the
    tests' ``support`` package), as Python or pytest running it from there would find
    them, are loaded first under their names."""
    name = name or os.path.splitext(os.path.basename(path))[0]
    if name in sys.modules:
        return sys.modules[name]
    folder = os.path.dirname(path)
    for imported in _imported_names(path):
        sibling = os.path.join(folder, imported)
        if os.path.exists(os.path.join(REPO, sibling, "__init__.py")):
            _load(imported, os.path.join(sibling, "__init__.py"), package=sibling)
        elif os.path.exists(os.path.join(REPO, sibling + ".py")):
            load_file(sibling + ".py", imported)
    return _load(name, path)


def _imported_names(path: str) -> set[str]:
    """The top-level names of the modules ``path`` imports absolutely."""
    with open(os.path.join(REPO, path)) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def _load(name: str, path: str, package: Optional[str] = None) -> Any:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(REPO, path),
        submodule_search_locations=None if package is None else [os.path.join(REPO, package)])
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses (flax modules) look their module up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def add_common_arguments(parser: Any, *, rounds: int = 10, iters: int = 5,
                         compile_rounds: int = 3) -> None:
    """``--json``, ``--quick``, ``--rounds``, ``--iters``, ``--compile-rounds``, ``--no-wall``."""
    parser.add_argument("--json", help="write the report here (default: "
                        "benchmarks/results/<name>.json; <name>.quick.json with --quick)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few rounds: a smoke run")
    parser.add_argument("--rounds", type=int, default=rounds, help="interleaved wall-time rounds")
    parser.add_argument("--iters", type=int, default=iters, help="calls per case per round")
    parser.add_argument("--compile-rounds", type=int, default=compile_rounds,
                        help="interleaved fresh compiles per case (median)")
    parser.add_argument("--no-wall", action="store_true", help="XLA figures and compile time only")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m benchmarks.harness render FILE.json...``: the reports as markdown;
    ``python -m benchmarks.harness run --library PATH SCRIPT [ARGS...]``: a benchmark
    script run with the library of the checkout at PATH (a commit before a change)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    render = sub.add_parser("render", help="print reports as markdown")
    render.add_argument("files", nargs="+")
    run = sub.add_parser("run", help="run a script with another checkout's library")
    run.add_argument("--library", required=True, help="a checkout of jmp_policy")
    run.add_argument("script", help="a script of benchmarks/, e.g. bench_inspect_models")
    run.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "run":
        script = os.path.basename(args.script)
        script = script[:-3] if script.endswith(".py") else script
        with child_environment(args.library) as (env, _):
            return subprocess.run([sys.executable, "-m", f"benchmarks.{script}", *args.args],
                                  env=env, cwd=REPO).returncode
    for path in args.files:
        with open(path) as f:
            print(render_markdown(json.load(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
