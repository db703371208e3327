"""`jmp_policy.dot_general`: autocast's product as a ``lax.dot_general`` for layers.

Its values and gradients are autocast's, bit for bit: for a plain product, for
einsum-like dimension numbers, under jit and vmap, and in Flax linen and NNX
models trained a few steps.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jmp_policy

RECIPES = [None, "tensorwise", "rowwise", "mxfp8", "nvfp4"]


def eager(recipes):
    """``recipes``, the block-scaled ones marked slow where the test differentiates eagerly:
    their backward passes compile some 300 operations one by one (tensorwise and rowwise
    keep the eager path in the quick tier)."""
    return [pytest.param(r, marks=pytest.mark.slow) if r in ("mxfp8", "nvfp4") else r
            for r in recipes]
DENSE = (((1,), (0,)), ((), ()))


@pytest.fixture(autouse=True)
def _errors_on_own_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error", jmp_policy.AutocastWarning)
        yield


def _operands(*shapes):
    keys = jax.random.split(jax.random.key(0), len(shapes))
    return [jax.random.normal(k, s) for k, s in zip(keys, shapes)]


def _same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def _check_against_autocast(dims, lhs, rhs, policy, fp8, eager_grads=True):
    dot = jmp_policy.dot_general(policy, fp8=fp8)
    out = dot(lhs, rhs, dims)  # eagerly: operation by operation
    assert out.dtype == jnp.dtype(jmp_policy.Policy(policy).compute_dtype)  # autocast's product
    product = jmp_policy.autocast(lambda a, b: lax.dot_general(a, b, dims), policy, fp8=fp8)
    _same(out.astype(jmp_policy.Policy(policy).output_dtype), product(lhs, rhs))
    c = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)

    def loss(a, b):
        return jnp.sum(dot(a, b, dims) * c)

    reference = jmp_policy.autocast(lambda a, b: jnp.sum(lax.dot_general(a, b, dims) * c),
                                    policy, fp8=fp8)
    if eager_grads:
        grads = jax.grad(loss, (0, 1))(lhs, rhs)
        assert [g.dtype for g in grads] == [jnp.float32, jnp.float32]
        _same(grads, jax.grad(reference, (0, 1))(lhs, rhs))
    value_and_grads = jax.jit(jax.value_and_grad(loss, (0, 1)))(lhs, rhs)
    assert [g.dtype for g in value_and_grads[1]] == [jnp.float32, jnp.float32]
    _same(value_and_grads, jax.jit(jax.value_and_grad(reference, (0, 1)))(lhs, rhs))


@pytest.mark.parametrize("fp8", eager(RECIPES))
def test_dense_product_is_autocasts(fp8):
    _check_against_autocast(DENSE, *_operands((32, 64), (64, 48)), "mixed_bfloat16", fp8)


@pytest.mark.parametrize("fp8", eager([None, "tensorwise", "rowwise", "mxfp8"]))
@pytest.mark.parametrize("dims, shapes", [
    ((((2,), (2,)), ((0,), (0,))), ((2, 32, 64), (2, 16, 64))),   # "bqd,bkd->bqk"
    ((((1, 2), (0, 1)), ((), ())), ((32, 4, 16), (4, 16, 32))),   # "mhd,hdn->mn"
])
def test_einsum_like_dimension_numbers_are_autocasts(fp8, dims, shapes):
    # The forward product eagerly and the value and gradients under jit, bit for bit.
    # Eager gradients are the dense test's: differentiated eagerly, every operation of a
    # block-scaled backward pass compiles apart (hundreds; most of this file's time), and
    # the dimension numbers are what this test varies.
    _check_against_autocast(dims, *_operands(*shapes), "mixed_float16", fp8, eager_grads=False)


def test_vmap_gives_each_example_its_scales_as_vmap_of_autocast():
    x, w = _operands((3, 32, 64), (64, 32))
    dot = jmp_policy.dot_general("mixed_bfloat16", fp8="tensorwise")
    product = jmp_policy.autocast(lambda a, b: a @ b,
                                  "params=float32,compute=bfloat16,output=float32",
                                  fp8="tensorwise")
    mapped = jax.vmap(lambda a: dot(a, w, DENSE))(x)
    _same(mapped.astype(jnp.float32), jax.vmap(lambda a: product(a, w))(x))
    # Example 1's result does not depend on the others' ranges: its own scales. (Compared
    # with the same batched program: a batch of other shapes compiles to other kernels.)
    others = x.at[0].multiply(1000.0).at[2].multiply(1e-3)
    _same(mapped[1], jax.vmap(lambda a: dot(a, w, DENSE))(others)[1])


def test_float32_policy_without_fp8_is_lax_dot_general():
    x, w = _operands((8, 16), (16, 4))
    dot = jmp_policy.dot_general("float32")
    _same(dot(x, w, DENSE, precision="highest"), lax.dot_general(x, w, DENSE, "highest"))
    half = dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), DENSE)
    assert half.dtype == jnp.bfloat16  # as autocast(fn, "float32") leaves it


def test_operand_dtypes_and_preferred_element_type():
    x, w = _operands((8, 16), (16, 4))
    dot = jmp_policy.dot_general("mixed_float16")
    jaxpr = str(jax.make_jaxpr(lambda a, b: dot(a, b, DENSE))(x.astype(jnp.bfloat16), w))
    assert "f16[8,16]" in jaxpr and "f16[16,4]" in jaxpr  # both operands in float16
    out = dot(x, w, DENSE)
    assert out.dtype == jnp.float16
    wide = dot(x, w, DENSE, preferred_element_type=jnp.float32)
    # The float32 accumulation of the float16 operands, as lax.dot_general gives it.
    x16, w16 = x.astype(jnp.float16), w.astype(jnp.float16)
    _same(wide, lax.dot_general(x16, w16, DENSE, preferred_element_type=jnp.float32))
    ints = jnp.arange(6, dtype=jnp.int8).reshape(2, 3)
    _same(dot(ints, ints.T, DENSE, preferred_element_type=jnp.int32),
          lax.dot_general(ints, ints.T, DENSE, preferred_element_type=jnp.int32))


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_preferred_element_type_float32_is_the_float32_accumulation_under_jit(policy):
    x, w = _operands((32, 256), (256, 32))
    dot = jmp_policy.dot_general(policy)
    half = jmp_policy.Policy(policy).compute_dtype
    wide = lambda a, b: dot(a, b, DENSE, preferred_element_type=jnp.float32)
    plain = lambda a, b: lax.dot_general(a.astype(half), b.astype(half), DENSE,
                                         preferred_element_type=jnp.float32)
    got = jax.jit(wide)(x, w)
    assert got.dtype == jnp.float32
    _same(got, jax.jit(plain)(x, w))
    _same(wide(x, w), plain(x, w))  # eagerly too
    assert not np.array_equal(got, got.astype(half).astype(jnp.float32))  # not rounded
    # Its derivative is JAX's own for that product; gradients in the operands' dtype.
    grads = jax.jit(jax.grad(lambda a, b: wide(a, b).sum(), argnums=(0, 1)))(x, w)
    want = jax.jit(jax.grad(lambda a, b: plain(a, b).sum(), argnums=(0, 1)))(x, w)
    for g, h in zip(grads, want):
        assert g.dtype == jnp.float32
        _same(g, h)


def test_as_einsums_dot_general():
    x, w = _operands((2, 32, 64), (64, 4, 16))
    dot = jmp_policy.dot_general("mixed_bfloat16", fp8="rowwise")
    out = jax.jit(lambda a, b: jnp.einsum("bld,dhk->blhk", a, b, _dot_general=dot))(x, w)
    reference = jmp_policy.autocast(lambda a, b: jnp.einsum("bld,dhk->blhk", a, b),
                                    "params=float32,compute=bfloat16,output=float32",
                                    fp8="rowwise")
    # Both jitted: XLA compiles the two programs alike (eagerly, einsum's own jit holds
    # the rescaling in one and not the other, and XLA may round it a unit apart).
    _same(out, jax.jit(reference)(x, w))


def test_precision_passes_to_half_precision_products_and_warns_on_float8_ones():
    x, w = _operands((32, 64), (64, 32))
    half = jmp_policy.dot_general("mixed_bfloat16")
    assert "HIGHEST" in str(jax.make_jaxpr(
        lambda a, b: half(a, b, DENSE, precision=lax.Precision.HIGHEST))(x, w))
    float8 = jmp_policy.dot_general("mixed_bfloat16", fp8="tensorwise")
    float8(x, w, DENSE, precision=lax.Precision.DEFAULT)  # no warning
    with pytest.warns(jmp_policy.AutocastWarning, match="precision=.*no effect on a float8"):
        float8(x, w, DENSE, precision="highest")


@pytest.mark.parametrize("recipe, scope, shapes, dims, reason", [
    (jmp_policy.Float8Recipe(), None, ((8, 64), (64, 32)), DENSE, "min_size=16"),
    (jmp_policy.Float8Recipe(), "lm_head", ((32, 64), (64, 32)), DENSE, "exclude"),
    (jmp_policy.Float8Recipe(batched=False), None, ((2, 32, 64), (2, 64, 32)),
     (((2,), (1,)), ((0,), (0,))), "batched=False"),
])
def test_products_the_recipe_leaves_alone_run_as_autocast_runs_them_and_warn(
        recipe, scope, shapes, dims, reason):
    lhs, rhs = _operands(*shapes)
    dot = jmp_policy.dot_general("mixed_bfloat16", fp8=recipe)
    with pytest.warns(jmp_policy.AutocastWarning, match=f"runs in bfloat16, not float8.*{reason}"):
        with jax.named_scope(scope or "block"):
            out = dot(lhs, rhs, dims)
    _same(out, jmp_policy.dot_general("mixed_bfloat16")(lhs, rhs, dims))


def test_bad_arguments_are_clear_errors():
    x, w = _operands((8, 16), (16, 4))
    with pytest.raises(TypeError, match="builds a dot_general function"):
        jmp_policy.dot_general(x)
    with pytest.raises(ValueError, match="dot_general fp8 must be None, 'tensorwise'"):
        jmp_policy.dot_general("mixed_bfloat16", fp8="e4m3")
    with pytest.raises(TypeError, match="fp8 must be None"):
        jmp_policy.dot_general("mixed_bfloat16", fp8=8)
    with pytest.raises(ValueError, match="float17"):
        jmp_policy.dot_general("float17")
    with pytest.raises(ValueError, match=r"delayed-scaling.*float8_state"):
        jmp_policy.dot_general("mixed_bfloat16", fp8="delayed")
    with pytest.raises(TypeError):  # JAX's own message for mismatched contracting sizes
        jmp_policy.dot_general("mixed_bfloat16")(x, w, (((0,), (0,)), ((), ())))


def test_compares_by_policy_and_recipe():
    a = jmp_policy.dot_general("mixed_bfloat16", fp8="rowwise")
    b = jmp_policy.dot_general(jmp_policy.Policy("mixed_bfloat16"),
                               fp8=jmp_policy.Float8Recipe("rowwise"))
    assert a == b and hash(a) == hash(b) and a != jmp_policy.dot_general("mixed_bfloat16")
    assert repr(jmp_policy.dot_general("mixed_float16")) == \
        "jmp_policy.dot_general('mixed_float16')"
    with jmp_policy.policy_scope("mixed_float16"):
        assert jmp_policy.dot_general().policy == jmp_policy.Policy("mixed_float16")


# --- In Flax models: the same training as the autocast model ------------------------------

X, Y = _operands((16, 24), (16, 16))


def _sgd(params, grads):
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


@pytest.mark.parametrize("fp8", [None, "tensorwise"])
def test_linen_dense_trains_as_the_autocast_model(fp8):
    nn = pytest.importorskip("flax.linen")

    class MLP(nn.Module):
        dot: Any = None

        @nn.compact
        def __call__(self, x):
            h = jax.nn.relu(nn.Dense(32, dot_general=self.dot)(x))
            return nn.DenseGeneral(16, dot_general=self.dot)(h)

    def mse(model):
        return lambda p, x, y: jnp.mean((model.apply(p, x) - y) ** 2)

    def train(loss):
        step = jax.jit(jax.value_and_grad(loss))
        params, losses = MLP().init(jax.random.key(2), X), []
        for _ in range(3):
            value, grads = step(params, X, Y)
            params, losses = _sgd(params, grads), losses + [value]
        return losses, params

    dot = jmp_policy.dot_general("mixed_bfloat16", fp8=fp8)
    trained = train(mse(MLP(dot)))
    _same(trained, train(jmp_policy.autocast(mse(MLP()), "mixed_bfloat16", fp8=fp8)))
    assert trained[0][-1] < trained[0][0]


@pytest.mark.parametrize("fp8", [None, "rowwise"])
def test_nnx_linear_trains_as_the_autocast_model(fp8):
    nnx = pytest.importorskip("flax.nnx")

    class MLP(nnx.Module):
        def __init__(self, dot=lax.dot_general):
            rngs = nnx.Rngs(0)
            self.l1 = nnx.Linear(24, 32, dot_general=dot, rngs=rngs)
            self.l2 = nnx.Linear(32, 16, dot_general=dot, rngs=rngs)

        def __call__(self, x):
            return self.l2(jax.nn.relu(self.l1(x)))

    def mse(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    def train(model, loss):
        @nnx.jit
        def step(model, x, y):
            value, grads = nnx.value_and_grad(loss)(model, x, y)
            nnx.update(model, _sgd(nnx.state(model, nnx.Param), grads))
            return value

        losses = [step(model, X, Y) for _ in range(3)]
        return losses, nnx.state(model, nnx.Param)

    trained = train(MLP(jmp_policy.dot_general("mixed_bfloat16", fp8=fp8)), mse)
    _same(trained, train(MLP(), jmp_policy.autocast(mse, "mixed_bfloat16", fp8=fp8)))
    assert trained[0][-1] < trained[0][0]


@pytest.mark.slow  # a system test: a fresh child interpreter
def test_import_does_not_import_flax():
    import subprocess
    import sys
    code = "import sys, jmp_policy; jmp_policy.dot_general(); assert 'flax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
