"""Rematerialization under autocast: ``jax.checkpoint`` policies see autocast's products
as the matrix products they are.

Under each policy and each recipe, a function differentiated through
``jax.checkpoint`` saves the residuals plain JAX saves for the same function written
in the compute dtype (the same shapes and dtypes, from the same kind of equation: a
half-precision product is saved in half precision), and its backward pass
recomputes as many matrix products as plain JAX's does. A quantized product's
``dot_general`` gives bfloat16 before its scales (if any are left) are applied, which
the dot policies save; its float8 operands are saved by name (`QUANTIZED_LHS`,
`QUANTIZED_RHS`).
"""

import contextlib
import functools
import io
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from support.jaxpr_walk import checkpointed_backward, is_product, products_before
from jax.ad_checkpoint import checkpoint_name, print_saved_residuals

import jmp_policy
from support.jaxpr_walk import eqns, scoped_eqns
from jmp_policy import Float8Recipe, autocast

cp = jax.checkpoint_policies
PRODUCTS = {"dot_general", "ragged_dot_general", "conv_general_dilated", "scaled_matmul_wrapper"}

POLICIES = {
    "dots_saveable": cp.dots_saveable,
    "dots_with_no_batch_dims_saveable": cp.dots_with_no_batch_dims_saveable,
    "save_only_these_names": cp.save_only_these_names("proj"),
    "offload_dot_with_no_batch_dims": cp.offload_dot_with_no_batch_dims("device", "pinned_host"),
    "nothing_saveable": cp.nothing_saveable,
}
HALF = ("mixed_bfloat16", "mixed_float16")
FLOAT8 = ("tensorwise", "rowwise")
BLOCKS = ("mxfp8", "nvfp4")


def recipe_of(name):
    """``autocast``'s arguments for a recipe name: a policy, or a float8 scaling."""
    if name in HALF:
        return {"policy": name}
    return {"policy": "mixed_bfloat16",
            "fp8": Float8Recipe(name, exclude=(), **({"native": False} if name in BLOCKS else {}))}


def residuals(fn, *args):
    """What ``jax.checkpoint``-ed ``fn`` saves for its backward pass, as
    ``print_saved_residuals`` writes it, without the source lines: sorted."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(fn, *args)
    return sorted(re.sub(r" from (?!the argument).*$", "", line)
                  for line in out.getvalue().splitlines())


def products(fn, *args):
    """The number of matrix products in ``fn``'s jaxpr."""
    return sum(e.primitive.name in PRODUCTS for e in eqns(jax.make_jaxpr(fn)(*args)))


def recomputed(fn, policy, *args):
    """How many matrix products ``jax.jit(jax.grad(jax.checkpoint(fn)))`` computes on top
    of ``jax.jit(jax.grad(fn))``: the forward products its backward pass recomputes."""
    grad = lambda f: jax.jit(jax.grad(f, argnums=tuple(range(len(args)))))
    return products(grad(jax.checkpoint(fn, policy=policy)), *args) - products(grad(fn), *args)


def layer(w, x):
    """A named product without batch dimensions, then a batched one (attention's scores)."""
    h = jnp.tanh(checkpoint_name(x @ w, "proj"))
    h = h.reshape(4, 16, 64)
    return jnp.sum(jnp.tanh(jnp.einsum("bqd,bkd->bqk", h, h)))


