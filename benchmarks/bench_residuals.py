"""Float8 residuals: the memory a backward pass keeps, per token and per device.

Three tables, each a ratio to ``mixed_bfloat16``:

* ``lm_residuals``: the example LM (``examples/transformer_lm.py``, 2 blocks),
  its loss differentiated with respect to the parameters. ``residual bytes /
  token``: XLA's memory account (``memory_analysis``, on this machine's
  backend) of the compiled forward pass that returns what ``jax.vjp`` keeps
  (``jax.tree.leaves`` of its function), at a batch of 16 and of 32 sequences,
  the difference divided by the tokens added (what a token costs, the
  per-parameter residuals cancelling). ``step temporaries / token``: the same
  difference of the whole compiled gradient's temporaries, on this backend and,
  where the CUDA plugin is installed, for an H100 (a deviceless compile).
  ``mixed_bfloat16`` is the example's own (module policies, no autocast), a float8
  recipe's row its model's ``apply`` under ``autocast(..., fp8=...)``, and a row with
  float8 residuals ``autocast`` of the whole loss (its softmax is a residual too).
* ``scale_lm_memory``: ``examples/scale_lm.py``'s train step (FSDP over the
  devices, each layer ``jax.checkpoint``-ed), XLA's per-device arguments,
  temporaries and their sum (the peak an allocator needs), on 8 simulated CPU
  devices and for one deviceless H100 (the global batch of 16 on it): float32,
  ``mixed_bfloat16`` (float32 weights and AdamW), and the example's recipe
  (float8 products, bfloat16 weights, 8-bit AdamW moments) without and with float8
  residuals.
* ``lm_gpu_size`` (needs the CUDA plugin): the example LM at a GPU's size
  (``benchmarks.gpu_train_step``'s ``gpu`` preset), its whole train step compiled for
  one H100: its temporaries and the bytes its kernels read and write
  (`harness.kernels`), for ``mixed_bfloat16`` and float8 residuals, with and
  without the attention's softmax (the residual whose storing costs most).

XLA:CPU removes optimization barriers after it folds constants and before it
schedules and fuses, so on the CPU the library orders float8 residuals' loads
through a conditional instead (``residuals/_transform._in_order_on_cpu``), and
``formats.unfoldable`` hides an operand itself rather than a one it multiplies by
(which became a constant broadcast, written whole and kept from the forward pass
to the backward). With the barriers alone (f56b00a), XLA:CPU fused each load into
the forward pass's store and kept the wide result: ``scale_lm``'s recipe took
0.60x ``mixed_bfloat16``'s memory per device on 8 CPU devices (0.635x on the
commit before the conditional, 14.3 MB), 0.40x with the conditional (9.0 MB),
0.30x with both (6.9 MB); the example LM's step temporaries per token 0.91x, 0.50x
with them. The deviceless H100 compile
cannot tile the example LM's float32 products for Triton's GEMMs, so the
example LM's H100 figures are compiled with ``xla_gpu_enable_triton_gemm``
off (cuBLAS GEMMs), except where cuBLAS refuses a product (the block-scaled
recipes), which keep Triton's; so are ``scale_lm``'s (with Triton's GEMMs, untuned
without a device, its float8 products write float32 results).

Run from the repository root (the H100 columns need the CUDA plugin, see
``bench_xla_gpu_memory``; 8 CPU devices are simulated here)::

    python -m benchmarks.bench_residuals
    /tmp/gpuvenv/bin/python -m benchmarks.bench_residuals   # with the H100 columns

JSON to ``benchmarks/results/bench_residuals.json``.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and "jax" not in sys.modules:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
from typing import Any, Callable, Dict, List, Optional  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import jmp_policy  # noqa: E402
from benchmarks import harness  # noqa: E402

LM_RUNS: Dict[str, Dict[str, Any]] = {
    "float32": {"policy": "float32"},
    "mixed_bfloat16": {},
    "float8 residuals": {"residuals": "float8"},
    "tensorwise": {"fp8": "tensorwise"},
    "tensorwise, float8 residuals": {"fp8": "tensorwise", "residuals": "float8"},
    "rowwise": {"fp8": "rowwise"},
    "rowwise, float8 residuals": {"fp8": "rowwise", "residuals": "float8"},
    "mxfp8": {"fp8": "mxfp8"},
    "mxfp8, float8 residuals": {"fp8": "mxfp8", "residuals": "float8"},
    "nvfp4": {"fp8": "nvfp4"},
    "nvfp4, float8 residuals": {"fp8": "nvfp4", "residuals": "float8"},
}
"""Keyword arguments of the example's ``make_train_step`` (and its policy)."""

