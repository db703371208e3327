"""A standalone reproducer of an XLA:GPU compiler failure (an XLA bug, for a report upstream).

A product that is the program's result and also an operand of a side-effecting custom
call (a ``jax.debug.callback`` on a GPU is one) fails to compile for an H100::

    jax.errors.JaxRuntimeError: INTERNAL: RET_CHECK failure
      (external/xla+/xla/hlo/ir/hlo_computation.cc:680) instruction->IsDead()

in the pass ``triton-gemm-rewriter`` (GemmFusion, of the ``hlo_normalization`` pipeline;
``TF_CPP_VMODULE=hlo_pass_pipeline=2`` names it): the entry computation's ROOT is the
``dot``, which has another user. Seen with jax/jaxlib 0.10.2 (CUDA 12 plugin) and 0.11.2
(CUDA 13 plugin), deviceless and on an H100. It depends on the GEMM's shape (the dots
the pass makes Triton fusions of: 16x32x16 float32 and 1024x1024x1024 bfloat16 fail,
256x512x256 does not, float32 or bfloat16). A root that is not the product (a tuple, the
product plus 1) compiles; so does the program without the custom call.

The numerics inspector hit it (tests/test_fp8_blocks.py's MXFP8 inspection, whose
program returned the product, which its statistics' callback read); its programs return
nothing now (jmp_policy/inspector.py), and tests/test_xla_gpu.py's
``test_the_inspector_compiles_with_its_callbacks`` compiles them with their callbacks.

Run with the CUDA plugin installed (no GPU needed)::

    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python benchmarks/repro_xla_gpu_ret_check.py

The HLO handed to XLA (``XLA_FLAGS=--xla_dump_to=...``, ``before_optimizations``)::

    ENTRY %main.1 (x.1: f32[16,32], w.1: f32[32,16]) -> f32[16,16] {
      %x.1 = f32[16,32]{1,0} parameter(0)
      %w.1 = f32[32,16]{1,0} parameter(1)
      ROOT %dot_general.1 = f32[16,16]{1,0} dot(%x.1, %w.1), lhs_contracting_dims={1},
          rhs_contracting_dims={0}
      %debug_callback.1 = () custom-call(%dot_general.1),
          custom_call_target="xla_ffi_python_gpu_callback", custom_call_has_side_effect=true,
          api_version=API_VERSION_TYPED_FFI
    }
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import harness  # noqa: E402


def side_effect(y: jax.Array) -> None:
    """A side-effecting custom call reading ``y``: what ``jax.debug.callback`` lowers to on a
    GPU (the CUDA plugin's Python callback, host callback 0, which is never run), without
    its lowering's need for a live GPU backend."""
    jax.ffi.ffi_call("xla_ffi_python_gpu_callback", (), has_side_effect=True)(
        y, index=np.uint64(0))


def root_product(x: jax.Array, w: jax.Array) -> jax.Array:
    y = x @ w
    side_effect(y)
    return y


def root_tuple(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    y = x @ w
    side_effect(y)
    return y, y + 1


def no_side_effect(x: jax.Array, w: jax.Array) -> jax.Array:
    return x @ w


def compile_for_gpu(fn, m: int, k: int, n: int, dtype) -> str:
    sharding, _ = harness.gpu_target()
    specs = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape in ((m, k), (k, n))]
    try:
        jax.jit(fn).trace(*specs).lower().compile()
        return "compiles"
    except Exception as e:  # noqa: BLE001  # the XLA error is the finding
        return f"FAILS: {str(e).splitlines()[0][:110]}"


def main() -> None:
    _, target = harness.gpu_target()
    print(f"jax {jax.__version__}, jaxlib {jax.lib.__version__}; {target}")
    for m, k, n, dtype in [(16, 32, 16, jnp.float32), (1024, 1024, 1024, jnp.bfloat16),
                           (256, 512, 256, jnp.float32)]:
        for fn in (root_product, root_tuple, no_side_effect):
            print(f"{m}x{k}x{n} {jnp.dtype(dtype).name:9s} {fn.__name__:15s} "
                  f"{compile_for_gpu(fn, m, k, n, dtype)}")


if __name__ == "__main__":
    main()