def args(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return jax.random.normal(k1, (64, 64)) / 8, jax.random.normal(k2, (64, 64))


def in_compute_dtype(fn, recipe):
    """``fn`` written by hand in the recipe's compute dtype: its floating arguments cast."""
    half = jnp.float16 if recipe == "mixed_float16" else jnp.bfloat16

    @functools.wraps(fn)  # the same argument names, in print_saved_residuals
    def cast(*xs):
        return fn(*(x.astype(half) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in xs))
    return cast


def check_as_plain_jax(fn, reference, policy, *xs):
    want_saved = residuals(jax.checkpoint(reference, policy=policy), *xs)
    got_saved = residuals(jax.checkpoint(fn, policy=policy), *xs)
    assert got_saved == want_saved
    assert recomputed(fn, policy, *xs) == recomputed(reference, policy, *xs)


@pytest.mark.parametrize("recipe", [*HALF, *FLOAT8, *BLOCKS])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("inside", [False, True], ids=["checkpoint_of_autocast",
                                                        "autocast_of_checkpoint"])
def test_policies_save_and_recompute_what_they_do_in_plain_jax(recipe, policy, inside):
    kw = recipe_of(recipe)
    f = (autocast(jax.checkpoint(layer, policy=POLICIES[policy]), **kw) if inside
         else autocast(layer, **kw))
    ref = in_compute_dtype(layer, recipe)
    ref = jax.checkpoint(ref, policy=POLICIES[policy]) if inside else ref
    check_as_plain_jax(f, ref, POLICIES[policy], *args())


def attention_then_mlp(w2, x, wo):
    """An attention-like batched product under a projection (``wo``), then an MLP (``w2``)."""
    h = x @ wo
    o = jnp.einsum("bqk,bkd->bqd", jnp.einsum("bqd,bkd->bqk", h, h), h)
    return jnp.sum(jnp.tanh(jnp.tanh(x + o @ wo) @ w2))


@pytest.mark.parametrize("fp8", FLOAT8)
def test_a_float8_products_saved_output_is_rescaled_without_recomputing_its_operand(fp8):
    # The MLP reads x + o @ wo, saved by the policy: rescaling it must not recompute the
    # attention it comes from (a float8 product's scales are kept with its output).
    f = autocast(jax.checkpoint(attention_then_mlp, policy=cp.dots_with_no_batch_dims_saveable),
                 "mixed_bfloat16", fp8=fp8)
    x = jax.random.normal(jax.random.key(0), (4, 16, 32))
    w2, wo = jax.random.normal(jax.random.key(1), (32, 24)), jnp.eye(32)
    body = checkpointed_backward(jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(w2, x, wo))
    (w2_gradient,) = [e for e in body.eqns if is_product(e, batched=False)
                      and sorted(e.outvars[0].aval.shape) == [24, 32]]
    assert products_before(body, w2_gradient, batched=True) == 0


@pytest.mark.parametrize("recipe", HALF)
def test_saved_products_are_in_the_compute_dtype(recipe):
    # Half the memory of float32 products: what plain JAX saves in half precision.
    f = autocast(layer, recipe)
    half = np.dtype(jnp.bfloat16 if recipe == "mixed_bfloat16" else jnp.float16)
    saved = residuals(jax.checkpoint(f, policy=cp.dots_saveable), *args())
    short = "bf16" if recipe == "mixed_bfloat16" else "f16"
    assert [line for line in saved if "output of dot_general" in line] == \
        [f"{short}[4,16,16] output of dot_general", f"{short}[64,64] output of dot_general"]
    # And the backward products run in the compute dtype.
    grad = jax.grad(jax.checkpoint(f, policy=cp.dots_saveable), argnums=(0, 1))
    dots = [e for e in eqns(jax.make_jaxpr(grad)(*args())) if e.primitive.name == "dot_general"]
    assert len(dots) == 6  # two forward, two backward per product
    assert all(v.aval.dtype == half for e in dots for v in (*e.invars, *e.outvars))


@pytest.mark.parametrize("recipe", HALF)
def test_convolutions_are_saved_as_in_plain_jax(recipe):
    def conv(w, x):
        y = lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.sum(jnp.tanh(y))

    w = jax.random.normal(jax.random.key(1), (3, 3, 8, 16)) / 8
    x = jax.random.normal(jax.random.key(2), (2, 8, 8, 8))
    check_as_plain_jax(autocast(conv, recipe), in_compute_dtype(conv, recipe), cp.dots_saveable,
                       w, x)


@pytest.mark.parametrize("recipe", (*HALF, *FLOAT8, *BLOCKS))
def test_ragged_products_as_in_plain_jax(recipe):
    # No policy of JAX's saves a ragged_dot_general: plain JAX recomputes it, and so does autocast.
    sizes = jnp.array([20, 30, 14], jnp.int32)

    def moe(w, x):
        return jnp.sum(jnp.tanh(lax.ragged_dot(x, w, sizes)))

    w = jax.random.normal(jax.random.key(1), (3, 64, 64)) / 8
    x = jax.random.normal(jax.random.key(2), (64, 64))
    check_as_plain_jax(autocast(moe, **recipe_of(recipe)), moe, cp.dots_saveable, w, x)


@pytest.mark.parametrize("recipe", FLOAT8)
def test_float8_operands_kept_for_the_backward_pass_are_named(recipe):
    policy = cp.save_only_these_names("autocast_quantized_lhs", "autocast_quantized_rhs")
    f = autocast(lambda w, x: jnp.sum(jnp.tanh(x @ w)), **recipe_of(recipe))
    saved = residuals(jax.checkpoint(f, policy=policy), *args())
    named = [line for line in saved if "named" in line]
    assert sorted(line.split()[0].split("[")[0] for line in named) == \
        ["f32", "f32", "f8_e4m3fn", "f8_e4m3fn"]  # values and scales of both operands


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(64)(x))


