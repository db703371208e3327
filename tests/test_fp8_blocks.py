"""Tests for the block-scaled recipes (``fp8="mxfp8"``, ``fp8="nvfp4"``) and stochastic
rounding through autocast: the recipes' settings, the quantized values against
hand-computed ones and against JAX's reference quantization bit for bit, the choice
between the native block-scaled product and its emulation, which products take which
formats forward and backward, unbiased stochastic rounding, per-expert blocks in
ragged products, non-finite values, and composition with transformations and
frameworks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from support.excess_precision import COMPILERS, inspect_as_on_a_gpu
from support.jaxpr_walk import eqns

import jmp_policy
from jmp_policy import formats
from jmp_policy import Float8Recipe, autocast
from jmp_policy import float8 as _fp8
from jmp_policy.float8 import _blocks

E2M1, E4M3, E5M2 = (np.dtype(d) for d in (jnp.float4_e2m1fn, jnp.float8_e4m3fn, jnp.float8_e5m2))
E8M0, F32, BF16 = np.dtype(jnp.float8_e8m0fnu), np.dtype(jnp.float32), np.dtype(jnp.bfloat16)
BLOCKS = ("mxfp8", "nvfp4")
# The numerics tests run as XLA:CPU compiles them and as XLA:GPU does
# (tests/support/excess_precision.py).
compilers = pytest.mark.parametrize("compile", list(COMPILERS.values()), ids=list(COMPILERS))


# The quantization in one program: eagerly, its ~60 operations compile apart.
quantize_blocks = jax.jit(_blocks.quantize_blocks, static_argnums=(1, 2))


def rng(*shape, seed=0, scale=1.0):
    return jax.random.normal(jax.random.key(seed), shape) * scale


def rel_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def with_gradients(f, *args, ct, compile=jax.jit):
    """``f(*args)`` and the gradients of its two first arguments for cotangent ``ct``,
    compiled with ``compile``."""
    def run(a, b, ct):
        out, vjp = jax.vjp(lambda a, b: f(a, b, *args), a, b)
        return (out, *vjp(ct.astype(out.dtype)))
    return compile(run)


def native_products(fn, *args):
    """The operand dtypes ``(lhs, rhs, lhs scales, rhs scales)`` of every native block-scaled
    product (``jax.nn.scaled_matmul``) of ``fn``'s jaxpr."""
    return [tuple(np.dtype(v.aval.dtype) for v in e.invars)
            for e in eqns(jax.make_jaxpr(fn)(*args)) if e.primitive.name == "scaled_matmul_wrapper"]


def casts_to(fn, *args):
    """The low-precision dtypes that ``fn``'s jaxpr converts values to, with their counts."""
    found = {}
    for e in eqns(jax.make_jaxpr(fn)(*args)):
        if e.primitive.name == "convert_element_type" and \
                np.dtype(e.params["new_dtype"]) in (E2M1, E4M3, E5M2):
            found[np.dtype(e.params["new_dtype"])] = found.get(np.dtype(e.params["new_dtype"]), 0) + 1
    return found


# --- recipes --------------------------------------------------------------------------------

def test_block_recipes_defaults_and_shortcuts():
    mx, nv = Float8Recipe("mxfp8"), Float8Recipe("nvfp4")
    assert (mx.fwd_dtype, mx.bwd_dtype, mx.block_size, mx.stochastic_rounding) == \
        (E4M3, E4M3, 32, False)
    assert (nv.fwd_dtype, nv.bwd_dtype, nv.block_size, nv.stochastic_rounding) == \
        (E2M1, E2M1, 16, True)
    # Defaults resolve when built: the same recipe however it is spelled, hashable.
    assert mx == Float8Recipe("mxfp8", fwd_dtype="float8_e4m3fn", bwd_dtype=jnp.float8_e4m3fn)
    assert len({mx, nv, Float8Recipe("mxfp8", bwd_dtype=jnp.float8_e5m2)}) == 3
    assert Float8Recipe("rowwise").bwd_dtype == E5M2 and Float8Recipe("rowwise").block_size is None
    assert _fp8.as_recipe("nvfp4") == nv
    f = autocast(jnp.matmul, "float32", fp8="nvfp4")
    assert casts_to(f, rng(32, 64), rng(64, 32)) == {E2M1: 2, E4M3: 2}  # values, block scales