LM_COLUMNS = [
    harness.Column("residuals", "residuals / token", "KiB"),
    harness.Column("temp", "step temporaries / token", "KiB"),
    harness.Column("temp_h100", "step temporaries / token, H100", "KiB"),
]
SCALE_COLUMNS = [
    harness.Column(f"{what}{where}", f"{label}{title}", "bytes")
    for where, title in (("", ", 8 CPU devices"), ("_h100", ", H100"))
    for what, label in (("args", "arguments / device"), ("temp", "temporaries / device"),
                        ("peak", "arguments + temporaries / device"))
]


def per_token(measure: Callable[[int], float], seq: int) -> float:
    """What a token adds to ``measure(batch)`` (bytes), in KiB: between batches of 16 and
    32."""
    return round((measure(32) - measure(16)) / (16 * (seq - 1)) / 1024, 2)


def lm_row(lm: Any, options: Dict[str, Any], h100: Optional[Any]) -> Dict[str, float]:
    options = dict(options)
    init, _, loss = lm.make_train_step(options.pop("policy", "mixed_bfloat16"), **options)
    params, seq = init(0)[0], lm.Config().seq_len

    def residual_bytes(batch: int) -> float:
        tokens = jnp.zeros((batch, seq), jnp.int32)
        kept = jax.jit(lambda p, t: jax.tree.leaves(jax.vjp(lambda p: loss(p, t), p)[1]))
        return kept.lower(params, tokens).compile().memory_analysis().output_size_in_bytes

    def temp(batch: int, sharding: Any = None) -> float:
        args = (params, jnp.zeros((batch, seq), jnp.int32))
        if sharding is None:
            return jax.jit(jax.grad(loss)).lower(*args).compile().memory_analysis() \
                .temp_size_in_bytes
        lowered = jax.jit(jax.grad(loss)).lower(*harness.on_target(args, sharding))
        try:
            # The deviceless compile cannot tile the example's float32 products for
            # Triton's GEMMs (nothing to autotune on): cuBLAS's, where it takes them.
            compiled = lowered.compile({"xla_gpu_enable_triton_gemm": False})
        except Exception:  # block-scaled products, which cuBLAS does not take here
            compiled = lowered.compile()
        return compiled.memory_analysis().temp_size_in_bytes

    row: Dict[str, Any] = {"residuals": per_token(residual_bytes, seq),
                           "temp": per_token(temp, seq)}
    if h100 is not None:
        row["temp_h100"] = _or_error(lambda: per_token(lambda b: temp(b, h100), seq), row)
    return row


