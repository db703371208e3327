"""Loss scaling on a GPU: what it adds to a donated LM train step, where that time goes, what wins it back.

Every figure comes from a donated train step (``donate_argnums=(0, 1)``;
outputs fed back as inputs) of the float16 Flax LM of ``bench_loss_scaling.py``:
``lm16`` (width 512, depth 4, 8 heads, 256 tokens, batch 16, vocab 8192:
16.8M params) and ``lm100`` (width 1024, depth 8, 16 heads, same tokens:
109M params). Phases (``--phases``), each LM and flag set in its own child
process (a fresh GPU context, its own XLA flags), run in the order steps on
``lm16``, profile, flags, steps on ``lm100`` (the longest, last):

* ``steps``: wall time per step (median of interleaved rounds) and XLA
  figures of plain Adam (the baseline), ``loss_scaling(adam)``, peers and
  the candidate variants below, on each LM of ``--lms``;
* ``profile``: a ``jax.profiler`` trace of a few steps of ``lm16`` for plain
  Adam, ``loss_scaling`` and two peers, summarised per step: device busy
  time, device ops (kernels, copies) and the top ones by time, device idle
  time between the first and last op, host events that wait (synchronise,
  copy device to host, conditionals) and the top host events; plus a
  catalog of the trace's planes and lines, to check what the summary read.
  The trace itself stays out of the repository (``--keep-traces DIR`` keeps
  the ``.xplane.pb`` files);
* ``flags``: plain Adam, ``loss_scaling`` and two variants on ``lm16`` under
  each XLA flag set of ``--flag-sets``. Each set is first parsed by XLA in
  a CPU-only process (an unknown flag makes XLA abort): a set that fails is
  recorded as unsupported and skipped.

Variants (public API and plain JAX only; every skipping one is checked to
leave params and optimizer state bit for bit unchanged on a NaN step):

* ``select skip``: ``all_finite`` of the gradients, Adam always, then
  ``select_tree(finite, new, old)`` on params and state (can XLA:GPU keep
  this as in-place selects fused into Adam's kernels, as PyTorch's fused
  AdamW reads ``found_inf``?);
* ``cond skip, library check``: ``all_finite`` + ``lax.cond`` around Adam
  (jmp_policy's skip without its bookkeeping);
* ``cond skip, one-reduction check``: the check as one reduction over all
  leaves concatenated (fewest check kernels);
* ``cond skip, per-leaf check``: one reduction per leaf (most kernels);
* ``cond only``: the ``lax.cond`` on a predicate that reads no gradient (the
  conditional's own cost; not a skip);
* ``check only``: the check feeds the loss scale, no skip (the check's own
  cost; not a skip);
* ``optax.flatten(adam)`` and ``loss_scaling(optax.flatten(adam))``: the
  optimizer on one flat vector (leaves grouped, ``optax.flatten``-style).

Output: a report (`harness` schema) at ``--json`` (default
``benchmarks/results/gpu_loss_scaling.json``; ``.smoke.json`` with
``--smoke``), written again after every phase, so that a run stopped by its
time limit keeps what it measured. ``--time-limit`` (default 540 s) skips
the phases that would not finish in time.

Commands. On this machine (CPU), a smoke run with tiny LMs (2-4 min on 2
shared cores)::

    python -m benchmarks.gpu_loss_scaling --smoke

On a GPU machine (H100), from the repository root, with the peers' wheels in
``.whl/`` (benchmarks/README.md; a missing peer is listed under "failed")
and ``--json`` under ``$OUT``, so that the report comes back::

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false BENCH_GIT_COMMIT=<commit>
    python3 -m benchmarks.gpu_loss_scaling --json $OUT/gpu_loss_scaling.json          # ~8 min
    python3 -m benchmarks.gpu_loss_scaling --phases profile --keep-traces $OUT \
        --json $OUT/profile.json                                                       # ~1 min
    python3 -m benchmarks.gpu_loss_scaling --phases profile \
        --profile-xla-flags=--xla_enable_command_buffers_during_profiling=true \
        --json $OUT/profile_cmdbuf.json    # profile with command buffers as in the timed runs
    python3 -m benchmarks.gpu_loss_scaling --phases steps --lms lm100 --json $OUT/lm100.json
    python3 -m benchmarks.gpu_loss_scaling --phases flags --flag-sets all --json $OUT/flags.json

XLA's default turns command buffers (CUDA graphs) off while a profiler
runs, so the default profile shows every kernel launched one by one; the
``--profile-xla-flags`` run above shows the timed configuration.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # children share the GPU
os.environ.setdefault("KERAS_BACKEND", "jax")

import argparse
import collections
import dataclasses
import glob
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from benchmarks import harness

BASELINE = "optax.adam"
OURS = "jmp_policy.loss_scaling(adam)"
V_SELECT = "select skip (all_finite + select_tree)"
V_COND = "cond skip, library check (all_finite)"
V_COND_CONCAT = "cond skip, one-reduction check"
V_COND_LEAF = "cond skip, per-leaf check"
V_COND_ONLY = "cond only"
V_CHECK_ONLY = "check only"
V_FLAT = "optax.flatten(adam)"
V_FLAT_OURS = "loss_scaling(optax.flatten(adam))"
VARIANTS = [V_SELECT, V_COND, V_COND_CONCAT, V_COND_LEAF, V_COND_ONLY, V_CHECK_ONLY, V_FLAT,
            V_FLAT_OURS]
LM100_VARIANTS = [V_SELECT, V_COND, V_COND_CONCAT, V_FLAT, V_FLAT_OURS]
PEERS = ["jmp recipe (select_tree)", "optax.apply_if_finite(adam)", "Keras LossScaleOptimizer(Adam)"]
PROFILE_PEERS = ["jmp recipe (select_tree)", "optax.apply_if_finite(adam)"]
FLAG_RECIPES = [BASELINE, OURS, V_SELECT, V_COND_CONCAT]

# Short names for the command line (--peers, --profile-peers, --variants).
KEYS = {"select": V_SELECT, "cond": V_COND, "cond-concat": V_COND_CONCAT,
        "cond-per-leaf": V_COND_LEAF, "cond-only": V_COND_ONLY, "check-only": V_CHECK_ONLY,
        "flatten": V_FLAT, "flatten-loss-scaling": V_FLAT_OURS,
        "jmp": "jmp recipe (select_tree)", "mpx": "MPX (optimizer_update)",
        "flax": "Flax DynamicScale recipe", "apply_if_finite": "optax.apply_if_finite(adam)",
        "keras": "Keras LossScaleOptimizer(Adam)"}

LMS = {"lm16": dict(vocab=8192, width=512, depth=4, heads=8, seq=256, batch=16),
       "lm100": dict(vocab=8192, width=1024, depth=8, heads=16, seq=256, batch=16)}
SMOKE_LMS = {"lm16": dict(vocab=256, width=32, depth=1, heads=2, seq=16, batch=2),
             "lm100": dict(vocab=256, width=64, depth=2, heads=4, seq=16, batch=2)}

# XLA flag sets for the flags phase: name -> XLA_FLAGS ("default" sets nothing).
# Command buffers are CUDA graphs. XLA's default captures fusions and library
# calls but not conditionals: a lax.cond splits the graph, and XLA's
# ConditionalThunk copies the predicate to the host to pick the branch (a
# candidate cost of loss scaling's skip).
FLAG_SETS = {
    "default": "",
    "cmdbuf+cond": "--xla_gpu_enable_command_buffer=+CONDITIONAL",
    "cmdbuf+cond,min1": "--xla_gpu_enable_command_buffer=+CONDITIONAL --xla_gpu_graph_min_graph_size=1",
    "no-cmdbuf": "--xla_gpu_enable_command_buffer=",
    "min1": "--xla_gpu_graph_min_graph_size=1",
    "cmdbuf+cond+while,concurrent": "--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE "
                                    "--xla_gpu_graph_enable_concurrent_region=true",
    "lhs": "--xla_gpu_enable_latency_hiding_scheduler=true",
}
DEFAULT_FLAG_SETS = ["default", "cmdbuf+cond", "cmdbuf+cond,min1", "no-cmdbuf"]
GUARD_TEST = {"unknown-flag": "--xla_gpu_no_such_flag_for_the_guard_test=1"}

STEP_COLUMNS = [
    harness.Column("wall_s", "wall time", "s"),
    harness.Column("enqueue_s", "enqueue time", "s"),
    harness.Column("bytes_accessed", "bytes accessed", "bytes"),
    harness.Column("top_level_ops", "top-level ops", "count"),
    harness.Column("conditionals", "conditionals", "count", ratio=False),
    harness.Column("entry_param_sized_copies", "param-sized copies (every call)", "count",
                   ratio=False),
    harness.Column("compile_s", "compile time", "s"),
]
PROFILE_COLUMNS = [
    harness.Column("device_busy_s", "device busy / step", "s"),
    harness.Column("device_ops", "device ops / step", ""),
    harness.Column("device_idle_s", "device idle / step", "s"),
    harness.Column("memcpy_ops", "copies+memsets / step", ""),
    harness.Column("d2h_copies", "device-to-host copies / step", ""),
    harness.Column("host_wait_s", "host waits / step", "s"),
]
FLAG_COLUMNS = [
    harness.Column("wall_s", "wall time", "s"),
    harness.Column("vs_adam", "vs plain Adam, same flags", "x"),
    harness.Column("top_level_ops", "top-level ops", "count"),
    harness.Column("conditionals", "conditionals", "count", ratio=False),
    harness.Column("compile_s", "compile time", "s"),
]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- #
# The variants (children only: they import JAX and the library).
# --------------------------------------------------------------------------- #

def variant_recipes(loss_fn: Callable[..., Any], names: List[str]) -> list:
    """The candidate skips of the module docstring, as ``bench_loss_scaling.Recipe`` objects."""
    import jax
    import jax.numpy as jnp
    import optax

    from benchmarks import bench_loss_scaling as bls
    import jmp_policy

    adam = optax.adam(bls.LR)

    def init(params):
        return adam.init(params), jmp_policy.DynamicLossScale(jnp.float32(bls.SCALE))

    def scaled_grads(params, scale, batch):
        return jmp_policy.scaled_value_and_grad(loss_fn)(scale, params, batch)[1]

    def adam_step(params, opt_state, grads):
        updates, opt_state = adam.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def concat_check(tree):
        leaves = [jnp.ravel(x - x) for x in jax.tree.leaves(tree)]
        return jnp.isfinite(jnp.sum(jnp.concatenate(leaves)))

    def per_leaf_check(tree):
        return jnp.isfinite(sum(jnp.sum(x - x) for x in jax.tree.leaves(tree)))

    def cond_step(check):
        def step(params, state, batch):
            opt_state, scale = state
            grads = scaled_grads(params, scale, batch)
            finite = check(grads)

            def apply(p, s, g):
                return adam_step(p, s, scale.unscale(g))

            params, opt_state = jax.lax.cond(finite, apply, lambda p, s, g: (p, s),
                                             params, opt_state, grads)
            return params, (opt_state, scale.adjust(finite))
        return step

    def select_step(params, state, batch):
        opt_state, scale = state
        grads = scaled_grads(params, scale, batch)
        finite = jmp_policy.all_finite(grads)
        new = adam_step(params, opt_state, scale.unscale(grads))
        params, opt_state = jmp_policy.select_tree(finite, new, (params, opt_state))
        return params, (opt_state, scale.adjust(finite))

    def cond_only_step(params, state, batch):
        opt_state, scale = state
        grads = scaled_grads(params, scale, batch)
        pred = scale.loss_scale > 0  # always true, but XLA cannot know: reads no gradient

        def apply(p, s, g):
            return adam_step(p, s, scale.unscale(g))

        params, opt_state = jax.lax.cond(pred, apply, lambda p, s, g: (p, s),
                                         params, opt_state, grads)
        return params, (opt_state, scale)

    def check_only_step(params, state, batch):
        opt_state, scale = state
        grads = scaled_grads(params, scale, batch)
        finite = jmp_policy.all_finite(grads)
        params, opt_state = adam_step(params, opt_state, scale.unscale(grads))
        return params, (opt_state, scale.adjust(finite))

    flat = optax.flatten(optax.adam(bls.LR))

    def flat_step(params, opt_state, batch):
        updates, opt_state = flat.update(jax.grad(loss_fn)(params, batch), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    kept = lambda s: s[0]  # noqa: E731 - the inner (Adam) state
    made = {
        V_SELECT: bls.Recipe(V_SELECT, select_step, init, kept=kept),
        V_COND: bls.Recipe(V_COND, cond_step(jmp_policy.all_finite), init, kept=kept),
        V_COND_CONCAT: bls.Recipe(V_COND_CONCAT, cond_step(concat_check), init, kept=kept),
        V_COND_LEAF: bls.Recipe(V_COND_LEAF, cond_step(per_leaf_check), init, kept=kept),
        V_COND_ONLY: bls.Recipe(V_COND_ONLY, cond_only_step, init, skips=False,
                                note="not a skip: the conditional's own cost"),
        V_CHECK_ONLY: bls.Recipe(V_CHECK_ONLY, check_only_step, init, skips=False,
                                 note="not a skip: the check's own cost"),
        V_FLAT: bls.Recipe(V_FLAT, flat_step, flat.init, skips=False, note="no loss scale"),
        V_FLAT_OURS: bls.ours_recipe(loss_fn, optax.flatten(optax.adam(bls.LR)), V_FLAT_OURS),
    }
    return [made[n] for n in names if n in made]


def recipes_for(loss_fn: Callable[..., Any], names: List[str]) -> Tuple[list, List[dict]]:
    """The recipes named, in that order: bench_loss_scaling's and the variants."""
    from benchmarks import bench_loss_scaling as bls

    unavailable: List[dict] = []
    by_name = {r.name: r for r in bls.build_recipes(loss_fn, unavailable)}
    by_name.update({r.name: r for r in variant_recipes(loss_fn, names)})
    skipped = []
    for n in names:
        if n not in by_name:  # a peer that is not installed, or a misspelt name
            why = [u["error"] for u in unavailable if u["name"].split()[0] == n.split()[0]]
            skipped.append({"name": n, "error": why[0] if why else "no such recipe"})
    return [by_name[n] for n in names if n in by_name], skipped