@pytest.mark.parametrize("kwargs,error,match", [
    ({"scaling": "nvfp4", "fwd_dtype": jnp.float8_e4m3fn}, ValueError,
     "fwd_dtype must be jnp.float4_e2m1fn with scaling='nvfp4'"),
    ({"scaling": "mxfp8", "bwd_dtype": jnp.float8_e4m3fnuz}, ValueError,
     "bwd_dtype must be jnp.float8_e4m3fn or jnp.float8_e5m2 with scaling='mxfp8'"),
    ({"scaling": "rowwise", "fwd_dtype": jnp.float4_e2m1fn}, ValueError, "must be a float8 dtype"),
    ({"scaling": "mxfp8", "power_of_two_scales": True}, ValueError,
     "power_of_two_scales cannot apply to scaling='mxfp8'"),
    ({"scaling": "rowwise", "native": True}, ValueError, "native applies to the block scalings"),
    ({"scaling": "mxfp8", "native": 1}, TypeError, "native must be None, True or False"),
    ({"scaling": "nvfp4", "stochastic_rounding": "yes"}, TypeError,
     "stochastic_rounding must be True or False"),
    ({"scaling": "fp4"}, ValueError, "'mxfp8', 'nvfp4'"),
])
def test_block_recipes_reject_settings_that_cannot_apply(kwargs, error, match):
    with pytest.raises(error, match=match):
        Float8Recipe(**kwargs)


# --- quantization: hand-computed values, JAX's reference ---------------------------------------

def test_mxfp8_values_and_scales_by_hand():
    x = jnp.zeros((2, 32)).at[0, :4].set([1.0, 3.0, 448.0, 449.0]) \
        .at[1, :3].set([1.0, 0.3, -0.01])
    q = quantize_blocks(x, "mxfp8", jnp.float8_e4m3fn)
    # Row 0: 449 / 448 rounds up to the scale 2; 449 / 2 = 224.5 is 224 in e4m3 (spacing 16
    # from 128 to 256). Row 1: 1 / 448 rounds up to 2**-8; 0.3 * 256 = 76.8 is 80 (spacing 8),
    # -0.01 * 256 = -2.56 is -2.5 (spacing 0.25).
    assert q.scales.tolist() == [[2.0], [2.0 ** -8]]
    assert q.values.astype(F32)[:, :4].tolist() == [[0.5, 1.5, 224.0, 224.0],
                                                    [256.0, 80.0, -2.5, 0.0]]
    assert q.dequantized()[:, :4].tolist() == [[1.0, 3.0, 448.0, 448.0],
                                               [1.0, 0.3125, -0.009765625, 0.0]]


def test_nvfp4_values_block_and_tensor_scales_by_hand():
    # Tensor maximum 2688 = 6 * 448: the tensor scale is 1. Block 0's maximum is 6: block
    # scale 6 / 6 = 1, and e2m1 rounds to nearest even: 5 -> 4 (a tie), 4.9 -> 4,
    # 2.5 -> 2 (a tie), 1.2 -> 1, 0.26 -> 0.5, 0.24 -> 0, -3.5 -> -4 (a tie).
    block = [6.0, 5.0, 4.9, 2.5, 1.2, 0.26, 0.24, -3.5]
    x = jnp.zeros((1, 32)).at[0, :8].set(block).at[0, 16].set(2688.0).at[0, 17].set(1000.0)
    q = quantize_blocks(x, "nvfp4", jnp.float4_e2m1fn)
    assert float(q.tensor_scale) == 1.0 and q.scales.tolist() == [[1.0, 448.0]]
    assert q.values.astype(F32)[0, :8].tolist() == [6.0, 4.0, 4.0, 2.0, 1.0, 0.5, 0.0, -4.0]
    # Block 1: 1000 / 448 = 2.23 -> 2.
    assert q.values.astype(F32)[0, 16:18].tolist() == [6.0, 2.0]
    # Scaled by 1 / 2 (tensor 2688 -> 5376): the tensor scale takes it all, the rest is equal.
    half = quantize_blocks(x * 2, "nvfp4", jnp.float4_e2m1fn)
    assert float(half.tensor_scale) == 2.0 and (half.values == q.values).all()


