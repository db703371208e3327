"""Delayed float8 scaling: Float8Recipe("delayed"), Float8State, float8_state, record."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy
from support.excess_precision import COMPILERS
from jmp_policy import Float8Recipe, Float8State, autocast, float8_state

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
compilers = pytest.mark.parametrize("compile", list(COMPILERS.values()), ids=list(COMPILERS))
DELAYED = Float8Recipe("delayed", amax_history_length=4)


def rng(*shape, seed=0, scale=1.0):
    return jax.random.normal(jax.random.key(seed), shape) * scale


def layers(n=3, d=64):
    return [rng(d, d, seed=i + 1, scale=d ** -0.5) for i in range(n)]


def mlp_loss(ws, x):
    h = x
    for i, w in enumerate(ws):
        with jax.named_scope(f"layer{i}"):
            h = jnp.tanh(h @ w)
    return jnp.mean(h.astype(jnp.float32) ** 2)


def scanned_loss(ws, x):
    def body(h, w):
        return jnp.tanh(h @ w), None
    h, _ = jax.lax.scan(body, x, ws)
    return jnp.mean(h.astype(jnp.float32) ** 2)


def train_step(f):
    """One step as a user writes it: gradients of params and state, the state recorded."""
    @jax.jit
    def step(state, ws, x):
        loss, (observed, grads) = jax.value_and_grad(f, argnums=(0, 1))(state, ws, x)
        return loss, grads, state.record(observed)
    return step


def product_amaxes(ws, x):
    """Per layer of `mlp_loss` in float32: max |input|, max |weight|, max |output cotangent|."""
    hs, h = [], x
    for w in ws:
        hs.append(h)
        h = jnp.tanh(h @ w)
    outs = [h_in @ w for h_in, w in zip(hs, ws)]

    def rest(i, out):  # the loss as a function of layer i's product
        h = jnp.tanh(out)
        for w in ws[i + 1:]:
            h = jnp.tanh(h @ w)
        return jnp.mean(h ** 2)

    cts = [jax.grad(rest, argnums=1)(i, out) for i, out in enumerate(outs)]
    return [tuple(float(jnp.max(jnp.abs(a))) for a in (h_in, w, ct))
            for h_in, w, ct in zip(hs, ws, cts)]


# --- the recipe ------------------------------------------------------------------------------

def test_recipe_defaults_follow_transformer_engine():
    recipe = Float8Recipe("delayed")
    assert (recipe.amax_history_length, recipe.amax_reduction) == (1024, "max")
    assert (recipe.fwd_dtype, recipe.bwd_dtype) == (jnp.float8_e4m3fn, jnp.float8_e5m2)
    assert recipe.delayed and not Float8Recipe("tensorwise").delayed


@pytest.mark.parametrize("kwargs, match", [
    (dict(scaling="delayed", amax_history_length=0), "amax_history_length must be a positive"),
    (dict(scaling="delayed", amax_reduction="mean"), "amax_reduction must be one of"),
    (dict(scaling="tensorwise", amax_history_length=16), "apply to scaling='delayed'"),
    (dict(scaling="rowwise", amax_reduction="most_recent"), "apply to scaling='delayed'"),
])
def test_recipe_rejects_settings_that_cannot_take_effect(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Float8Recipe(**kwargs)


# --- state and observations --------------------------------------------------------------------

def test_state_has_a_history_per_product_named_by_scope():
    f = autocast(mlp_loss, "mixed_bfloat16", fp8=DELAYED)
    state = float8_state(f, layers(), rng(32, 64))
    assert isinstance(state, Float8State)
    assert state.scopes == ("layer0", "layer1", "layer2")
    for history in state.histories:
        assert all(h.shape == (4,) and h.dtype == jnp.float32 and not h.any() for h in history)
    # Named as users wrote them, without JAX's transformations (a vmap inside fn).
    batched = autocast(lambda ws, x: jnp.sum(jax.vmap(mlp_loss, (None, 0))(ws, x)),
                       "mixed_bfloat16", fp8=DELAYED)
    assert float8_state(batched, layers(), rng(2, 32, 64)).scopes == state.scopes


def test_each_step_records_the_operand_and_gradient_maxima():
    ws, x = layers(), rng(32, 64, seed=7)
    f = autocast(mlp_loss, "mixed_bfloat16", fp8=DELAYED)
    step = train_step(f)
    state = float8_state(f, ws, x)
    _, _, state = step(state, ws, x)
    want = product_amaxes(ws, x)
    for history, (lhs, rhs, ct) in zip(state.histories, want):
        assert float(history.rhs[0]) == pytest.approx(rhs, rel=1e-6)  # a weight is exact
        assert float(history.lhs[0]) == pytest.approx(lhs, rel=0.02)  # bfloat16 inputs
        assert float(history.grad[0]) == pytest.approx(ct, rel=0.15)  # float8 backward
        assert not history.lhs[1:].any()
    # Later steps shift the history: the latest first.
    _, _, later = step(state, ws, x)
    for old, new in zip(state.histories, later.histories):
        np.testing.assert_array_equal(new.rhs[1:], old.rhs[:-1])


def test_scales_come_from_the_history_not_the_values():
    x, w = rng(32, 64, seed=3), rng(64, 32, seed=4)
    f = autocast(jnp.matmul, "float32", fp8=DELAYED)
    state = float8_state(f, x, w)
    cap = 0.25 * float(jnp.max(jnp.abs(x)))
    capped = jax.tree.map(lambda h: h, state)
    (history,) = capped.histories
    capped = Float8State((history._replace(lhs=history.lhs.at[1].set(cap),
                                           rhs=history.rhs.at[0].set(jnp.max(jnp.abs(w)))),),
                         capped.scopes)
    out = jax.jit(f)(capped, x, w)
    # Values above the history's maximum saturate at it (the e4m3 maximum, scaled).
    want = jnp.clip(x, -cap, cap) @ w
    assert float(jnp.linalg.norm(out - want) / jnp.linalg.norm(want)) < 0.05
    assert float(jnp.linalg.norm(out - x @ w) / jnp.linalg.norm(x @ w)) > 0.2
    # An empty history scales by 1: x's small values fall below e4m3's subnormals.
    tiny = x * 1e-5
    empty = jax.jit(f)(state, tiny, w)
    assert float(jnp.linalg.norm(empty - tiny @ w) / jnp.linalg.norm(tiny @ w)) > 0.5


def test_most_recent_reduction_uses_the_latest_entry():
    x, w = rng(16, 32, seed=3), rng(32, 16, seed=4)
    amax = float(jnp.max(jnp.abs(x)))
    history = jnp.array([amax, 1e5 * amax, 0.0, 0.0])
    outs = {}
    for reduction in ("max", "most_recent"):
        f = autocast(jnp.matmul, "float32",
                     fp8=Float8Recipe("delayed", amax_history_length=4, amax_reduction=reduction))
        state = float8_state(f, x, w)
        (h,) = state.histories
        state = Float8State((h._replace(lhs=history, rhs=history.at[0].set(3.0)),), state.scopes)
        outs[reduction] = f(state, x, w)
    want = x @ w
    errors = {k: float(jnp.linalg.norm(v - want) / jnp.linalg.norm(want)) for k, v in outs.items()}
    assert errors["most_recent"] < 0.05 < errors["max"]  # a maximum 1e5x too large flushes most of x to zero


def test_record_leaves_a_history_alone_where_nothing_finite_was_observed():
    f = autocast(mlp_loss, "mixed_bfloat16", fp8=DELAYED)
    state = float8_state(f, layers(), rng(32, 64))
    state = jax.tree.map(lambda h: h.at[0].set(1.0), state)
    observed = jax.tree.map(jnp.zeros_like, state)
    observed = Float8State((
        observed.histories[0]._replace(lhs=observed.histories[0].lhs.at[0].set(jnp.inf)),
        observed.histories[1]._replace(grad=observed.histories[1].grad.at[0].set(jnp.nan)),
        observed.histories[2]._replace(rhs=observed.histories[2].rhs.at[0].set(2.0)),
    ), observed.scopes)
    new = state.record(observed)
    np.testing.assert_array_equal(new.histories[0].lhs, state.histories[0].lhs)  # inf: skipped
    np.testing.assert_array_equal(new.histories[1].grad, state.histories[1].grad)  # NaN
    np.testing.assert_array_equal(new.histories[2].rhs, [2.0, 1.0, 0.0, 0.0])
    np.testing.assert_array_equal(new.histories[2].lhs, state.histories[2].lhs)  # zero
    with pytest.raises(TypeError, match="gradient of the autocast function"):
        state.record(jax.tree.leaves(observed))


@compilers
def test_non_finite_operands_give_non_finite_products(compile):
    x, w = rng(32, 64), rng(64, 16, seed=1)
    f = autocast(jnp.matmul, "mixed_bfloat16", fp8=DELAYED)
    state = jax.tree.map(lambda h: h.at[0].set(4.0), float8_state(f, x, w))
    for bad in (np.inf, -np.inf, np.nan):
        out = compile(f)(state, x.at[3, 5].set(bad), w)
        assert not np.isfinite(out[3]).any()
    observed = compile(jax.grad(lambda s, x: jnp.sum(f(s, x, w).astype(jnp.float32))))(
        state, x.at[0, 0].set(np.inf))
    assert not np.isfinite(observed.histories[0].lhs[0])  # and record skips it


# --- transformations ------------------------------------------------------------------------

def test_a_scanned_stack_gets_a_history_per_layer_equal_to_the_unrolled_loop():
    ws, x = layers(), rng(32, 64, seed=7)
    unrolled = autocast(lambda ws, x: mlp_loss(list(ws), x), "mixed_bfloat16", fp8=DELAYED)
    scanned = autocast(scanned_loss, "mixed_bfloat16", fp8=DELAYED)
    stacked = jnp.stack(ws)
    s_unrolled, s_scanned = float8_state(unrolled, ws, x), float8_state(scanned, stacked, x)
    assert [h.lhs.shape for h in s_scanned.histories] == [(3, 4)]
    for _ in range(2):
        loss_u, grads_u, s_unrolled = train_step(unrolled)(s_unrolled, ws, x)
        loss_s, grads_s, s_scanned = train_step(scanned)(s_scanned, stacked, x)
    (per_layer,) = s_scanned.histories
    for i, history in enumerate(s_unrolled.histories):
        for name in ("lhs", "rhs", "grad"):
            np.testing.assert_allclose(getattr(per_layer, name)[i], getattr(history, name),
                                       rtol=1e-6)
    # The unrolled loss squares the last bfloat16 activation (x ** 2 follows its input under
    # bfloat16), the scanned one its float32 carry: equal to within bfloat16's rounding.
    np.testing.assert_allclose(loss_s, loss_u, rtol=2e-3)
    np.testing.assert_allclose(grads_s, jnp.stack(grads_u), rtol=1e-5, atol=1e-7)


def test_nested_scans_stack_their_lengths():
    def loss(ws, x):
        def outer(h, w_block):
            h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, w_block)
            return h, None
        return jnp.mean(jax.lax.scan(outer, x, ws)[0] ** 2)

    ws = jnp.stack([jnp.stack(layers(3)), jnp.stack(layers(3))])
    f = autocast(loss, "mixed_bfloat16", fp8=DELAYED)
    state = float8_state(f, ws, rng(32, 64))
    assert [h.grad.shape for h in state.histories] == [(2, 3, 4)]
    _, _, state = train_step(f)(state, ws, rng(32, 64))
    assert bool((state.histories[0].grad[..., 0] > 0).all())


def test_an_untaken_branch_keeps_its_history():
    def loss(ws, x, flag):
        h = jax.lax.cond(flag, lambda h: h @ ws[0], lambda h: h @ ws[1], x)
        return jnp.mean(h ** 2)

    ws, x = layers(2), rng(32, 64)
    f = autocast(loss, "mixed_bfloat16", fp8=DELAYED)
    state = float8_state(f, ws, x, True)
    assert len(state.histories) == 2
    step = jax.jit(lambda s, ws, x, flag: s.record(jax.grad(f)(s, ws, x, flag)))
    # In the order of lax.cond's branches: false, then true.
    state = step(state, ws, x, True)
    assert state.histories[1].rhs[0] > 0 and not state.histories[0].rhs.any()
    state = step(state, ws, x, False)
    assert state.histories[0].rhs[0] > 0 and state.histories[1].rhs[1] == 0  # not shifted


def test_a_nested_jit_called_twice_and_remat_take_their_own_histories():
    dense = jax.jit(lambda h, w: jnp.tanh(h @ w))

    def loss(ws, x, remat):
        layer = jax.checkpoint(dense) if remat else dense
        return jnp.mean(layer(layer(x, ws[0]), ws[1]) ** 2)

    ws, x = layers(2), rng(32, 64)
    results = []
    for remat in (False, True):
        f = autocast(loss, "mixed_bfloat16", fp8=DELAYED)
        state = float8_state(f, ws, x, remat)
        assert len(state.histories) == 2
        step = jax.jit(lambda s, ws, x: jax.value_and_grad(f, argnums=(0, 1))(s, ws, x, remat))
        loss_value, (observed, grads) = step(state, ws, x)
        results.append((loss_value, observed, grads))
    (l0, o0, g0), (l1, o1, g1) = results
    # The two programs fuse the bfloat16 tanh differently (XLA:CPU keeps excess precision
    # inside a fusion): the gradients' maxima differ in their last bits, and the float8
    # gradients round a few values the other way. The operands' maxima are the same, to
    # bfloat16's rounding (XLA:GPU may keep the tanh float32 in one of the programs).
    for h0, h1 in zip(o0.histories, o1.histories):
        np.testing.assert_allclose(h0.lhs, h1.lhs, rtol=2**-8)
        np.testing.assert_array_equal(h0.rhs, h1.rhs)
        np.testing.assert_allclose(h0.grad, h1.grad, rtol=0.05)
    np.testing.assert_allclose(l0, l1, rtol=1e-4)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        assert np.linalg.norm(a - b) < 0.1 * np.linalg.norm(a)
    assert o0.histories[0].rhs[0] != o0.histories[1].rhs[0]


def test_products_in_while_loops_and_custom_derivatives_are_refused_with_a_way_out():
    def looped(w, x, n):
        return jnp.sum(jax.lax.fori_loop(0, n, lambda i, h: h @ w, x))

    f = autocast(looped, "mixed_bfloat16", fp8=DELAYED)
    with pytest.raises(NotImplementedError, match=r"while_loop.*exclude"):
        jax.jit(lambda w, x, n: float8_state(f, w, x, n))(rng(64, 64), rng(32, 64), 3)

    @jax.custom_vjp
    def product(x, w):
        return x @ w
    product.defvjp(lambda x, w: (x @ w, (x, w)), lambda r, g: (g @ r[1].T, r[0].T @ g))
    f = autocast(lambda w, x: jnp.sum(product(x, w)), "mixed_bfloat16", fp8=DELAYED)
    with pytest.raises(NotImplementedError, match="custom_vjp"):
        float8_state(f, rng(64, 64), rng(32, 64))


def test_a_state_for_another_function_is_an_error_naming_the_fix():
    f = autocast(mlp_loss, "mixed_bfloat16", fp8=DELAYED)
    ws, x = layers(), rng(32, 64)
    with pytest.raises(TypeError, match="first argument, a jmp_policy.Float8State"):
        f(ws, x)
    short = float8_state(f, ws[:2], x)
    with pytest.raises(ValueError, match="has 2 product histories.*float8_state"):
        f(short, ws, x)
    longer = float8_state(f, ws + ws[:1], x)
    with pytest.raises(ValueError, match="ran 3 float8 products"):
        f(longer, ws, x)
    with pytest.raises(TypeError, match="made by jmp_policy.autocast"):
        float8_state(autocast(mlp_loss, "mixed_bfloat16", fp8="tensorwise"), ws, x)


def test_vmap_of_the_step_and_checkpoint_of_the_state_round_trip():
    f = autocast(mlp_loss, "mixed_bfloat16", fp8=DELAYED)
    ws, x = layers(), rng(4, 16, 64)
    state = float8_state(f, ws, x[0])
    per_example = jax.vmap(jax.grad(f), in_axes=(None, None, 0))(state, ws, x)
    assert per_example.histories[0].lhs.shape == (4, 4)
    leaves, treedef = jax.tree.flatten(state)  # what a checkpoint saves and restores
    assert jax.tree.unflatten(treedef, leaves).scopes == state.scopes
    assert re.fullmatch(r"\.histories\[0\]\.lhs", jax.tree_util.keystr(
        jax.tree_util.tree_flatten_with_path(state)[0][0][0]))


@pytest.mark.slow  # a system test: a training run (30 steps, twice)
def test_training_with_delayed_scaling_tracks_tensorwise():
    ws, x = layers(), rng(64, 64, seed=9)
    target = jnp.tanh(x @ rng(64, 64, seed=11, scale=0.2))

    def loss(ws, x):
        h = x
        for w in ws:
            h = jnp.tanh(h @ w)
        return jnp.mean((h.astype(jnp.float32) - target) ** 2)

    def train(fp8):
        f = autocast(loss, "mixed_bfloat16", fp8=fp8)
        params = ws
        if fp8 is DELAYED:
            state = float8_state(f, params, x)
            step = jax.jit(lambda s, p: jax.value_and_grad(f, argnums=(0, 1))(s, p, x))
        else:
            step = jax.jit(lambda s, p: (lambda l, g: (l, (s, g)))(*jax.value_and_grad(f)(p, x)))
            state = None
        for _ in range(30):
            value, (observed, grads) = step(state, params)
            params = [p - 0.5 * g for p, g in zip(params, grads)]
            if fp8 is DELAYED:
                state = state.record(observed)
        return float(value)

    delayed, tensorwise, start = train(DELAYED), train("tensorwise"), float(loss(ws, x))
    assert delayed < 0.7 * start
    assert delayed == pytest.approx(tensorwise, rel=0.05)


@pytest.mark.slow  # a system test: linen, NNX and Equinox models
def test_linen_scan_stack_nnx_and_equinox_models_train_with_their_state():
    nn = pytest.importorskip("flax.linen")
    nnx = pytest.importorskip("flax.nnx")
    eqx = pytest.importorskip("equinox")
    x = rng(32, 64, seed=5)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return jnp.tanh(nn.Dense(64)(h)), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, h):
            h = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=3)()(h, None)[0]
            return nn.Dense(8, name="head")(h)

    linen = Stack()
    variables = linen.init(jax.random.key(0), x)
    apply = autocast(lambda v, x: jnp.mean(linen.apply(v, x).astype(jnp.float32) ** 2),
                     "mixed_bfloat16", fp8=DELAYED)
    state = float8_state(apply, variables, x)
    assert [h.lhs.shape for h in state.histories] == [(3, 4)]  # a history per layer; no head
    _, _, state = train_step(apply)(state, variables, x)
    kernels = variables["params"]["ScanBlock_0"]["Dense_0"]["kernel"]
    np.testing.assert_allclose(state.histories[0].rhs[:, 0], jnp.max(jnp.abs(kernels), (1, 2)),
                               rtol=1e-6)

    class Mlp(nnx.Module):
        def __init__(self, rngs):
            self.up, self.head = nnx.Linear(64, 64, rngs=rngs), nnx.Linear(64, 8, rngs=rngs)

        def __call__(self, x):
            return self.head(jax.nn.gelu(self.up(x)))

    model = Mlp(nnx.Rngs(0))
    f = autocast(lambda m, x: jnp.mean(m(x).astype(jnp.float32) ** 2), "mixed_bfloat16",
                 fp8=DELAYED)
    state = float8_state(f, model, x)
    assert state.scopes == ("Mlp/up",)
    observed, grads = nnx.grad(f, argnums=(0, 1))(state, model, x)  # nnx.grad reads its signature
    assert state.record(observed).histories[0].rhs[0] == jnp.max(jnp.abs(model.up.kernel[...]))
    assert grads.up.kernel.shape == (64, 64)

    class Eqx(eqx.Module):
        up: eqx.nn.Linear
        head: eqx.nn.Linear

        def __call__(self, x):
            return self.head(jax.nn.gelu(self.up(x)))

    keys = jax.random.split(jax.random.key(1))
    module = Eqx(eqx.nn.Linear(64, 64, key=keys[0]), eqx.nn.Linear(64, 8, key=keys[1]))
    f = autocast(lambda m, x: jnp.mean(jax.vmap(m)(x).astype(jnp.float32) ** 2),
                 "mixed_bfloat16", fp8=DELAYED)
    state = float8_state(f, module, x)
    observed, grads = eqx.filter_jit(eqx.filter_grad(lambda sm, x: f(*sm, x)))((state, module), x)
    # Equinox multiplies weight @ x: the weight is the left operand.
    assert len(state.histories) == 1 and observed.histories[0].lhs[0] == \
        jnp.max(jnp.abs(module.up.weight))


def test_a_step_that_loss_scaling_skips_leaves_the_overflowing_histories_alone():
    """Float16 with loss scaling: a step whose backward pass overflows is skipped by
    loss_scaling; the gradient histories observed inf and are left alone (the forward
    operands' maxima of that step are true, and kept)."""
    import optax
    ws, x = layers(2), rng(32, 64)
    f = autocast(mlp_loss, "mixed_float16", fp8=DELAYED)
    tx = jmp_policy.loss_scaling(optax.sgd(0.1), jmp_policy.StaticLossScale(2.0 ** 15))
    state, opt_state = float8_state(f, ws, x), tx.init(ws)

    @jax.jit
    def step(state, ws, opt_state, factor):
        scale = jmp_policy.get_loss_scale(opt_state)
        observed, grads = jax.grad(lambda s, w: scale.scale(f(s, w, x) * factor),
                                   argnums=(0, 1))(state, ws)
        updates, opt_state = tx.update(grads, opt_state, ws)
        return state.record(observed), optax.apply_updates(ws, updates), opt_state

    state, ws, opt_state = step(state, ws, opt_state, 1.0)
    before = state
    state, new_ws, opt_state = step(state, ws, opt_state, jnp.inf)  # the loss overflows
    for a, b in zip(new_ws, ws):
        np.testing.assert_array_equal(a, b)  # skipped
    for new, old in zip(state.histories, before.histories):
        np.testing.assert_array_equal(new.grad, old.grad)  # observed inf: left alone
        np.testing.assert_array_equal(new.rhs[1:], old.rhs[:-1])  # the weights' maxima are true


def test_an_orbax_checkpoint_restores_the_state(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    f = autocast(scanned_loss, "mixed_bfloat16", fp8=DELAYED)
    ws, x = jnp.stack(layers()), rng(32, 64)
    state = float8_state(f, ws, x)
    _, _, state = train_step(f)(state, ws, x)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "fp8", state)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "fp8", jax.eval_shape(lambda: state))
    assert isinstance(restored, Float8State) and restored.scopes == state.scopes
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(a, b)