# --------------------------------------------------------------------------- #
# Trace summary.
# --------------------------------------------------------------------------- #

# Lines that XLA's profiler derives from others (they would count ops twice).
DERIVED_LINES = ("XLA Modules", "XLA Ops", "Steps", "Source code", "Framework Ops",
                 "Framework Name Scope", "XLA TraceMe", "TensorFlow Name Scope",
                 "TensorFlow Ops", "Launch Stats")
COPY = re.compile(r"(?i)memcpy|memset|copy")
D2H = re.compile(r"(?i)d2h|dtoh|device ?to ?host")
WAIT = re.compile(r"(?i)synchroniz|wait|memcpy|dtoh|d2h|conditional|block")


def _stats(event: Any) -> Dict[str, Any]:
    try:
        return dict(event.stats)
    except Exception:  # noqa: BLE001 - stats of unknown types
        return {}


def _top(counter: Dict[str, List[float]], n: int, steps: int) -> List[Dict[str, Any]]:
    ranked = sorted(counter.items(), key=lambda kv: -sum(kv[1]))[:n]
    return [{"name": k[:160], "count_per_step": len(v) / steps, "time_per_step_s": sum(v) / steps,
             "mean_s": sum(v) / len(v)} for k, v in ranked]


def _union(intervals: List[Tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def summarize_trace(path: str, steps: int, top: int = 15) -> Dict[str, Any]:
    """Per-step figures of an ``.xplane.pb`` that traced ``steps`` steps.

    Device ops are the events of ``/device:*`` planes (derived lines left
    out); with no device plane (XLA:CPU) they are host events that carry an
    ``hlo_op`` stat. Host waits are host events whose names say they wait or
    copy (``WAIT``); Python frames are left out of the host top list.
    """
    import jax

    data = jax.profiler.ProfileData.from_file(path)
    planes = list(data.planes)
    device_planes = [p for p in planes if p.name.startswith("/device:")]
    device_names = {p.name for p in device_planes}
    ops: List[Tuple[str, Any]] = []
    modules: List[float] = []
    if device_planes:
        source = "device planes: " + ", ".join(p.name for p in device_planes)
        for plane in device_planes:
            for line in plane.lines:
                if line.name == "XLA Modules":
                    modules += [e.duration_ns * 1e-9 for e in line.events]
                elif line.name not in DERIVED_LINES:
                    ops += [(line.name, e) for e in line.events]
    else:
        source = "host events with an hlo_op stat (no device plane: XLA:CPU)"
        for plane in planes:
            for line in plane.lines:
                ops += [(line.name, e) for e in line.events if "hlo_op" in _stats(e)]
    by_name: Dict[str, List[float]] = collections.defaultdict(list)
    by_hlo: Dict[str, List[float]] = collections.defaultdict(list)
    intervals = []
    copies = d2h = 0
    for _, e in ops:
        seconds = e.duration_ns * 1e-9
        by_name[e.name].append(seconds)
        hlo = _stats(e).get("hlo_op")
        if hlo is not None:
            by_hlo[str(hlo)].append(seconds)
        intervals.append((e.start_ns * 1e-9, e.start_ns * 1e-9 + seconds))
        copies += bool(COPY.search(e.name))
        d2h += bool(D2H.search(e.name))
    busy = _union(intervals)
    span = (max(e for _, e in intervals) - min(s for s, _ in intervals)) if intervals else 0.0
    waits: Dict[str, List[float]] = collections.defaultdict(list)
    host: Dict[str, List[float]] = collections.defaultdict(list)
    for plane in planes:
        if plane.name in device_names:
            continue
        for line in plane.lines:
            for e in line.events:
                if e.name.startswith("$") or "hlo_op" in _stats(e):
                    continue  # Python frames; XLA:CPU's ops are counted above
                host[f"{plane.name} | {e.name}"].append(e.duration_ns * 1e-9)
                if WAIT.search(e.name):
                    waits[f"{plane.name} | {e.name}"].append(e.duration_ns * 1e-9)
    return {
        "source": source,
        "steps": steps,
        "figures": {
            "device_busy_s": busy / steps,
            "device_span_s": span / steps,
            "device_idle_s": (span - busy) / steps,
            "device_ops": len(ops) / steps,
            "memcpy_ops": copies / steps,
            "d2h_copies": d2h / steps,
            "host_wait_s": sum(sum(v) for v in waits.values()) / steps,
            "module_s": (sum(modules) / len(modules)) if modules else None,
        },
        "top_device_ops": _top(by_name, top, steps),
        "top_hlo_ops": _top(by_hlo, top, steps),
        "host_waits": _top(waits, top, steps),
        "top_host_events": _top(host, top, steps),
        "catalog": [{"plane": p.name, "lines": [
            {"name": line.name, "events": sum(1 for _ in line.events)}
            for line in list(p.lines)[:40]]} for p in planes],
    }


# --------------------------------------------------------------------------- #
# Child tasks: each runs in a fresh process and writes its result as JSON.
# --------------------------------------------------------------------------- #

def _workload(spec: Dict[str, Any]):
    from benchmarks import bench_loss_scaling as bls

    return bls.lm_workload(bls.LMConfig(**spec["lm_config"]))


def child_steps(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Compiles, checks and times the recipes of ``spec`` on its LM, donated."""
    from benchmarks import bench_loss_scaling as bls

    params, tokens, desc, loss_fn = _workload(spec)
    recipes, skipped = recipes_for(loss_fn, spec["recipes"])
    log(f"  {desc}")
    rows, failed = harness.measure(
        bls.recipe_cases(recipes, params, tokens, donate=True, poison="params"),
        compile_rounds=spec["compile_rounds"], rounds=spec["rounds"], iters=spec["iters"],
        progress=log)
    return {"desc": desc, "rows": rows, "failed": skipped + failed}


def child_profile(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Traces ``spec["steps"]`` donated steps of each recipe and summarises each trace."""
    import jax

    from benchmarks import bench_loss_scaling as bls

    params, tokens, desc, loss_fn = _workload(spec)
    recipes, skipped = recipes_for(loss_fn, spec["recipes"])
    log(f"  {desc}")
    harness.warm_up_compiler()
    rows, profiles, failed = [], {}, list(skipped)
    for case in bls.recipe_cases(recipes, params, tokens, donate=True, poison="params"):
        try:
            built = harness.build(case)
            run = harness.Runner(built.compiled, case.args, case.carry)
            for _ in range(3):
                jax.block_until_ready(run())
            trace_dir = tempfile.mkdtemp(prefix="gpu_loss_scaling_trace_")
            with jax.profiler.trace(trace_dir):
                for i in range(spec["steps"]):
                    with jax.profiler.StepTraceAnnotation("train", step_num=i):
                        out = run()
                jax.block_until_ready(out)
            path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))[-1]
            summary = summarize_trace(path, spec["steps"])
            if spec.get("keep_traces"):
                slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", case.name).strip("_")[:60]
                shutil.copy(path, os.path.join(spec["keep_traces"], f"{slug}.xplane.pb"))
            shutil.rmtree(trace_dir, ignore_errors=True)
        except Exception as e:  # noqa: BLE001 - one recipe's failure must not stop the others
            failed.append({"name": case.name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            log(f"  {case.name}: FAILED ({failed[-1]['error'][:120]})")
            continue
        profiles[case.name] = summary
        rows.append({"name": case.name, "note": case.note, "figures": summary["figures"]})
        f = summary["figures"]
        log(f"  profiled {case.name}: {f['device_ops']:.0f} device ops/step, busy "
            f"{f['device_busy_s'] * 1e3:.3f} ms/step, idle {f['device_idle_s'] * 1e3:.3f} ms/step")
    return {"desc": desc, "rows": rows, "failed": failed, "profiles": profiles}


def run_child(spec: Dict[str, Any], xla_flags: str, timeout: float) -> Dict[str, Any]:
    """Runs one task in a child process with ``XLA_FLAGS`` extended by ``xla_flags``."""
    flags = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), xla_flags) if f)
    return harness.run_child("gpu_loss_scaling", ["--child", json.dumps(spec)],
                             env={"XLA_FLAGS": flags or None}, timeout=timeout)