def stochastic(y, dtype, seed):
    """``y`` rounded stochastically as the block quantization rounds it, with the seed words
    ``(seed, 7)``."""
    return formats.round_stochastic(y, dtype, formats.random_bits(jnp.stack([seed, 7]), y.shape))


def test_e2m1_and_stochastic_rounding_stay_on_the_grid_and_are_unbiased():
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    y = jnp.array([0.1, 0.3, 0.75, 1.3, 2.5, 3.1, 5.0, 5.9, -0.2, -4.5, 6.0, 0.0], F32)
    draws = jax.jit(jax.vmap(lambda s: stochastic(y, E2M1, s)))(
        jnp.arange(20000, dtype=jnp.uint32))
    lower = grid[np.searchsorted(grid, np.abs(y), side="right") - 1]
    upper = grid[np.minimum(np.searchsorted(grid, np.abs(y), side="left"), len(grid) - 1)]
    mags = np.abs(np.asarray(draws))
    assert ((mags == lower) | (mags == upper)).all()  # one of the two neighbours, every draw
    gap = np.maximum(upper - lower, 1e-9)
    # The mean is y to within 5 standard errors of a two-point draw.
    stderr = np.sqrt((np.abs(y) - lower) * (upper - np.abs(y))) / np.sqrt(len(draws))
    np.testing.assert_array_less(np.abs(np.asarray(draws.mean(0)) - y), 5 * stderr + 1e-7 * gap)
    # The same in float8_e5m2, across its subnormals (below 2**-14) and normals.
    z = jnp.array([1.1e-6, 3e-5, 0.3, 300.0, -7000.0], F32)
    d8 = jax.jit(jax.vmap(lambda s: stochastic(z, E5M2, s)))(
        jnp.arange(20000, 40000, dtype=jnp.uint32))
    assert (d8.astype(E5M2).astype(F32) == d8).all()
    gap = np.asarray(d8.max(0) - d8.min(0))  # the two neighbours drawn
    np.testing.assert_array_less(np.abs(np.asarray(d8.mean(0)) - z), 5 * gap / 2 / np.sqrt(len(d8)))


def test_quantization_is_jaxs_reference_bit_for_bit():
    reference = pytest.importorskip("jax._src.cudnn.scaled_matmul_stablehlo")
    # Heavy-tailed values; blocks of zeros aside (JAX's reference divides them by a scale
    # that XLA:CPU flushes to zero, giving NaN, where these give zeros).
    x = rng(2, 8, 128) * jnp.exp(3 * rng(2, 8, 128, seed=1))
    x = x.at[0, 0, :32].set(448.0)
    for scaling, dtype in (("mxfp8", E4M3), ("mxfp8", E5M2), ("nvfp4", E2M1)):
        q = quantize_blocks(x, scaling, dtype)
        config = jax.nn.get_scaled_dot_general_config(
            scaling, global_scale=q.tensor_scale if scaling == "nvfp4" else None)
        config.data_type = dtype
        values, scales = jax.jit(lambda x: reference.quantize(x, config))(x)  # one program
        ours, theirs = np.asarray(q.values.astype(F32)), np.asarray(values.astype(F32))
        # Where they differ, JAX's conversion rounded twice (XLA:CPU's older emitters, which
        # the suite runs, round to float4 through float16): ours is the one rounding of the
        # value scaled into the format, as ml_dtypes converts it.
        differ = ours != theirs
        assert differ.mean() < 0.01
        scaled = np.asarray(x, F32) / np.float32(q.tensor_scale) / np.repeat(
            np.asarray(q.scales), 16 if scaling == "nvfp4" else 32, axis=-1)
        np.testing.assert_array_equal(ours[differ], scaled[differ].astype(dtype).astype(F32))
        np.testing.assert_array_equal(np.asarray(scales.astype(F32)),
                                      np.asarray(q.scales.astype(_blocks.SCALE_DTYPES[scaling])
                                                 .astype(F32)))


