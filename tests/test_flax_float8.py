"""Delayed float8 scaling as a Flax layer's ``dot_general``: the amax histories
held by the layer (linen: a collection; NNX: a variable), the product autocast's.

Each layer's values, gradients and observed maxima are those of
``autocast(dot_general, policy, fp8=Float8Recipe("delayed"))`` given the same histories,
step after step, and recording the observations moves the next step's scales.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jmp_policy

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
jf = pytest.importorskip("jmp_policy.flax")

DIMS = (((1,), (0,)), ((), ()))
RECIPE = jmp_policy.Float8Recipe("delayed", amax_history_length=4)
X = jax.random.normal(jax.random.key(0), (32, 64)) * jnp.arange(1, 33)[:, None] / 8
C = jnp.cos(jnp.arange(32 * 16, dtype=jnp.float32)).reshape(32, 16)


def reference(state, x, kernel):
    """The autocast product the layers must equal, its loss, gradients and observations."""
    f = jmp_policy.autocast(lambda a, b: lax.dot_general(a, b, DIMS), "mixed_bfloat16",
                            fp8=RECIPE)

    def loss(state, kernel):
        return jnp.sum(f(state, x, kernel).astype(jnp.float32) * C)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(state, kernel)


def assert_same(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))


def test_linen_dense_is_autocasts_delayed_product_step_after_step():
    layer = nn.Dense(16, use_bias=False,
                     dot_general_cls=lambda: jf.LinenFloat8DotGeneral(fp8=RECIPE))
    variables = layer.init(jax.random.key(1), X)
    params, histories = variables["params"], variables[jf.FLOAT8_HISTORIES]

    @jax.jit
    def step(params, histories):
        def loss(params, histories):
            y = layer.apply({"params": params, jf.FLOAT8_HISTORIES: histories}, X)
            assert y.dtype == jnp.bfloat16  # the compute dtype, as jmp_policy.dot_general
            return jnp.sum(y.astype(jnp.float32) * C)
        return jax.value_and_grad(loss, argnums=(0, 1))(params, histories)

    for _ in range(3):  # the histories fill: the scales change from step to step
        value, (grads, observed) = step(params, histories)
        (state,) = jax.tree.leaves(histories, is_leaf=lambda s: isinstance(
            s, jmp_policy.Float8State))
        want_value, (want_observed, want_grad) = reference(state, X, params["kernel"])
        assert_same((value, grads["kernel"]), (want_value, want_grad))
        assert_same(observed, {"LinenFloat8DotGeneral_0": {"state": want_observed}})
        histories = jf.record_float8_histories(histories, observed)
    lhs = histories["LinenFloat8DotGeneral_0"]["state"].histories[0].lhs
    np.testing.assert_allclose(lhs[:3], float(jnp.abs(X).max()))  # three steps recorded


def test_nnx_linear_is_autocasts_delayed_product_step_after_step():
    layer = nnx.Linear(64, 16, use_bias=False, rngs=nnx.Rngs(1),
                       dot_general=jf.NNXFloat8DotGeneral(fp8=RECIPE))
    diff = nnx.DiffState(0, (nnx.Param, jf.Float8Histories))

    @nnx.jit
    def step(layer):
        def loss(layer):
            return jnp.sum(layer(X).astype(jnp.float32) * C)
        value, grads = nnx.value_and_grad(loss, argnums=diff)(layer)
        histories = nnx.state(layer, jf.Float8Histories)
        observed = nnx.filter_state(grads, jf.Float8Histories)
        nnx.update(layer, jf.record_float8_histories(histories, observed))
        return value, grads, observed

    for _ in range(3):
        state = layer.dot_general.histories.get_value()
        want_value, (want_observed, want_grad) = reference(state, X, layer.kernel[...])
        value, grads, observed = step(layer)
        assert_same((value, grads["kernel"]), (want_value, want_grad))
        (seen,) = jax.tree.leaves(observed, is_leaf=lambda s: isinstance(
            s, jmp_policy.Float8State))
        assert_same(seen, want_observed)
    lhs = layer.dot_general.histories.get_value().histories[0].lhs
    np.testing.assert_allclose(lhs[:3], float(jnp.abs(X).max()))


def test_current_scaling_is_refused_with_the_stateless_way():
    with pytest.raises(ValueError, match=r"jmp_policy\.dot_general\(policy, fp8=\.\.\.\)"):
        jf.NNXFloat8DotGeneral(fp8="tensorwise")
    layer = nn.Dense(4, dot_general_cls=lambda: jf.LinenFloat8DotGeneral(fp8="rowwise"))
    with pytest.raises(ValueError, match="delayed float8 scaling"):
        layer.init(jax.random.key(0), jnp.ones((2, 64)))


def test_an_nnx_product_kept_out_of_float8_says_so():
    small = jmp_policy.Float8Recipe("delayed", min_size=128)  # above the layer's sizes
    layer = nnx.Linear(64, 16, rngs=nnx.Rngs(0), dot_general=jf.NNXFloat8DotGeneral(fp8=small))
    with pytest.warns(jmp_policy.AutocastWarning), \
            pytest.raises(ValueError, match="ran 0 float8 products"):
        layer(X)