def child_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    result = {"steps": child_steps, "profile": child_profile}[spec["task"]](spec)
    result["environment"] = harness.environment()
    harness.child_result(result)
    return 0


# --------------------------------------------------------------------------- #
# XLA flags: which exist.
# --------------------------------------------------------------------------- #

def available_flags(pattern: str = r"command_buffer|graph|conditional|profiling") -> List[str]:
    """XLA option names matching ``pattern`` found in the installed jaxlib and GPU plugin binaries.

    Both flags and ``DebugOptions`` fields are listed (a flag has its field's
    name); `harness.xla_flags_error` says whether a set really parses.
    """
    import site

    regex = re.compile(rb"xla_[a-z0-9_]*(?:" + pattern.encode() + rb")[a-z0-9_]*")
    roots = [r for sp in site.getsitepackages() + [site.getusersitepackages()]
             for name in ("jaxlib", "jax_plugins", "jax_cuda*", "jax_rocm*")
             for r in glob.glob(os.path.join(sp, name))]
    names = set()
    for root in roots:
        for path in glob.glob(os.path.join(root, "**", "*.so*"), recursive=True):
            if os.path.getsize(path) > 1_000_000:
                with open(path, "rb") as f:
                    names.update(m.decode() for m in regex.findall(f.read()))
    return sorted(names)