@compilers
@pytest.mark.parametrize("scaling", BLOCKS)
def test_emulated_products_are_the_dequantized_products(scaling, compile):
    # K = 40: padded to whole blocks. Each product of two dequantized values is exact in
    # float32; float64 sums of them differ from float32 sums only by float32 rounding.
    x, w = rng(24, 40), rng(40, 16, seed=1)
    got = compile(autocast(jnp.matmul, "float32", fp8=scaling))(x, w)
    fmt = Float8Recipe(scaling).fwd_dtype
    # The reference's dequantization in one program (eagerly, ~70 operations compile apart).
    dequantized = jax.jit(_blocks.dequantized_along, static_argnums=(1, 2, 3))
    dx, sx = dequantized(x, 1, scaling, fmt)
    dw, sw = dequantized(w, 0, scaling, fmt)
    want = np.asarray(dx, np.float64) @ np.asarray(dw, np.float64) * float(sx) * float(sw)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert rel_error(got, x @ w) < (0.05 if scaling == "mxfp8" else 0.2)


# --- native or emulated --------------------------------------------------------------------

class _Device:
    def __init__(self, capability):
        self.compute_capability = capability


def test_native_product_is_chosen_from_the_backend_when_traced(monkeypatch):
    recipe = Float8Recipe("mxfp8")
    assert not _fp8.native_block_products(recipe)  # CPU: emulated
    assert not _fp8.native_block_products(Float8Recipe("rowwise"))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "local_devices", lambda: [_Device("10.0"), _Device("12.0")])
    assert _fp8.native_block_products(recipe)  # Blackwell
    x, w = rng(32, 64), rng(64, 32)
    assert native_products(autocast(jnp.matmul, "float32", fp8="mxfp8"), x, w) == \
        [(E4M3, E4M3, E8M0, E8M0)]
    assert not _fp8.native_block_products(dataclasses.replace(recipe, native=False))
    monkeypatch.setattr(jax, "local_devices", lambda: [_Device("9.0")])  # Hopper
    assert not _fp8.native_block_products(recipe)
    assert native_products(autocast(jnp.matmul, "float32", fp8="mxfp8"), x, w) == []


@pytest.mark.parametrize("scaling", BLOCKS)
def test_native_products_take_block_formats_forward_and_backward(scaling):
    recipe = Float8Recipe(scaling, native=True)
    x, w = rng(2, 16, 64), rng(64, 32)
    f = autocast(lambda x, w: jnp.tanh(x @ w), "mixed_bfloat16", fp8=recipe)
    grad = jax.grad(lambda x, w: jnp.sum(f(x, w).astype(F32)), (0, 1))
    value, scale = (E4M3, E8M0) if scaling == "mxfp8" else (E2M1, E4M3)
    assert native_products(f, x, w) == [(value, value, scale, scale)]
    # Forward, and the two backward products (the incoming gradient in bwd_dtype).
    assert native_products(grad, x, w) == [(value, value, scale, scale)] * 3
    # Emulated: no native product; the same operands quantized, then dequantized.
    emulated = autocast(lambda x, w: jnp.tanh(x @ w), "mixed_bfloat16", fp8=scaling)
    assert native_products(jax.grad(lambda x, w: jnp.sum(emulated(x, w).astype(F32)), (0, 1)),
                           x, w) == []
    assert casts_to(jax.grad(lambda x, w: jnp.sum(emulated(x, w).astype(F32)), (0, 1)), x, w) \
        == ({value: 6} if scaling == "mxfp8" else {value: 6, E4M3: 6})  # nvfp4: e4m3 scales