def test_the_inspector_refuses_delayed_scaling_and_says_what_to_inspect():
    with pytest.raises(ValueError, match="fp8='tensorwise'"):
        jmp_policy.inspect_numerics(mlp_loss, "mixed_bfloat16", fp8="delayed")


def test_the_public_names():
    assert jmp_policy.float8_state is float8_state
    assert jmp_policy.AmaxHistory._fields == ("lhs", "rhs", "grad")


# --- sharding ---------------------------------------------------------------------------------

_SHARDED = r'''
import json, jax, jax.numpy as jnp, numpy as np, jmp_policy
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
# tanh in float32: the programs differ by partitioning, not by how XLA fuses bfloat16 work.
f = jmp_policy.autocast(lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2), "mixed_bfloat16",
                        fp8=jmp_policy.Float8Recipe("delayed", amax_history_length=4),
                        rules={"float32": ["tanh"]})
w = jax.random.normal(jax.random.key(0), (64, 64)) * 0.1
x = jax.random.normal(jax.random.key(1), (128, 64)) * jnp.arange(1, 129)[:, None]  # outlier rows
state = jmp_policy.float8_state(f, w, x)
grad = jax.jit(jax.grad(f, argnums=(0, 1)))
def summary(g):
    return [[float(a[0]) for a in h] for h in g[0].histories] + [np.asarray(g[1]).tolist()]
out = {"one device": summary(grad(state, w, x))}
for mode in (AxisType.Auto, AxisType.Explicit):
    mesh = jax.make_mesh((4,), ("data",), axis_types=(mode,))
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        ws = jax.device_put(w, NamedSharding(mesh, P()))
        g = grad(state, ws, xs)
        out[f"jit {mode.name}"] = summary(g)
        out[f"jit {mode.name} replicated"] = g[0].histories[0].lhs.sharding.is_fully_replicated
        whole = jax.shard_map(lambda s, w, x: jax.lax.pmean(f(s, w, x), "data"), mesh=mesh,
                              in_specs=(P(), P(), P("data")), out_specs=P())
        out[f"shard_map {mode.name}"] = summary(jax.jit(jax.grad(whole, argnums=(0, 1)))(state, ws, xs))
print(json.dumps(out))
'''