# --------------------------------------------------------------------------- #
# The parent: plans the children, merges their results into one report.
# --------------------------------------------------------------------------- #

@dataclasses.dataclass
class Task:
    label: str
    spec: Dict[str, Any]
    xla_flags: str = ""
    flag_set: Optional[str] = None


def plan(args: argparse.Namespace, lms: Dict[str, Dict[str, int]]) -> List[Task]:
    """The children to run, most telling first: steps on lm16, profile, flags, then lm100."""
    timing = dict(rounds=args.rounds, iters=args.iters, compile_rounds=args.compile_rounds)
    tasks = []
    for lm in args.lms if "steps" in args.phases else []:
        variants = args.variants if args.variants is not None else (
            VARIANTS if lm == "lm16" else LM100_VARIANTS)
        recipes = [BASELINE, OURS] + list(args.peers) + variants
        if args.smoke and lm != "lm16":
            recipes = [BASELINE, OURS]  # the smoke run tries each recipe once, on lm16
        tasks.append(Task(f"steps {lm}", dict(task="steps", lm=lm, lm_config=lms[lm],
                                              recipes=recipes, **timing)))
    if "profile" in args.phases:
        tasks.append(Task("profile lm16", dict(
            task="profile", lm="lm16", lm_config=lms["lm16"], steps=args.profile_steps,
            keep_traces=args.keep_traces, recipes=[BASELINE, OURS] + args.profile_peers),
            xla_flags=args.profile_xla_flags))
    for name in args.flag_sets if "flags" in args.phases else []:
        tasks.append(Task(f"flags: {name}", dict(task="steps", lm="lm16", lm_config=lms["lm16"],
                                                 recipes=args.flag_recipes, **timing),
                          xla_flags=args.all_flag_sets[name], flag_set=name))
    order = {"steps lm16": 0, "profile lm16": 1, "steps lm100": 3}
    return sorted(tasks, key=lambda t: order.get(t.label, 2))