@compilers
@pytest.mark.parametrize("scaling", BLOCKS)
def test_native_and_emulated_paths_compute_the_same_bits(scaling, compile, monkeypatch):
    # No CPU runs the native product: stand in JAX's documented semantics of
    # jax.nn.scaled_matmul, so that what the native path feeds it (layouts, scales stored
    # as e8m0 / e4m3, the tensor scales) is checked against the emulation, bit for bit.
    def scaled_matmul(a, b, sa, sb, preferred_element_type):
        # The hardware reads the float8 (float4) values themselves: formats.widen, which
        # XLA:GPU's removal of a float round trip cannot skip.
        deq = lambda v, s: formats.widen(v) * jnp.repeat(formats.widen(s), v.shape[-1] // s.shape[-1], -1)  # noqa: E731
        return lax.dot_general(deq(a, sa), deq(b, sb), (((2,), (2,)), ((0,), (0,))),
                               precision=lax.Precision.HIGHEST, preferred_element_type=F32)

    x, w, ct = rng(3, 8, 48), rng(48, 32, seed=1), rng(3, 8, 32, seed=2)
    emulated = with_gradients(autocast(lambda x, w: x @ w, "float32", fp8=scaling), ct=ct,
                              compile=compile)
    want = emulated(x, w, ct)
    monkeypatch.setattr(jax.nn, "scaled_matmul", scaled_matmul)
    native = autocast(lambda x, w: x @ w, "float32", fp8=Float8Recipe(scaling, native=True))
    native = with_gradients(native, ct=ct, compile=compile)
    for got, expected in zip(native(x, w, ct), want):
        np.testing.assert_array_equal(got, expected)


# --- stochastic rounding through autocast ----------------------------------------------------

@compilers
@pytest.mark.parametrize("hadamard", [False, True])
def test_nvfp4_weight_gradients_are_unbiased_with_stochastic_rounding(compile, hadamard):
    # The weight gradient sums the incoming gradient over 2048 tokens (x is ones). Each
    # block of 16 tokens holds one 6 (its maximum) and fifteen 2.5s, which round to
    # nearest (even) to 2, biased low. Stochastically, to 2 or 3, half and half.
    # Rotated (hadamard), blocks of ones reach 4 times their maximum: the rotated
    # operands' own tensor scales keep that from saturating the block scales.
    x, w = jnp.ones((2048, 32)), rng(32, 16)
    ct = jnp.full((2048, 16), 2.5).at[::16].set(6.0)
    want = x.T @ ct
    errors = {}
    for sr in (True, False):
        recipe = Float8Recipe("nvfp4", stochastic_rounding=sr, hadamard=hadamard)
        f = autocast(jnp.matmul, "float32", fp8=recipe)
        _, grad_w = compile(lambda x, w, ct: jax.vjp(f, x, w)[1](ct))(x, w, ct)
        errors[sr] = rel_error(grad_w, want)
    assert errors[True] < 0.02, errors
    if not hadamard:
        assert errors[False] > 0.15, errors


@compilers
def test_stochastic_rounding_of_float8_gradients_is_an_option(compile):
    x, w, ct = rng(64, 64), rng(64, 32, seed=1), rng(64, 32, seed=2)
    recipe = Float8Recipe("rowwise", stochastic_rounding=True)
    nearest = with_gradients(autocast(jnp.matmul, "float32", fp8="rowwise"), ct=ct,
                             compile=compile)(x, w, ct)
    got = with_gradients(autocast(jnp.matmul, "float32", fp8=recipe), ct=ct,
                         compile=compile)(x, w, ct)
    np.testing.assert_array_equal(got[0], nearest[0])  # the forward is untouched
    assert not np.array_equal(got[1], nearest[1])
    want = jax.vjp(jnp.matmul, x, w)[1](ct)
    assert all(rel_error(g, v) < 0.12 for g, v in zip(got[1:], want))
    # Reproducible: the random bits come from the gradient's values.
    again = with_gradients(autocast(jnp.matmul, "float32", fp8=recipe), ct=ct,
                           compile=compile)(x, w, ct)
    np.testing.assert_array_equal(again[1], got[1])


# --- mixture of experts ------------------------------------------------------------------------

SIZES = (40, 0, 56, 24)  # not multiples of the blocks: blocks of rows restart per expert


def moe_operands():
    rows = np.repeat(np.arange(4), SIZES)
    x = rng(120, 64) * jnp.asarray([1.0, 1.0, 1e-4, 3e3])[rows, None]
    w = rng(4, 64, 32, seed=1) * 64 ** -0.5 * jnp.asarray([1.0, 1.0, 1e3, 1e-3])[:, None, None]
    ct = rng(120, 32, seed=2) * jnp.asarray([1e3, 1.0, 1.0, 1e-4])[rows, None]
    return x, w, ct, jnp.asarray(SIZES, jnp.int32)


@compilers
@pytest.mark.parametrize("scaling", BLOCKS)
def test_ragged_products_scale_each_experts_blocks_apart(scaling, compile):
    # Magnitudes differ by up to 1e7 between experts: a block mixing two experts' rows
    # would flush the smaller one; each expert's errors are those of float8 (e2m1) alone.
    x, w, ct, sizes = moe_operands()
    want = with_gradients(lax.ragged_dot, sizes, ct=ct)(x, w, ct)
    got = with_gradients(autocast(lax.ragged_dot, "float32", fp8=scaling), sizes, ct=ct,
                         compile=compile)(x, w, ct)
    bound = {"mxfp8": 0.06, "nvfp4": 0.3}[scaling]
    ends = np.cumsum(SIZES)
    for e, (size, end) in enumerate(zip(SIZES, ends)):
        if not size:
            assert not np.asarray(got[2][e]).any()  # an empty expert: a zero gradient
            continue
        rows = slice(end - size, end)
        errors = (rel_error(got[0][rows], want[0][rows]), rel_error(got[1][rows], want[1][rows]),
                  rel_error(got[2][e], want[2][e]))
        assert max(errors) < bound, (e, errors)


def test_ragged_products_take_block_formats_forward_and_backward():
    x, w, _, sizes = moe_operands()
    f = autocast(lax.ragged_dot, "mixed_bfloat16", fp8="mxfp8")
    grad = jax.grad(lambda x, w: jnp.sum(f(x, w, sizes).astype(F32)), (0, 1))
    assert casts_to(lambda x, w: f(x, w, sizes), x, w) == {E4M3: 2}
    assert casts_to(grad, x, w) == {E4M3: 6}  # two per product, three products
    ragged = [e for e in eqns(jax.make_jaxpr(grad)(x, w)) if e.primitive.name == "ragged_dot_general"]
    highest = (lax.Precision.HIGHEST,) * 2  # exact float32 products: no TF32 on a GPU
    assert len(ragged) == 3 and all(np.dtype(e.invars[0].aval.dtype) == F32 and
                                    e.params["precision"] == highest for e in ragged)
    grads = jax.jit(grad)(x, w)
    assert grads[0].dtype == F32 and grads[1].dtype == F32


# --- non-finite values --------------------------------------------------------------------

@compilers
@pytest.mark.parametrize("scaling", [*BLOCKS, "nvfp4/6"])  # nvfp4/6: Four Over Six
def test_non_finite_operands_give_non_finite_products_and_zeros_finite_ones(scaling, compile):
    x, w = rng(32, 64), rng(64, 16, seed=1)
    recipe = Float8Recipe("nvfp4", four_over_six=True) if scaling == "nvfp4/6" else scaling
    f = autocast(jnp.matmul, "mixed_bfloat16", fp8=recipe)
    # The gradient of the autocast function itself: test support's stand-in for XLA:GPU
    # inlines custom derivatives, so its compiled f would differentiate the quantization.
    grads = compile(lambda x, w, ct: jax.vjp(f, x, w)[1](ct))
    product = compile(f)
    for bad in (np.inf, np.nan):
        assert not np.isfinite(product(x.at[3, 5].set(bad), w)[3]).any()
        gx, gw = grads(x, w, jnp.ones((32, 16), BF16).at[0, 0].set(bad))
        assert not np.isfinite(gx[0]).all() and not np.isfinite(gw[:, 0]).all()
    zeros = product(jnp.zeros_like(x), w)
    assert (zeros == 0).all()
    gx, gw = grads(x.at[:8].set(0), w, jnp.zeros((32, 16), BF16))
    assert (gx == 0).all() and (gw == 0).all()


# --- composition ----------------------------------------------------------------------------

@pytest.mark.parametrize("scaling", BLOCKS)
def test_jit_grad_vmap_scan_remat_and_shard_map(scaling):
    ws, x = rng(2, 32, 32, scale=32 ** -0.5), rng(4, 32, 32, seed=1)

    def stack(ws, x):
        @jax.checkpoint
        def layer(h, w):
            return jnp.tanh(h @ w), None
        return lax.scan(layer, x, ws)[0]

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    spec = jax.sharding.PartitionSpec("d")
    sharded = jax.shard_map(stack, mesh=mesh, in_specs=(None, spec), out_specs=spec)
    value = Float8Recipe(scaling).fwd_dtype
    bound = 0.08 if scaling == "mxfp8" else 0.3
    for fn in (stack, sharded):
        f = jax.vmap(autocast(fn, "float32", fp8=scaling), in_axes=(None, 0))
        loss = lambda ws, x: jnp.sum(f(ws, x) ** 2)  # noqa: E731
        # Per layer: 2 forward, 4 backward (and the forward again, rematerialized).
        assert casts_to(jax.grad(loss), ws, x)[value] == 8
        # The float32 reference's values and gradient in one program (eagerly, each of
        # their operations compiled apart: 36 programs for the two functions).
        reference = jax.vmap(fn, in_axes=(None, 0))
        want_value, want = jax.jit(lambda ws, x: (
            reference(ws, x), jax.grad(lambda ws, x: jnp.sum(reference(ws, x) ** 2))(ws, x)))(ws, x)
        assert rel_error(jax.jit(f)(ws, x), want_value) < bound
        assert rel_error(jax.jit(jax.grad(loss))(ws, x), want) < 2 * bound


@pytest.mark.slow  # a system test: linen, NNX and Equinox models
def test_linen_nnx_and_equinox_models():
    nn = pytest.importorskip("flax.linen")
    nnx = pytest.importorskip("flax.nnx")
    eqx = pytest.importorskip("equinox")
    x = rng(16, 64)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, name="head")(jax.nn.gelu(nn.Dense(64)(x)))

    variables = jax.jit(Model().init)(jax.random.key(0), x)  # eagerly, 24 programs
    f = autocast(Model().apply, "mixed_bfloat16", fp8="mxfp8")
    # The hidden layer's product, both ways; the head is excluded.
    assert casts_to(jax.grad(lambda v: jnp.sum(f(v, x).astype(F32))), variables) == {E4M3: 6}
    # The values under jit: eagerly, each operation of the block-scaled product (and of
    # the float32 reference) would compile apart.
    assert rel_error(jax.jit(f)(variables, x), jax.jit(Model().apply)(variables, x)) < 0.05

    layer = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
    g = autocast(lambda m, x: m(x), "mixed_bfloat16", fp8="nvfp4")
    assert casts_to(g, layer, x) == {E2M1: 2, E4M3: 2}
    assert rel_error(jax.jit(g)(layer, x), x @ layer.kernel[...] + layer.bias[...]) < 0.2

    linear = eqx.nn.Linear(64, 32, key=jax.random.key(1))
    h = autocast(lambda m, x: jax.vmap(m)(x), "mixed_bfloat16", fp8="mxfp8")
    assert casts_to(jax.grad(lambda m: jnp.sum(h(m, x).astype(F32))), linear) == {E4M3: 6}
    assert rel_error(jax.jit(h)(linear, x), jax.jit(jax.vmap(linear))(x)) < 0.05