class _Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        block = nn.remat(_Block, policy=cp.dots_with_no_batch_dims_saveable)
        return jnp.sum(block()(block()(x)))


@pytest.mark.parametrize("recipe", HALF)
def test_linen_remat_saves_the_dense_products(recipe):
    model, x = _Model(), jax.random.normal(jax.random.key(0), (8, 32))
    params = model.init(jax.random.key(1), x)
    plain = jax.jit(jax.grad(model.apply))
    mixed = jax.jit(jax.grad(autocast(model.apply, recipe)))
    # Forward 2, backward 4 (both operands' gradients but the input's of the first
    # Dense), none recomputed.
    assert products(plain, params, x) == products(mixed, params, x) == 5


def test_recomputed_forward_products_are_forward_for_float8_and_the_inspector():
    # A jax.checkpoint recomputes forward products in the backward pass (JAX scopes them
    # transpose(...)/rematted_computation/...): they take the forward float8 formats on
    # both sides, and the inspector shows them as forward rows.
    def layer(w, x):
        with jax.named_scope("block"):
            return jnp.sum(jnp.tanh(x @ w) @ w)

    rematted = jax.checkpoint(layer, policy=cp.nothing_saveable)
    w = jax.random.normal(jax.random.key(0), (32, 32))
    x = jax.random.normal(jax.random.key(1), (16, 32))
    e4m3, e5m2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
    f = autocast(jax.grad(rematted), "mixed_bfloat16", fp8=Float8Recipe("tensorwise", exclude=()))
    formats = {}
    for scope, e in scoped_eqns(jax.make_jaxpr(f)(w, x)):
        if e.primitive.name == "dot_general":
            kind = ("recomputed" if "rematted_computation" in scope
                    else "backward" if "transpose(" in scope else "forward")
            formats.setdefault(kind, []).append(tuple(np.dtype(v.aval.dtype) for v in e.invars))
    assert formats == {"forward": [(e4m3, e4m3)] * 2, "recomputed": [(e4m3, e4m3)],
                       "backward": [(e5m2, e4m3)] * 3}

    def phases(fn):
        report = jmp_policy.inspect_numerics(fn, "mixed_float16", argnums=0)(w, x)
        return [r.phase for r in report if r.primitive == "dot_general"]

    assert phases(layer) == ["forward"] * 2 + ["backward"] * 3
    assert phases(rematted) == ["forward"] * 3 + ["backward"] * 3
