"""The deviceless XLA:GPU tier: what XLA:GPU makes of the library's programs, read from the
optimized H100 program (compiled here without a GPU; see tests/support/xla_gpu.py).

The suite's other tests run on XLA:CPU, which keeps every float rounding. XLA:GPU does
not (``xla_allow_excess_precision``), turns float8 products into cuBLASLt or Triton
GEMMs, and has its own compile-time traps. Run the tier with the CUDA plugin installed::

    pip install -e '.[test,xla-gpu]'
    python -m pytest -m xla_gpu -q tests/test_xla_gpu.py

Without the plugin every test here skips. ``JMP_POLICY_XLA_GPU_FIGURES=<path>`` writes the
figures the tests read (sites, roundings kept, GEMMs, compile times) to a JSON file, to
compare two runs of the tier (a commit before a change and the tree after it).
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from typing import Any, Callable, Dict, Optional

import jax
import jax.numpy as jnp
import optax
import pytest

import jmp_policy
from support import jaxpr_walk
from support import xla_gpu
from support.checkpointed_stack import SAVED_PRODUCTS_BYTES, checkpointed_stack

# A system test tier (slow): compiles for an H100 with the CUDA plugin's compiler.
pytestmark = [pytest.mark.xla_gpu, pytest.mark.slow, xla_gpu.requires_plugin]

FIGURES: Dict[str, Any] = {}


@pytest.fixture(scope="module", autouse=True)
def _write_figures():
    yield
    path = os.environ.get("JMP_POLICY_XLA_GPU_FIGURES")
    if path and FIGURES:
        with open(path, "w") as f:
            json.dump(FIGURES, f, indent=1, sort_keys=True)


def spec(*shape: int, dtype: Any = jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


# --- a. roundings kept -----------------------------------------------------------------

def assert_roundings_kept(name: str, fn: Callable[..., Any], *specs: Any,
                          sites_expected: bool = True) -> None:
    """Every rounding ``fn`` asks for is left in the optimized H100 program.

    Criterion, per narrow float format T (float16, bfloat16, the float8s, float4_e2m1fn):
    ``kept_T >= min(sites_T, reference_T)``.

    * ``sites_T``: the jaxpr's narrowing conversions to T (`xla_gpu.quantization_sites`).
    * ``kept_T``: the roundings to T in the optimized HLO: conversions from a wider float
      to T (a native float8 GEMM's operands are such conversions) and ``reduce-precision``
      s to T's mantissa, which is how the library rounds in float32 (`jmp_policy.formats`)
      (`xla_gpu.roundings_kept`).
    * ``reference_T``: ``kept_T`` of the same program compiled with
      ``xla_allow_excess_precision`` off, where XLA removes no round trip.

    Why it fails when XLA removes a rounding: XLA:GPU's rewrite of a round trip
    ``convert(convert(x, T), f32) -> x`` deletes the conversion to T and leaves nothing
    of T in its place, so each removed rounding that the library does not make again
    lowers ``kept_T`` by one below what the reference keeps (the reference keeps it);
    `test_the_criterion_sees_a_removed_round_trip` shows it on a plain round trip. Why
    the reference: XLA rightly merges identical roundings (CSE: two parameter updates
    rounding the same sum) and drops dead ones, which lowers both counts alike; the
    bar is the sites XLA keeps when it may remove no round trip. It is necessary, not
    sufficient: XLA may duplicate a rounding into several kernels, which can hide a
    removed one; the tests on XLA:CPU with tests/support/excess_precision.py check the values.
    """
    sites = xla_gpu.quantization_sites(jax.make_jaxpr(fn)(*specs))
    assert sites or not sites_expected, f"{name}: no quantization site: not the program meant"
    text, _ = xla_gpu.compile_for_h100(fn, *specs)
    reference, _ = xla_gpu.compile_for_h100(
        fn, *specs, options={"xla_allow_excess_precision": False})
    figures = {t: {"sites": sites[t], "kept": xla_gpu.roundings_kept(text, t),
                   "reference": xla_gpu.roundings_kept(reference, t)} for t in sorted(sites)}
    FIGURES.setdefault("roundings", {})[name] = figures
    short = {t: f["kept"] for t, f in figures.items()
             if f["kept"] < min(f["sites"], f["reference"])}
    assert not short, f"{name}: XLA:GPU removed roundings (kept {short}): {figures}"


def test_the_criterion_sees_a_removed_round_trip():
    """The criterion fails on a bfloat16 round trip (XLA:GPU removes it) and holds with
    ``xla_allow_excess_precision`` off: the readers see what XLA does."""
    def round_trip(x):
        return x.astype(jnp.bfloat16).astype(jnp.float32) * 3.0

    x = spec(64, 64)
    assert xla_gpu.quantization_sites(jax.make_jaxpr(round_trip)(x)) == {"bfloat16": 1}
    text, _ = xla_gpu.compile_for_h100(round_trip, x)
    assert xla_gpu.roundings_kept(text, jnp.bfloat16) == 0
    text, _ = xla_gpu.compile_for_h100(round_trip, x,
                                       options={"xla_allow_excess_precision": False})
    assert xla_gpu.roundings_kept(text, jnp.bfloat16) == 1


RECIPES = {
    "tensorwise": jmp_policy.Float8Recipe("tensorwise"),
    "rowwise": jmp_policy.Float8Recipe("rowwise"),
    # The block scalings run emulated on an H100 (no native block-scaled GEMM).
    "mxfp8": jmp_policy.Float8Recipe("mxfp8", native=False),
    "nvfp4": jmp_policy.Float8Recipe("nvfp4", native=False),
    "delayed": jmp_policy.Float8Recipe("delayed"),
}


def grad_of(loss, recipe, *args):
    """``jax.grad`` of ``loss`` under autocast with ``recipe`` with respect to ``args``, and
    its arguments: a delayed recipe's function takes its histories first (abstract)."""
    f = jmp_policy.autocast(loss, "mixed_bfloat16", fp8=RECIPES[recipe])
    if not RECIPES[recipe].delayed:
        return jax.grad(f, argnums=tuple(range(len(args)))), args
    state = jax.eval_shape(lambda *a: jmp_policy.float8_state(f, *a), *args)
    return jax.grad(f, argnums=tuple(range(len(args) + 1))), (state, *args)


def layer_loss(x, w):
    return jnp.sum(jnp.tanh(x @ w))


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_float8_products_keep_their_roundings(recipe):
    """``jax.grad`` of one float8 product (forward and both backward products)."""
    fn, args = grad_of(layer_loss, recipe, spec(256, 512), spec(512, 256))
    assert_roundings_kept(f"autocast {recipe}", fn, *args)


@pytest.mark.parametrize("policy, recipe", [("mixed_float16", None),
                                            ("mixed_bfloat16", "nvfp4")])
def test_the_inspector_keeps_its_roundings(policy, recipe):
    """The numerics inspector's program (forward and backward), with its host callbacks
    made outputs (a deviceless compile cannot lower them): it measures what the
    roundings lose, so a removed rounding would read as no loss."""
    inspect = jmp_policy.inspect_numerics(layer_loss, policy, fp8=RECIPES.get(recipe),
                                          argnums=(0, 1))
    x = jax.random.normal(jax.random.key(0), (256, 512))
    w = jax.random.normal(jax.random.key(1), (512, 256)) * 512 ** -0.5
    program, args = xla_gpu.inspector_program(inspect, x, w)
    assert_roundings_kept(f"inspector {policy}{f' {recipe}' if recipe else ''}", program,
                          *jax.tree.map(lambda a: spec(*a.shape, dtype=a.dtype), args))


@pytest.mark.parametrize("policy, recipe", [("float32", "mxfp8"), ("float32", "nvfp4"),
                                            ("mixed_bfloat16", None)])
def test_the_inspector_compiles_with_its_callbacks(policy, recipe):
    """The inspector's program as a GPU compiles it, host callbacks included (with them made
    outputs, as above, its root is a tuple, and the bug below does not show). The product of tests/test_fp8_blocks.py's
    inspection of an MXFP8 product (which its scaling leaves as it is) was the program's
    output and fed the callbacks: XLA:GPU's Triton GEMM fusion pass failed on it
    ("RET_CHECK failure ... instruction->IsDead()", jax 0.10 and 0.11, on an H100 and
    deviceless). The inspector's program returns nothing now."""
    x = jnp.zeros((16, 32)).at[0, 0].set(448.0).at[0, 1].set(1e-4).at[1, 0].set(3.0)
    w = jnp.ones((32, 16))
    inspect = jmp_policy.inspect_numerics(jnp.matmul, policy, fp8=recipe)
    program, args = xla_gpu.inspector_program(inspect, x, w, callbacks_as_outputs=False)
    with xla_gpu.host_callbacks_lowered():
        text, _ = xla_gpu.compile_for_h100(
            program, *jax.tree.map(lambda a: spec(*a.shape, dtype=a.dtype), args))
    assert xla_gpu.custom_call_targets(text)["xla_ffi_python_gpu_callback"] >= 1


OPTIMIZERS = {
    "low_precision_params stochastic": (
        lambda: jmp_policy.low_precision_params(optax.adam(1e-3), "stochastic"), jnp.bfloat16),
    "quantize_state 8-bit": (lambda: jmp_policy.quantize_state(optax.adam(1e-3), bits=8),
                             jnp.float32),
    "quantize_state 4-bit": (lambda: jmp_policy.quantize_state(optax.adam(1e-3), bits=4),
                             jnp.float32),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_steps_keep_their_roundings(name):
    """An optimizer step (``update`` + ``apply_updates``) on transformer-shaped leaves."""
    make, dtype = OPTIMIZERS[name]
    tx = make()
    params = {"w": spec(512, 1024, dtype=dtype), "b": spec(1024, dtype=dtype)}
    state = jax.eval_shape(tx.init, params)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    # low_precision_params' misuse check is a host callback: zeros on the device here.
    with xla_gpu.harness.callbacks_on_device():
        # 4-bit codes are integers made by integer operations: maybe no float site.
        assert_roundings_kept(name, step, params, state, params, sites_expected=False)


# --- b. float8 GEMMs ---------------------------------------------------------------------

def mlp_loss(p, x):
    return jnp.sum(jnp.tanh(jax.nn.gelu(x @ p["w1"]) @ p["w2"]))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_every_eligible_product_is_a_float8_gemm(recipe):
    """Forward + backward of a two-layer MLP (gradients of the weights and the input):
    each of its 2 products is 3 float8 GEMMs (forward, and the gradients of both operands).

    A deviceless compile cannot autotune, so XLA:GPU makes every GEMM a Triton fusion
    with a default tiling; on a GPU the autotuner may choose cuBLASLt for any of them.
    Both are checked: with Triton GEMMs off
    (what XLA does when cuBLAS wins), ``__cublas$lt$matmul$f8`` calls, the rewrite whose
    pattern (float8 operands, scales as its operands) a recipe can miss, falling back to
    a bfloat16 GEMM; by default, GEMMs on float8 operands. No GEMM of another kind.
    """
    p = {"w1": spec(512, 1024), "w2": spec(1024, 512)}
    x = spec(256, 512, dtype=jnp.bfloat16)
    fn, args = grad_of(mlp_loss, recipe, p, x)
    products = sum(e.primitive.name == "dot_general"
                   for e in jaxpr_walk.eqns(jax.make_jaxpr(mlp_loss)(p, x)))
    cublas, _ = xla_gpu.compile_for_h100(fn, *args,
                                         options={"xla_gpu_enable_triton_gemm": False})
    triton, _ = xla_gpu.compile_for_h100(fn, *args)
    calls = xla_gpu.custom_call_targets(cublas)
    gemms = {"products": products, "cublaslt_f8": calls["__cublas$lt$matmul$f8"],
             "cublas_other": sum(n for t, n in calls.items()
                                 if "cublas" in t and "f8" not in t),
             "float8_dots": xla_gpu.float8_dots(triton), "dots": xla_gpu.opcodes(triton)["dot"]}
    FIGURES.setdefault("gemms", {})[recipe] = gemms
    assert products == 2
    assert gemms["cublaslt_f8"] == 3 * products and gemms["cublas_other"] == 0, gemms
    assert gemms["float8_dots"] == gemms["dots"] == 3 * products, gemms


# --- c. compile time ---------------------------------------------------------------------

def _gpu_fp8() -> Any:
    """benchmarks/gpu_fp8.py, whose MLP block and size sweep the compile-time test builds."""
    return xla_gpu.benchmark("gpu_fp8")


def _mlp_train_step(kind: str):
    """gpu_fp8's MLP block train step (AdamW) at its size: d_model 4096, 8192 tokens."""
    bench = _gpu_fp8()
    d, b, t = (bench.SIZES["full"][k] for k in ("d_model", "batch", "seq"))
    p = jax.eval_shape(lambda: bench.mlp_params(d))
    x = spec(b, t, d, dtype=jnp.bfloat16)
    return bench.train_step(kind), (p, bench.init_state(kind, p, x), x, spec(b, t, d))


def _summed_product(kind: str):
    """gpu_fp8's sweep: ``grad`` of ``sum(x @ w)``, x 8192 x 256 (its first size). The
    loss is linear in the product: its cotangent is a constant."""
    bench = _gpu_fp8()
    s = bench.SIZES["full"]["sweep"][0]
    return bench.product_grad(kind), (spec(bench.SIZES["full"]["sweep_tokens"], s,
                                           dtype=jnp.bfloat16), spec(s, s), None)


MARGIN = 2.0  # rowwise may take up to twice tensorwise's compile time
SLACK_S = 2.0  # and 2 s more, for a shared machine's noise on compiles of seconds
# The fastest of 2 compiles each. On a GPU, the first only: XLA keeps the autotuning of
# each GEMM fusion for the process, so a second compile of the same program skips the
# autotuning a user's first compile waits for, and would hide a slow first compile.
ROUNDS = 1 if jax.default_backend() == "gpu" else 2


@pytest.mark.parametrize("program", ["mlp train step", "summed product"])
def test_rowwise_compiles_about_as_fast_as_tensorwise(program):
    """Rowwise float8 compiles within ``MARGIN`` x tensorwise's time (+ ``SLACK_S``), for
    an H100 (the fastest of ``ROUNDS`` compiles; persistent cache off; XLA's compile only).

    Both recipes quantize the same operands into the same GEMMs; rowwise adds a row
    maximum per operand and a rescale per product, which cost XLA no more than a
    fraction of the compile. A slow compile has two kinds of cause: XLA's HLO passes
    (constant folding among them) and the autotuning of GEMMs. A deviceless compile
    runs the first but not the second, so this sees the first kind of cause only; on a
    GPU it sees both.
    """
    build = {"mlp train step": _mlp_train_step, "summed product": _summed_product}[program]
    seconds: Dict[str, float] = {}
    for _ in range(ROUNDS):  # interleaved, so that a shared machine's load hits both alike
        for kind in ("tensorwise", "rowwise"):
            fn, args = build(kind)
            _, t = xla_gpu.compile_for_h100(fn, *args)
            seconds[kind] = min(t, seconds.get(kind, t))
    FIGURES.setdefault("compile_s", {})[program] = seconds
    assert seconds["rowwise"] <= MARGIN * seconds["tensorwise"] + SLACK_S, seconds


# Per optimizer: (make it, the parameters' dtype, at most this many times Adam's count).
# The budgets are the counts measured when they were set, with a margin.
STEP_SIZES = {
    "cast_state": (lambda: jmp_policy.cast_state(optax.adam(1e-3)), jnp.float32, 2.8),
    "quantize_state 8-bit": (lambda: jmp_policy.quantize_state(optax.adam(1e-3), min_size=0),
                             jnp.float32, 7.0),
    "quantize_state 4-bit": (lambda: jmp_policy.quantize_state(optax.adam(1e-3), bits=4,
                                                               min_size=0),
                             jnp.float32, 8.2),
    "low_precision_params stochastic": (
        lambda: jmp_policy.low_precision_params(optax.adam(1e-3), "stochastic"),
        jnp.bfloat16, 2.9),
}


@pytest.mark.parametrize("name", list(STEP_SIZES))
def test_a_parameter_adds_to_the_h100_step_a_few_times_what_adam_adds(name):
    """The HLO instructions one more parameter adds to an optimizer step's H100 program,
    against plain Adam's (as tests/test_optimizer_size.py for XLA:CPU). XLA:GPU's
    priority fusion, the longest pass here, takes a time about proportional to them."""
    from support.compiled_kernels import instructions_per_leaf

    def compile(step: Callable[..., Any], *args: Any) -> str:
        with xla_gpu.harness.callbacks_on_device():  # low_precision_params' misuse check
            return xla_gpu.compile_for_h100(step, *args)[0]

    make, dtype, budget = STEP_SIZES[name]
    adam = instructions_per_leaf(lambda: optax.adam(1e-3), jnp.float32, compile)
    count = instructions_per_leaf(make, dtype, compile)
    FIGURES.setdefault("instructions_per_leaf", {})[name] = [count, adam]
    assert count <= budget * adam, (count, adam, count / adam)


# --- d. memory traffic -------------------------------------------------------------------

def _unfused_results(text: str, hlo_type: str) -> Dict[str, tuple]:
    """The arrays of ``hlo_type`` (``"pred"``, ``"f32"``) that kernels of an optimized module
    write (instructions outside fusion bodies), by instruction: their shapes."""
    fused = xla_gpu.harness.fused_computations(text)
    out = {}
    for i in xla_gpu.instructions(text):
        if i.computation in fused:
            continue
        shapes = [tuple(int(d) for d in dims.split(",") if d)
                  for dims in re.findall(rf"\b{hlo_type}\[([\d,]*)\]", i.shape)]
        if shapes:
            out[i.name] = tuple(shapes)
    return out


@pytest.mark.parametrize("kind", ["tensorwise", "delayed"])
def test_quantizing_a_weight_writes_no_rounding_masks(kind):
    """gpu_fp8's float8 tensorwise train step: no kernel writes a ``pred`` array the size of
    a weight. The weights' quantization is fused with their transpose (the backward
    product's operand); XLA:GPU splits such a transpose fusion at every operation that
    yields a ``pred`` array, into kernels that write the mask and read the float32 weight
    again. `formats.round_nearest` rounds with no comparison for that reason."""
    fn, args = _mlp_train_step(kind)
    text, _ = xla_gpu.compile_for_h100(fn, *args)
    weight_sizes = {math.prod(w.shape) for w in jax.tree.leaves(args[0]) if len(w.shape) == 2}
    masks = {name: shapes for name, shapes in _unfused_results(text, "pred").items()
             if any(math.prod(s) in weight_sizes for s in shapes)}
    FIGURES.setdefault("weight_sized_masks", {})[kind] = len(masks)
    assert not masks, masks


def _small_mlp_train_step(kind: Optional[str]) -> tuple:
    """gpu_fp8's MLP block train step (LayerNorm, ``jax.nn.gelu``, two products; AdamW,
    parameters donated) at a small size: d_model 256, 1024 tokens."""
    bench = _gpu_fp8()
    d, b, t = 256, 4, 256
    p = jax.eval_shape(lambda: bench.mlp_params(d))
    x = spec(b, t, d, dtype=jnp.bfloat16)
    return bench.train_step(kind), (p, bench.init_state(kind, p, x), x, spec(b, t, d))


def test_cudnn_attention_under_autocast_is_known_and_stays_fused():
    """``jax.nn.dot_product_attention`` with cuDNN's implementation (its choice on a GPU)
    under autocast: no warning of an unknown primitive, and the compiled gradient calls
    cuDNN's fused attention, forward and backward, on bfloat16 operands."""
    def loss(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return jnp.sum(out.astype(jnp.float32))

    grad = jax.grad(jmp_policy.autocast(loss, "mixed_bfloat16"), argnums=(0, 1, 2))
    qkv = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jmp_policy.AutocastWarning)
        text, _ = xla_gpu.compile_for_h100(grad, qkv, qkv, qkv)
    fused = [t for t in xla_gpu.custom_call_targets(text) if "fmha" in t]
    assert len(fused) >= 2, xla_gpu.custom_call_targets(text)  # forward and backward


@pytest.mark.parametrize("kind", [None, "tensorwise", "rowwise", "delayed"])
def test_the_mlp_activation_and_its_gradient_are_never_written_in_float32(kind):
    """`_small_mlp_train_step` under ``mixed_bfloat16``, bfloat16 and every float8 recipe:
    no kernel writes a float32 array of the hidden activation's size (``tokens x 4 d``):
    the GELU's input, output, saved ``tanh`` and gradient stay bfloat16, as in plain
    bfloat16 JAX, and each float8 cast reads them in bfloat16. A float32 coefficient of the
    GELU (or ``x ** 3`` evaluated in float32) would widen the chain, and every recipe would
    write and read float32 copies of that size, the largest tensors of the step."""
    fn, args = _small_mlp_train_step(kind)
    text, _ = xla_gpu.compile_for_h100(fn, *args, options={"xla_gpu_enable_triton_gemm": False})
    tokens, d = math.prod(args[2].shape[:-1]), args[2].shape[-1]
    hidden = {name: shapes for name, shapes in _unfused_results(text, "f32").items()
              if any(math.prod(s) == tokens * 4 * d for s in shapes)}
    FIGURES.setdefault("float32_hidden_writes", {})[str(kind)] = len(hidden)
    assert not hidden, hidden
    assert _unfused_results(text, "bf16"), "no bfloat16 kernel result: not the program meant"


@pytest.mark.parametrize("kind", [None, "tensorwise", "rowwise", "delayed"])
def test_a_train_step_copies_no_weight(kind):
    """`_mlp_train_step` (at gpu_fp8's size: XLA:GPU schedules a small one otherwise): no
    ``copy`` of a weight-sized float32 array. The parameters
    are donated, so the update writes each weight in place; a float8 recipe that still
    reads the old weight after its update makes XLA copy it first (as rowwise float8 would
    if its weight, quantized again along the backward product's axis, waited for the
    backward pass)."""
    fn, args = _mlp_train_step(kind)
    donated = jax.jit(fn, donate_argnums=(0, 1)).trace(*xla_gpu.on_h100(args))  # as gpu_fp8
    text, _ = xla_gpu.compile_traced(donated, {"xla_gpu_enable_triton_gemm": False})
    weights = {math.prod(w.shape) for w in jax.tree.leaves(args[0]) if len(w.shape) == 2}
    written = _unfused_results(text, "f32")
    copies = [i.name for i in xla_gpu.instructions(text) if i.opcode == "copy"
              and any(math.prod(s) in weights for s in written.get(i.name, ()))]
    FIGURES.setdefault("weight_copies", {})[str(kind)] = len(copies)
    assert not copies, copies


@pytest.mark.parametrize("kind", ["tensorwise", "rowwise", "delayed"])
def test_each_float8_weight_is_transposed_once(kind):
    """`_mlp_train_step` at gpu_fp8's size: the float8 GEMMs take a weight contraction-major
    in the forward product and in the backward one, two layouts, so one transposing
    kernel per weight writes its float8 values (XLA:GPU names such kernels
    ``*transpose*``). Left to itself, XLA's layout assignment gives the cast the forward
    GEMM's layout (reading the float32 weight transposed) and transposes the float8 values
    back: two per weight. So the weight's float8 values are pinned row-major."""
    fn, args = _mlp_train_step(kind)
    traced = jax.jit(fn, donate_argnums=(0, 1)).trace(*xla_gpu.on_h100(args))
    text, _ = xla_gpu.compile_traced(traced, {"xla_gpu_enable_triton_gemm": False})
    weights = [math.prod(w.shape) for w in jax.tree.leaves(args[0]) if len(w.shape) == 2]
    fused = xla_gpu.harness.fused_computations(text)
    transposing = [
        i.name for i in xla_gpu.instructions(text)
        if i.computation not in fused and "transpose" in i.name
        and any(math.prod(int(d) for d in dims.split(",") if d) in weights
                for dims in re.findall(r"\bf8e\w+\[([\d,]*)\]", i.shape))]
    FIGURES.setdefault("weight_transposes", {})[kind] = len(transposing)
    assert len(transposing) == len(weights), transposing


# --- e. collectives on eight GPUs ------------------------------------------------------

SHARDED_OPTIMIZERS = {  # name: (optimizer, parameters' and gradients' dtypes)
    "adam": (lambda: optax.adam(1e-3), jnp.float32, jnp.float32),
    "loss_scaling": (lambda: jmp_policy.loss_scaling(optax.adam(1e-3), "dynamic"),
                     jnp.float32, jnp.bfloat16),
    "quantize_state 8-bit": (lambda: jmp_policy.quantize_state(optax.adam(1e-3)),
                             jnp.float32, jnp.float32),
    "quantize_state 4-bit": (lambda: jmp_policy.quantize_state(optax.adam(1e-3), bits=4),
                             jnp.float32, jnp.float32),
    "cast_state": (lambda: jmp_policy.cast_state(optax.adam(1e-3)), jnp.float32, jnp.float32),
    "low_precision_params": (
        lambda: jmp_policy.low_precision_params(optax.adam(1e-3), "stochastic"),
        jnp.bfloat16, jnp.bfloat16),
}
# A synchronous collective, or the ``-done`` of an asynchronous one: the result's shape
# (a ``-start``'s is a tuple with the operands', spaced in newer XLA).
_COLLECTIVE = re.compile(r"= (\S+) (all-reduce|all-gather|reduce-scatter|collective-permute"
                         r"|all-to-all)(?:-done)?\(")


@pytest.mark.parametrize("name", list(SHARDED_OPTIMIZERS))
def test_fsdp_optimizer_steps_on_eight_h100s_add_only_their_own_collectives(name):
    """An FSDP step (12 weights sharded along their columns over 8 deviceless H100s, Auto
    axes) of each optimizer: Adam's program has no collective; ours add only what their
    job needs: loss scaling one scalar all-reduce (every device skips together: on
    XLA:CPU one per gradient group, which XLA:GPU combines), the misuse check of
    `low_precision_params` its samples (16 per weight, seen and landed), the quantized
    and cast states none (their blocks lie within a shard)."""
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec as P

    topology = topologies.get_topology_desc(
        platform="cuda", target_config=xla_gpu.harness.H100_TARGET, topology="1x1x8")
    mesh = topologies.make_mesh(topology, (8,), ("data",))
    make, p_dtype, g_dtype = SHARDED_OPTIMIZERS[name]
    tx = make()
    columns = NamedSharding(mesh, P(None, "data"))
    shapes = [(1024, 2048 * (i % 3 + 1)) for i in range(12)]
    params = [jax.ShapeDtypeStruct(s, p_dtype, sharding=columns) for s in shapes]
    grads = [jax.ShapeDtypeStruct(s, g_dtype, sharding=columns) for s in shapes]
    state = jax.tree.map(  # sharded like the parameters where shaped like them
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=(
            columns if x.shape in shapes else NamedSharding(mesh, P()))),
        jax.eval_shape(tx.init, params))

    def step(g: Any, s: Any, p: Any) -> Any:
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    with xla_gpu.harness.callbacks_on_device():
        text, _ = xla_gpu.compile_traced(jax.jit(step).trace(grads, state, params))
    found = sorted(f"{kind} {shape.split('{')[0]}" for shape, kind in _COLLECTIVE.findall(text))
    FIGURES.setdefault("fsdp_collectives_8_h100", {})[name] = found
    expected = {"loss_scaling": ["all-reduce f32[]"],
                "low_precision_params": ["all-reduce bf16[192]"] * 2}.get(name, [])
    assert found == expected


# --- f. compile time of a whole train step, per optimizer recipe ------------------------

# What a user waits for is the compile of the train step: a 16-layer transformer's
# gradient, then the optimizer step, over its 96 leaves (50.4M parameters). Each recipe
# compiles within this many times plain Adam's train step, for an H100 and on XLA:CPU
# (default flags). Per-leaf work is what costs: scanned layers (nn.scan, nnx.scan, a
# lax.scan over stacked weights) have one leaf per kind of weight, not one per layer.
TRAIN_STEP_BUDGETS = {
    "adam, bf16 moments": {"h100": 2.0, "cpu": 3.0},
    "kahan": {"h100": 2.5, "cpu": 2.5},
    "stochastic": {"h100": 2.5, "cpu": 2.5},
    "split": {"h100": 2.5, "cpu": 2.5},
    "adam, 8-bit moments": {"h100": 4.0, "cpu": 4.0},
    "adam, 4-bit moments": {"h100": 4.5, "cpu": 4.5},
}


@pytest.fixture(scope="module")
def train_step_compile_seconds() -> Dict[str, Dict[str, float]]:
    """``{target: {recipe: seconds}}``: the fastest of three fresh compiles of each recipe's
    train step (`benchmarks.bench_compile_time`'s workers, each target in a process of
    its own with XLA's default flags; the recipes interleaved, so that load hits them
    alike)."""
    import argparse
    import sys

    from benchmarks import bench_compile_time

    args = argparse.Namespace(layers=16, d=512, reps=3, tokens=2048, train_step=True)
    seconds = {}
    for target in ("h100", "cpu"):
        rows = bench_compile_time.run_worker(sys.executable, None, target, args)["rows"]
        seconds[target] = {recipe: min(row["compile_s"]) for recipe, row in rows.items()}
    FIGURES["train_step_compile_s"] = seconds
    return seconds


@pytest.mark.parametrize("target", ["h100", "cpu"])
@pytest.mark.parametrize("recipe", list(TRAIN_STEP_BUDGETS))
def test_a_train_step_compiles_within_its_budget_of_adams(recipe, target,
                                                          train_step_compile_seconds):
    seconds = train_step_compile_seconds[target]
    ratio = seconds[recipe] / seconds["adam"]
    assert ratio <= TRAIN_STEP_BUDGETS[recipe][target], (recipe, target, seconds)


def _float8_residuals_mlp(residuals: Optional[str]) -> tuple:
    """A pre-norm GELU MLP block's gradient under ``mixed_bfloat16``, d_model 256 and 2048
    tokens, with the backward pass's residuals as computed or in float8."""
    def loss(w1, w2, x):
        h = jax.nn.gelu(jax.nn.standardize(x, axis=-1) @ w1)
        return jnp.mean((x + h @ w2) ** 2)

    f = jmp_policy.autocast(loss, "mixed_bfloat16", residuals=residuals)
    return jax.grad(f, argnums=(0, 1)), (spec(256, 1024), spec(1024, 256), spec(2048, 256))


def test_float8_residuals_are_written_once_and_shrink_the_step():
    """Each stored residual is written once, in float8, by the forward pass (the barrier
    holds on XLA:GPU: fusion does not move the rounding into the backward pass, which
    would keep the wide array instead), and the step's temporaries fall."""
    figures = {}
    for residuals in (None, "float8"):
        fn, args = _float8_residuals_mlp(residuals)
        compiled = jax.jit(fn).trace(*xla_gpu.on_h100(args)).lower().compile(
            {"xla_gpu_enable_triton_gemm": False})
        text = compiled.as_text()
        kernels = {i.name for i in xla_gpu.instructions(text)
                   if i.opcode in ("fusion", "custom-call")}
        hidden = [name for name, shapes in _unfused_results(text, "f8e4m3fn").items()
                  if name in kernels and any(math.prod(s) == 2048 * 1024 for s in shapes)]
        figures[str(residuals)] = {"temp": compiled.memory_analysis().temp_size_in_bytes,
                                   "float8_hidden_writes": len(hidden)}
    FIGURES["float8_residuals"] = figures
    # The product before GELU is the one hidden-sized root: GELU's values are recomputed.
    assert figures["float8"]["float8_hidden_writes"] == 1, figures
    assert figures["None"]["float8_hidden_writes"] == 0, figures
    # At least the hidden root's bytes in bfloat16 less its bytes in float8 are saved.
    assert figures["None"]["temp"] - figures["float8"]["temp"] >= 2048 * 1024, figures


def test_float8_residuals_of_checkpointed_layers_shrink_the_step():
    """What the checkpoint policy saves of each layer is loaded where the backward pass
    reaches that layer: loaded all at once, every layer's saved products are wide again
    while the last layer is differentiated, and the step's memory does not fall."""
    temp = {}
    for residuals in (None, "float8"):
        fn, args = checkpointed_stack(residuals)
        compiled = jax.jit(fn).trace(*xla_gpu.on_h100(args)).lower().compile(
            {"xla_gpu_enable_triton_gemm": False})
        temp[str(residuals)] = compiled.memory_analysis().temp_size_in_bytes
    FIGURES["float8_residuals_checkpointed"] = temp
    # The saved products in float8 are half their bfloat16 bytes: at least three quarters
    # of that saving comes off the peak.
    assert temp["None"] - temp["float8"] >= 0.75 * SAVED_PRODUCTS_BYTES, temp