def _or_error(figure: Callable[[], float], row: Dict[str, Any]) -> Optional[float]:
    """``figure()``, or ``None`` with the compiler's error in the row's ``error``: a
    deviceless compile that XLA:GPU refuses leaves its cell empty, not the report."""
    try:
        return figure()
    except Exception as e:
        row.setdefault("error", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return None


def scale_row(scale_lm: Any, run: Any, c: Any, meshes: Dict[str, Any]) -> Dict[str, Any]:
    row: Dict[str, Any] = {}
    for where, mesh in meshes.items():
        # A deviceless compile cannot lower the host callback of low_precision_params'
        # misuse check: on the H100 it returns zeros on the device instead.
        on_device = harness.callbacks_on_device() if where else contextlib.nullcontext()
        # As for the example LM: cuBLAS's GEMMs, not Triton's untuned ones.
        options = {"xla_gpu_enable_triton_gemm": False} if where else None
        with on_device:
            memory = _or_error(lambda: scale_lm.step_memory(run, c, mesh, options), row)
        if memory is not None:
            args, temp = memory.argument_size_in_bytes, memory.temp_size_in_bytes
            row.update({f"args{where}": args, f"temp{where}": temp, f"peak{where}": args + temp})
    return row


def h100_mesh() -> Optional[Any]:
    """A one-device mesh (axis ``"data"``) of a deviceless H100; ``None`` without the
    CUDA plugin."""
    try:
        sharding = harness.h100_sharding()
    except Exception:  # no CUDA plugin: the H100 columns are left out
        return None
    devices = np.asarray(sharding.mesh.devices).reshape(-1)[:1]
    return jax.sharding.Mesh(devices, ("data",), axis_types=(AxisType.Auto,))


def lm_table(report: Any, lm: Any, h100: Optional[Any], runs: Optional[List[str]]) -> None:
    table = report.table("lm_residuals", "example LM: what the backward pass keeps, per token",
                         baseline="mixed_bfloat16", columns=LM_COLUMNS,
                         description="examples/transformer_lm.py, batches of 16 and 32")
    sharding = None if h100 is None else jax.sharding.NamedSharding(
        h100, jax.sharding.PartitionSpec())
    for name, options in LM_RUNS.items():
        if runs is None or name in runs:
            figures = lm_row(lm, options, sharding)
            table.add_row(name, figures, note=figures.pop("error", ""))
            print(f"  {name}: {table.rows[-1]['figures']}", flush=True)
    print(harness.render_table(table.to_json()), flush=True)


def scale_table(report: Any, scale_lm: Any, h100: Optional[Any]) -> None:
    c, steps = scale_lm.Config(), 300
    meshes = {"": jax.make_mesh((jax.device_count(),), ("data",),
                                axis_types=(AxisType.Auto,))}
    if h100 is not None:
        meshes["_h100"] = h100
    float32, recipe = scale_lm.runs(c, steps, seed=0)
    _, without = scale_lm.runs(c, steps, seed=0, residuals=None)
    table = report.table("scale_lm_memory", "scale_lm's train step: memory per device",
                         baseline="mixed_bfloat16", columns=SCALE_COLUMNS,
                         description=f"examples/scale_lm.py, {jax.device_count()} CPU devices"
                                     " (FSDP) and one H100, global batch of 16")
    for name, run in (("float32", float32), ("mixed_bfloat16", scale_lm.mixed_bfloat16(c, steps)),
                      ("bf16+fp8 without float8 residuals", without),
                      ("bf16+fp8 (float8 residuals)", recipe)):
        figures = scale_row(scale_lm, run, c, meshes)
        table.add_row(name, figures, note=figures.pop("error", ""))
    print(harness.render_table(table.to_json()), flush=True)


GPU_RUNS: Dict[str, Dict[str, Any]] = {
    "mixed_bfloat16": {},
    "float8 residuals": {"residuals": "float8"},
    "float8 residuals, softmax excluded": {"residuals": ("Softmax",)},
}
"""Keyword arguments of the example's ``make_train_step``; a tuple of ``residuals`` is
``Float8Residuals``' ``exclude``."""


def gpu_size_table(report: Any, lm: Any) -> None:
    from benchmarks.gpu_train_step import SIZES  # it imports LM_RUNS from here
    config = lm.Config(**SIZES["gpu"])
    table = report.table("lm_gpu_size", "example LM at a GPU's size: the train step on an H100",
                         baseline="mixed_bfloat16", columns=[
                             harness.Column("temp", "step temporaries", "bytes"),
                             harness.Column("kernel_bytes", "bytes its kernels move", "bytes")],
                         description=f"examples/transformer_lm.py, {SIZES['gpu']}, deviceless "
                                     "compile, cuBLAS GEMMs")
    for name, options in GPU_RUNS.items():
        options = dict(options)
        if isinstance(options.get("residuals"), tuple):
            options["residuals"] = jmp_policy.Float8Residuals(exclude=options["residuals"])
        init, train_step, _ = lm.make_train_step("mixed_bfloat16", config, **options)
        params, opt_state = jax.eval_shape(lambda: init(0))
        batch = jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), jnp.int32)
        args = harness.on_target((params, opt_state, batch), harness.h100_sharding())
        with harness.callbacks_on_device():
            compiled = jax.jit(train_step).trace(*args).lower().compile(
                {"xla_gpu_enable_triton_gemm": False})
        table.add_row(name, {"temp": compiled.memory_analysis().temp_size_in_bytes,
                             "kernel_bytes": sum(k.bytes for k in harness.kernels(
                                 compiled.as_text()))})
    print(harness.render_table(table.to_json()), flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", nargs="+", default=None, help=f"of {list(LM_RUNS)}")
    parser.add_argument("--tables", nargs="+",
                        default=["lm_residuals", "scale_lm_memory", "lm_gpu_size"],
                        help="the tables to measure (default all; lm_gpu_size needs the CUDA "
                             "plugin)")
    parser.add_argument("--json", help="default: benchmarks/results/bench_residuals.json")
    args = parser.parse_args(argv)
    lm = harness.load_file("examples/transformer_lm.py")
    scale_lm = harness.load_file("examples/scale_lm.py")
    h100 = h100_mesh()
    report = harness.Report("bench_residuals", __doc__.split("\n")[0], vars(args), argv,
                            env=harness.environment())

    if "lm_residuals" in args.tables:
        lm_table(report, lm, h100, args.runs)
    if "scale_lm_memory" in args.tables:
        scale_table(report, scale_lm, h100)
    if "lm_gpu_size" in args.tables and h100 is not None:
        gpu_size_table(report, lm)
    path = args.json or harness.default_json_path("bench_residuals")
    report.write(path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