def merge(report: harness.Report, task: Task, result: Dict[str, Any]) -> None:
    """Adds one child's result to the report's tables."""
    spec = task.spec
    if spec["task"] == "profile":
        table = report.table("profile-lm16", "Profile of the donated step, per step",
                             baseline=BASELINE, columns=PROFILE_COLUMNS,
                             description=result["desc"] + (
                                 f"; XLA_FLAGS {task.xla_flags}" if task.xla_flags else ""))
        table.add_rows(result["rows"])
        report.extra.setdefault("profiles", {}).update(result["profiles"])
    elif task.flag_set is None:
        table = report.table(f"steps-{spec['lm']}", f"Donated train step, {spec['lm']}",
                             baseline=BASELINE, columns=STEP_COLUMNS, description=result["desc"])
        table.add_rows(result["rows"])
    else:
        table = next((t for t in report.tables if t.id == "flags-lm16"), None)
        if table is None:
            table = report.table("flags-lm16", "XLA flag sets, donated lm16 step",
                                 baseline=f"{BASELINE} [default]", columns=FLAG_COLUMNS,
                                 description=result["desc"])
        adam = next((r for r in result["rows"] if r["name"] == BASELINE), None)
        for r in result["rows"]:
            figures = dict(r["figures"])
            if adam is not None:
                figures["vs_adam"] = figures["wall_s"] / adam["figures"]["wall_s"]
            table.add_row(f"{r['name']} [{task.flag_set}]", figures, r["note"], r["samples"])
    report.failed(result["failed"], task.label)


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phases", nargs="+", choices=["steps", "profile", "flags"],
                    default=["steps", "profile", "flags"])
    ap.add_argument("--lms", nargs="+", choices=sorted(LMS), default=["lm16", "lm100"],
                    help="LMs of the steps phase (lm16 first, then lm100: the longest)")
    short = {v: k for k, v in KEYS.items()}
    ap.add_argument("--peers", nargs="*", default=[short[p] for p in PEERS],
                    help="peers of the steps phase: jmp mpx flax apply_if_finite keras")
    ap.add_argument("--profile-peers", nargs="*", default=[short[p] for p in PROFILE_PEERS])
    ap.add_argument("--variants", nargs="*", default=None,
                    help="variants of the steps phase (default: all on lm16, "
                    f"{' '.join(short[v] for v in LM100_VARIANTS)} on lm100): "
                    f"{' '.join(short[v] for v in VARIANTS)}")
    ap.add_argument("--flag-sets", nargs="+", default=DEFAULT_FLAG_SETS,
                    help="XLA flag sets ('all' for every one): " + "; ".join(
                        f"{k}: {v or '(none)'}" for k, v in FLAG_SETS.items()))
    ap.add_argument("--xla-flag-set", action="append", default=[], metavar="NAME=FLAGS",
                    help="another flag set for the flags phase")
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--profile-xla-flags", default="", help="XLA_FLAGS added for the profile")
    ap.add_argument("--keep-traces", default=None, help="copy the .xplane.pb files here")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--compile-rounds", type=int, default=1)
    ap.add_argument("--time-limit", type=float, default=540.0,
                    help="seconds; phases that would start after it are skipped")
    ap.add_argument("--smoke", action="store_true", help="tiny LMs, few rounds (runs on a CPU)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for key in ("peers", "profile_peers", "variants"):
        if getattr(args, key) is not None:
            setattr(args, key, [KEYS.get(n, n) for n in getattr(args, key)])
    args.all_flag_sets = dict(FLAG_SETS)
    args.flag_recipes = FLAG_RECIPES
    for item in args.xla_flag_set:
        name, _, flags = item.partition("=")
        args.all_flag_sets[name] = flags
        args.flag_sets.append(name)
    if args.flag_sets == ["all"]:
        args.flag_sets = list(args.all_flag_sets)
    if args.smoke:
        args.rounds, args.iters, args.profile_steps = 3, 2, 2
        args.all_flag_sets.update(GUARD_TEST)
        if args.flag_sets == DEFAULT_FLAG_SETS:
            args.flag_sets = ["default", "cmdbuf+cond", *GUARD_TEST]
        args.flag_recipes = [BASELINE, OURS]
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        return child_main(args.child)
    start = time.perf_counter()
    lms = SMOKE_LMS if args.smoke else LMS
    settings = {k: v for k, v in vars(args).items() if k != "child"}
    settings["lm_configs"] = lms
    path = args.json or os.path.join(harness.RESULTS,
                                     f"gpu_loss_scaling{'.smoke' if args.smoke else ''}.json")
    report = harness.Report("gpu_loss_scaling", __doc__.split("\n\n")[0], settings, argv, env={})
    report.extra["xla_flags_available"] = available_flags()
    report.extra["flag_sets"] = {}
    for task in plan(args, lms):
        elapsed = time.perf_counter() - start
        if task.flag_set is not None:
            reason = harness.xla_flags_error(task.xla_flags)
            report.extra["flag_sets"][task.flag_set] = {"xla_flags": task.xla_flags,
                                                        "supported": reason is None,
                                                        "error": reason}
            if reason is not None:
                log(f"[{elapsed:5.0f} s] {task.label}: not supported by this XLA: {reason}")
                report.failed([{"name": task.label, "error": f"unsupported flags: {reason}"}])
                continue
        remaining = args.time_limit - elapsed
        if remaining < 20:
            log(f"[{elapsed:5.0f} s] {task.label}: skipped (time limit)")
            report.failed([{"name": task.label, "error": "skipped: --time-limit reached"}])
            continue
        log(f"[{elapsed:5.0f} s] {task.label}" + (f" (XLA_FLAGS {task.xla_flags})"
                                                 if task.xla_flags else ""))
        try:
            result = run_child(task.spec, task.xla_flags, timeout=remaining)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            log(f"[{time.perf_counter() - start:5.0f} s] {task.label}: FAILED ({e})")
            report.failed([{"name": task.label, "error": str(e)[:300]}])
            continue
        if not report.environment:
            report.environment = result["environment"]
        merge(report, task, result)
        report.write(path)
        print(harness.render_table(report.tables[-1].to_json()), flush=True)
    report.write(path)
    log(f"[{time.perf_counter() - start:5.0f} s] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
