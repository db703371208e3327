"""Which derivatives go through autocast's float8 and block-scaled products.

A quantized product is a ``jax.custom_vjp`` (``_product.quantized_product``): first
derivatives in reverse mode only. Forward mode (``jax.jvp``, ``jax.jacfwd``,
``jax.linearize``'s linear function) and second derivatives (``jax.hessian``,
``jax.grad`` of ``jax.grad``, ``jax.jacrev(jax.jacrev(f))``) raise a ``TypeError``
naming the product and what to do instead (under an outer ``jit`` too), except where
the tangent arrives after autocast has run and JAX raises its own (``linearize``'s
linear function, ``jax.jvp`` of a ``jit``-ed autocast function). Second derivatives
would differentiate the quantization, which gives NaN or wrong values without a word.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jmp_policy import AutocastWarning, Float8Recipe, autocast

RECIPES = ["tensorwise", "rowwise", "mxfp8", "nvfp4"]

FORWARD = r"supports reverse-mode differentiation only(.|\n)*fp8=None"
SECOND = r"has first derivatives only(.|\n)*fp8=None"
JAX_OWN = r"can't apply forward-mode autodiff \(jvp\) to a custom_vjp function"

W = jax.random.normal(jax.random.key(0), (64, 32)) * 64 ** -0.5
X = jax.random.normal(jax.random.key(1), (32, 64))


def loss(fp8):
    f = autocast(lambda w, x: jnp.sum(jnp.tanh(x @ w)), "mixed_bfloat16", fp8=fp8)
    return lambda w: f(w, X)


FORWARD_MODE = {
    "jvp": lambda f: jax.jvp(f, (W,), (W,)),
    "jacfwd": lambda f: jax.jacfwd(f)(W),
    "jit(jacfwd)": lambda f: jax.jit(jax.jacfwd(f))(W),
    "jit(jvp)": lambda f: jax.jit(lambda w: jax.jvp(f, (w,), (w,)))(W),
}

SECOND_ORDER = {
    "hessian": lambda f: jax.hessian(f)(W),
    "jit(hessian)": lambda f: jax.jit(jax.hessian(f))(W),
    "jvp(grad)": lambda f: jax.jvp(jax.grad(f), (W,), (W,)),
    "jacrev(jacrev)": lambda f: jax.jacrev(jax.jacrev(f))(W),
    "grad(grad)": lambda f: jax.grad(lambda w: jnp.sum(jax.grad(f)(w) ** 2))(W),
}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("transform", FORWARD_MODE)
def test_forward_mode_raises_naming_the_product_and_what_to_do(recipe, transform):
    kind = "block-scaled" if recipe in ("mxfp8", "nvfp4") else "float8"
    with pytest.raises(TypeError, match=FORWARD) as info:
        FORWARD_MODE[transform](loss(recipe))
    message = str(info.value)
    assert f"autocast's {recipe} {kind} product (dot_general of float32[32, 64] and " \
        "float32[64, 32])" in message
    for advice in ("jax.grad", "jax.jacrev", "exclude=", "min_size"):
        assert advice in message


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("transform", SECOND_ORDER)
def test_second_derivatives_raise_instead_of_differentiating_the_quantization(
        recipe, transform):
    # Differentiating the quantization would give NaN (hessian) or values far off
    # (jacrev of jacrev), without a word.
    with pytest.raises(TypeError, match=SECOND):
        SECOND_ORDER[transform](loss(recipe))


@pytest.mark.parametrize("transform", ["jvp(jit)", "linearize"])
def test_a_tangent_that_arrives_after_autocast_gets_jaxs_own_type_error(transform):
    # JAX raises these when compiling (or evaluating linearize's linear function),
    # outside the product's call: its message, still a TypeError.
    f = loss("rowwise")
    run = {"jvp(jit)": lambda: jax.jvp(jax.jit(f), (W,), (W,)),
           "linearize": lambda: jax.linearize(f, W)[1](W)}[transform]
    with pytest.raises(TypeError, match=JAX_OWN):
        run()


def test_ragged_products_say_so_too():
    lhs = jax.random.normal(jax.random.key(2), (64, 32))
    rhs = jax.random.normal(jax.random.key(3), (2, 32, 48))
    sizes = jnp.array([40, 24], jnp.int32)
    f = autocast(lambda x, w: jnp.sum(jnp.tanh(lax.ragged_dot(x, w, sizes))),
                 "mixed_bfloat16", fp8="rowwise")
    with pytest.raises(TypeError, match=FORWARD):
        jax.jvp(lambda w: f(lhs, w), (rhs,), (rhs,))
    with pytest.raises(TypeError, match=SECOND):
        jax.grad(lambda w: jnp.sum(jax.grad(f, argnums=1)(lhs, w) ** 2))(rhs)


# The block-scaled recipes marked slow: differentiated eagerly, their backward passes
# compile some 100 operations one by one (tensorwise and rowwise run in the quick tier).
@pytest.mark.parametrize("recipe", [pytest.param(r, marks=pytest.mark.slow)
                                    if r in ("mxfp8", "nvfp4") else r for r in RECIPES])
def test_what_the_message_suggests_works(recipe):
    # Reverse mode: first derivatives, with jacrev too.
    g = jax.grad(loss(recipe))(W)
    np.testing.assert_array_equal(jax.jacrev(loss(recipe))(W), g)
    # Second derivatives with fp8=None, or with the product kept out of float8: the same.
    want = jax.hessian(loss(None))(W)
    excluded = Float8Recipe(recipe, min_size=65)  # above every dimension of the product
    with pytest.warns(AutocastWarning, match="changes nothing"):
        np.testing.assert_array_equal(jax.hessian(loss(excluded))(W), want)
    assert np.all(np.isfinite(want))


@pytest.mark.parametrize("direct", [True, False])
def test_reverse_mode_is_not_taken_for_forward_mode(direct):
    # With jax_use_direct_linearize off, jax.grad traces the product with JVP tracers
    # too (their tangents partial-evaluation tracers): a gradient, not an error.
    before = jax.config.jax_use_direct_linearize
    jax.config.update("jax_use_direct_linearize", direct)
    try:
        g = jax.jit(jax.grad(loss("tensorwise")))(W)
        g_vjp = jax.jit(lambda w: jax.vjp(loss("tensorwise"), w)[1](1.0)[0])(W)
    finally:
        jax.config.update("jax_use_direct_linearize", before)
    np.testing.assert_allclose(g_vjp, g, rtol=1e-5)
    assert np.all(np.isfinite(g)) and np.any(g != 0)