@pytest.mark.slow  # a system test: a child interpreter on 4 devices
def test_sharded_jit_and_shard_map_observe_the_global_maxima():
    """Data-parallel on 4 host devices (a subprocess): the operands' maxima are over the
    whole batch, as on one device, under jit's partitioner (auto and explicit axes) and
    inside shard_map (a maximum over the devices, not a sum)."""
    # The suite's XLA flags (tests/conftest.py: fast compilation) and 4 host devices.
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
               + " --xla_force_host_platform_device_count=4")
    result = subprocess.run([sys.executable, "-c", _SHARDED], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    want = out.pop("one device")
    assert out.pop("jit Auto replicated") and out.pop("jit Explicit replicated")
    for name, got in out.items():
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6, err_msg=name)  # the maxima
        # The gradient: the weight's sums over the batch's shards are bfloat16 GEMM
        # results, added in another order.
        diff = np.linalg.norm(np.subtract(got[1], want[1])) / np.linalg.norm(want[1])
        assert diff < 0.02, (name, diff)


@pytest.mark.parametrize("policy", ["dots_saveable", "dots_with_no_batch_dims_saveable",
                                    "nothing_saveable"])
def test_checkpoint_policies_save_and_recompute_what_they_do_in_plain_jax(policy):
    """As tests/test_remat.py checks for the other recipes: what jax.checkpoint saves
    (the histories apart, which are arguments) and how many products its backward
    pass recomputes."""
    from test_remat import in_compute_dtype, layer, recomputed, residuals

    cp = getattr(jax.checkpoint_policies, policy)
    w, x = rng(64, 64, scale=1 / 8), rng(64, 64, seed=1)
    f = autocast(layer, "mixed_bfloat16", fp8=Float8Recipe("delayed", exclude=()))
    state = float8_state(f, w, x)

    def computed(lines):
        return [line for line in lines if "argument" not in line]

    plain = in_compute_dtype(layer, "mixed_bfloat16")  # the products saved in bfloat16
    assert computed(residuals(jax.checkpoint(f, policy=cp), state, w, x)) == \
        computed(residuals(jax.checkpoint(plain, policy=cp), w, x))
    assert recomputed(f, cp, state, w, x) == recomputed(plain, cp, w, x)