# --- the numerics inspector ------------------------------------------------------------------

@pytest.mark.parametrize("on_a_gpu", [False, True], ids=list(COMPILERS))
def test_inspector_reports_block_products_with_saturated_and_flushed_values(
        on_a_gpu, tmp_path, monkeypatch):
    if on_a_gpu:  # the inspector's program as XLA:GPU compiles it (support/excess_precision.py)
        inspect_as_on_a_gpu(monkeypatch)
    # NVFP4, x: the tensor scale is 1 (2688 = 6 * 448); in the second block 0.0174 / 6 =
    # 0.0029 is 1.48 of e4m3's smallest subnormal, 2**-9: the scale 2**-9 takes 0.0174 to
    # 8.9, beyond 7 (where rounding stops giving e2m1's largest value, 6): saturated to 6;
    # 0.0002 * 2**9 = 0.1 is below 0.25 (half e2m1's smallest subnormal): flushed.
    # w (ones) is exact.
    x = jnp.zeros((16, 32)).at[0, 0].set(2688.0).at[1, 16].set(0.0174).at[1, 17].set(0.0002)
    w = jnp.ones((32, 16))
    report = jmp_policy.inspect_numerics(jnp.matmul, "float32", fp8="nvfp4")(x, w)
    (row,) = [r for r in report.rows if r.primitive == "dot_general"]
    assert (row.dtype, row.fp8_saturated, row.fp8_flushed) == ("float4_e2m1fn", 1, 1)
    # The scales' ranges: rows of their own. Per tensor: x's 2688 / 2688 and w's 1 / 2688;
    # x's block scales run from 448 down to the subnormal 2**-9 (its zero blocks' 0 aside),
    # w's are all 448.
    tensor = sorted(r.max_abs for r in report.rows if r.scope == "tensor_scales")
    assert tensor == [float(np.float32(1) / np.float32(2688)), 1.0]
    blocks = sorted((r.max_abs, r.float32_min) for r in report.rows if r.scope == "block_scales")
    assert blocks == [(448.0, 2.0 ** -9), (448.0, 448.0)]
    # MXFP8, x: 1e-4 is below 2**-10 (half e4m3's smallest subnormal) in a block whose
    # maximum is 448: flushed. Its scales round up: nothing saturates.
    x = jnp.zeros((16, 32)).at[0, 0].set(448.0).at[0, 1].set(1e-4).at[1, 0].set(3.0)
    report = jmp_policy.inspect_numerics(jnp.matmul, "float32", fp8="mxfp8")(x, w)
    (row,) = [r for r in report.rows if r.primitive == "dot_general"]
    assert (row.dtype, row.fp8_saturated, row.fp8_flushed) == ("float8_e4m3fn", 0, 1)
    pytest.importorskip("matplotlib")
    from jmp_policy.inspector import _plot as _numerics_plot
    assert "float4_e2m1fn" in _numerics_plot.FORMATS  # drawn next to the float8 formats
    report.plot(str(tmp_path / "ranges.png"))
    assert (tmp_path / "ranges.png").stat().st_size > 0


