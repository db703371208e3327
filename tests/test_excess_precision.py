"""The XLA:GPU emulation itself (tests/support/excess_precision.py): each rewrite it makes, and each
it must not make, against values computed by hand."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from support.excess_precision import computed_in, with_excess_precision

F8, F16, BF16, F32 = jnp.float8_e4m3fn, jnp.float16, jnp.bfloat16, jnp.float32

# Values no narrow format holds: every rounding shows.
X = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32) * 3 + np.float32(1 / 3)


def gpu(fn, *args):
    return jax.jit(with_excess_precision(fn))(*args)


def rounded(x, dtype):
    """``x`` rounded to ``dtype`` (ml_dtypes: no compiler involved), as float32."""
    return np.asarray(x, np.float32).astype(np.dtype(dtype)).astype(np.float32)


def assert_same(got, want):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def round_trip_compiled(x, dtype):
    """What plain ``jit`` computes for ``x.astype(dtype).astype(float32)`` on this machine:
    XLA:CPU rounds (the emulation's reason to exist); on a GPU machine XLA:GPU removes the
    round trip, which the tests then check the emulation against."""
    return x if jax.default_backend() == "gpu" else rounded(x, dtype)


# --- rule 1: chains of conversions ----------------------------------------------------------

@pytest.mark.parametrize("dtype", [F8, BF16, F16, jnp.float4_e2m1fn])
def test_a_round_trip_is_its_input(dtype):
    assert_same(gpu(lambda x: x.astype(dtype).astype(F32), X), X)
    assert_same(jax.jit(lambda x: x.astype(dtype).astype(F32))(X), round_trip_compiled(X, dtype))


def test_a_chain_rounds_to_its_last_dtype_only():
    assert_same(gpu(lambda x: x.astype(F8).astype(BF16), X), rounded(X, BF16))
    assert_same(gpu(lambda x: x.astype(BF16).astype(F8).astype(F32), X), X)
    # A conversion to the dtype a value has already is none: the chain goes on.
    assert_same(gpu(lambda x: x.astype(F8).astype(F8).astype(F32), X), X)
    # Integers are converted, not rounded away: int -> f32 -> bf16 is int -> bf16.
    assert_same(gpu(lambda x: x.astype(jnp.int32).astype(F32).astype(BF16), X),
                np.trunc(X).astype(BF16).astype(np.float32))


def test_other_uses_keep_the_narrow_value():
    def f(x):
        q = x.astype(F8)
        return q.astype(F32), q, lax.bitcast_convert_type(q, jnp.uint8), q < 1.0
    wide, q, bits, small = gpu(f, X)
    assert_same(wide, X)
    assert_same(q.astype(F32), rounded(X, F8))
    np.testing.assert_array_equal(bits, rounded(X, F8).astype(np.dtype(F8)).view(np.uint8))
    np.testing.assert_array_equal(small, rounded(X, F8) < 1)


def test_a_product_takes_the_narrow_operands():
    w = np.ones((6, 3), np.float32) / 3
    f = lambda x, w: jnp.dot(x.astype(F8), w.astype(F8), preferred_element_type=F32)  # noqa: E731
    assert_same(gpu(f, X, w), jax.jit(f)(X, w))
    assert not np.array_equal(gpu(f, X, w), X @ w)


# --- rule 2: layout operations --------------------------------------------------------------

SEEN_THROUGH = {
    "reshape": lambda a: a.reshape(3, 8),
    "transpose": lambda a: a.T,
    "broadcast_in_dim": lambda a: jnp.broadcast_to(a, (2, 4, 6)),
    "expand_dims": lambda a: lax.expand_dims(a, (1,)),
    "squeeze": lambda a: lax.squeeze(a[:, None], (1,)),
    "stack of one": lambda a: jnp.stack([a]),
    "several": lambda a: jnp.broadcast_to(a.T.reshape(2, 12), (5, 2, 12)),
}
KEPT = {
    "slice": lambda a: a[1:3, ::2],
    "rev": lambda a: lax.rev(a, (0,)),
    "concatenate": lambda a: jnp.concatenate([a, a]),
    "pad": lambda a: jnp.pad(a, 1),
    "dynamic_slice": lambda a: lax.dynamic_slice(a, (jnp.int32(1), jnp.int32(2)), (2, 3)),
    "gather": lambda a: a[jnp.array([2, 0])],
    "stack": lambda a: jnp.stack([a, a]),
}


@pytest.mark.parametrize("layout", list(SEEN_THROUGH.values()), ids=list(SEEN_THROUGH))
def test_conversions_move_across_reshapes_transposes_and_broadcasts(layout):
    assert_same(gpu(lambda x: layout(x.astype(F8)).astype(F32), X), layout(X))
    # Elementwise float32 operations after the widening change nothing.
    assert_same(gpu(lambda x: layout(x.astype(BF16)).astype(F32) * 3, X), layout(X) * 3)


@pytest.mark.parametrize("layout", list(KEPT.values()), ids=list(KEPT))
def test_slices_pads_concatenations_reversals_and_gathers_keep_the_rounding(layout):
    assert_same(gpu(lambda x: layout(x.astype(F8)).astype(F32), X), layout(rounded(X, F8)))


def test_layout_operations_on_the_narrow_value_keep_it_for_other_uses():
    def f(x):
        q = x.astype(F8).T
        return q.astype(F32), lax.bitcast_convert_type(q, jnp.uint8)
    wide, bits = gpu(f, X)
    assert_same(wide, X.T)
    np.testing.assert_array_equal(bits, rounded(X, F8).T.astype(np.dtype(F8)).view(np.uint8))


# --- rule 3: narrow arithmetic ---------------------------------------------------------------

def test_float8_arithmetic_is_float16_arithmetic():
    assert computed_in("mul", F8) == np.float16 and computed_in("reduce_max", F8) == np.float16
    assert computed_in("select_n", F8) is None and computed_in("lt", F8) is None
    assert_same(gpu(lambda x: (-x.astype(F8)).astype(F32), X), -rounded(X, F16))
    two = jnp.asarray(2, F8)
    assert_same(gpu(lambda x: (x.astype(F8) * x.astype(F8) + two).astype(F32), X),
                (rounded(X, F16) * rounded(X, F16)).astype(np.float16) + np.float16(2))
    # The narrow result, where something else reads it, is the float16 one rounded.
    q = gpu(lambda x: jnp.abs(x.astype(F8)), X)
    assert q.dtype == F8 and np.array_equal(q.astype(F32), rounded(np.abs(rounded(X, F16)), F8))
    assert_same(gpu(lambda x: jnp.max(x.astype(F8), axis=1).astype(F32), X),
                rounded(X, F16).max(axis=1))


def test_bfloat16_operations_xla_computes_in_float32():
    got = gpu(lambda x: jnp.tanh(x.astype(BF16)).astype(F32), X)
    np.testing.assert_allclose(got, np.tanh(X), rtol=1e-6)  # float32's tanh, not rounded
    assert not np.array_equal(got, rounded(got, BF16))
    y = X[::-1] + 1
    assert_same(gpu(lambda x, y: (x.astype(BF16) / y.astype(BF16)).astype(F32), X, y),
                jax.jit(lax.div)(X, y))
    # Native ones round as written.
    f = lambda x: (x.astype(BF16) * x.astype(BF16)).astype(F32)  # noqa: E731
    assert_same(gpu(f, X), rounded(rounded(X, BF16) * rounded(X, BF16), BF16))


def test_float32_operations_are_kept():
    f = lambda x: lax.reduce_precision(x, 4, 3).astype(BF16).astype(F32)  # noqa: E731
    assert_same(gpu(f, X), rounded(X, F8))
    g = lambda x: lax.round(x * 4).astype(F16).astype(F32) / 4  # noqa: E731
    assert_same(gpu(g, X), jax.jit(g)(X))


# --- nested jaxprs ----------------------------------------------------------------------------

@jax.custom_jvp
def _custom_jvp(x):
    return x.astype(F8).astype(F32)


_custom_jvp.defjvp(lambda primals, tangents: (_custom_jvp(*primals), tangents[0]))


@jax.custom_vjp
def _custom_vjp(x):
    return x.astype(F8).astype(F32)


_custom_vjp.defvjp(lambda x: (_custom_vjp(x), None), lambda _, g: (g,))

ROUND_TRIP = lambda x: x.astype(F8).reshape(-1).astype(F32).reshape(x.shape)  # noqa: E731
NESTED = {
    "jit": jax.jit(ROUND_TRIP),
    "custom_jvp": _custom_jvp,
    "custom_vjp": _custom_vjp,
    "remat": jax.checkpoint(ROUND_TRIP),
    "scan": lambda x: lax.scan(lambda c, r: (c, ROUND_TRIP(r)), 0.0, x)[1],
    "while": lambda x: lax.fori_loop(0, 2, lambda i, y: ROUND_TRIP(y), x),
    "cond": lambda x: lax.cond(x[0, 0] > -100, ROUND_TRIP, lambda y: y * 0, x),
    "narrowed outside, widened inside a call":
        lambda x: jax.jit(lambda q: q.astype(F32))(x.astype(F8)),
}


@pytest.mark.parametrize("nested", list(NESTED.values()), ids=list(NESTED))
def test_nested_jaxprs_are_rewritten(nested):
    assert_same(jax.jit(nested)(X), round_trip_compiled(X, F8))
    assert_same(gpu(nested, X), X)


def test_gradients_are_rewritten():
    grad = jax.grad(lambda x: jnp.sum(x.astype(BF16).astype(F32) ** 2))
    assert_same(gpu(grad, X), 2 * X)