# --- the example's mixture of experts ------------------------------------------------------

@pytest.mark.slow  # a system test: examples/transformer_lm.py
def test_example_lm_mixture_of_experts_runs_its_experts_in_float8(monkeypatch):
    import importlib.util
    import sys
    spec = importlib.util.spec_from_file_location("transformer_lm_moe", "examples/transformer_lm.py")
    lm = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, lm)
    spec.loader.exec_module(lm)
    config = lm.Config(d_model=32, heads=1, layers=1, seq_len=16, batch_size=2, experts=4)
    tokens = jax.ShapeDtypeStruct((2, 17), jnp.int32)
    init, train_step, _ = lm.make_train_step("mixed_bfloat16", config, fp8="rowwise")
    params, opt_state = jax.eval_shape(init, 0)
    assert params["Block_0"]["MixtureOfExperts_0"]["w1"].shape == (4, 32, 128)
    ragged = [e for e in eqns(jax.make_jaxpr(train_step)(params, opt_state, tokens))
              if e.primitive.name == "ragged_dot_general"]
    # Two expert products, forward and both gradients: six, all on float8 operands.
    assert len(ragged) == 6
    assert all({np.dtype(v.aval.dtype) for v in e.invars[:2]} <= {E4M3, E5M2} for e in ragged)
