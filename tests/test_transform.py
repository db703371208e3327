"""Tests for jmp_policy.transform: loss_scaling, get_loss_scale, scaled_value_and_grad."""

import functools

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_policy
from jmp_policy import DynamicLossScale, NoOpLossScale, StaticLossScale


def make_params():
    return {
        "dense": {"kernel": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), "bias": jnp.zeros(3)},
        "scale": jnp.ones(3, jnp.bfloat16),
    }


def grads_like(params, value):
    return jax.tree_util.tree_map(lambda p: jnp.full(p.shape, value, p.dtype), params)


def assert_trees_identical(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_trees_close(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=1e-6)


# ---------------------------------------------------------------------------
# update: finite steps, skipped steps, the loss-scale argument.


def test_finite_step_runs_inner_on_unscaled_grads():
    params = make_params()
    inner = optax.adam(1e-2)
    tx = jmp_policy.loss_scaling(inner, DynamicLossScale(2.0**12, period=1))
    state = tx.init(params)
    grads = jax.tree_util.tree_map(lambda p: (jnp.arange(p.size).reshape(p.shape) * 0.1).astype(p.dtype), params)
    scaled = jax.tree_util.tree_map(lambda g: (g * 2.0**12).astype(g.dtype), grads)

    updates, new_state = jax.jit(tx.update)(scaled, state, params)
    expected, expected_inner = jax.jit(inner.update)(grads, inner.init(params), params)
    # Same ops on the same (exactly unscaled: power-of-two scale) grads; only
    # XLA's fusion choices may move the last bit.
    assert_trees_close(updates, expected)
    assert_trees_close(new_state.inner_state, expected_inner)
    assert bool(new_state.grads_finite) and int(new_state.skipped_steps) == 0
    assert float(new_state.loss_scale.loss_scale) == 2.0**13  # period=1: grows after one finite step


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_step_is_skipped_bit_for_bit(bad):
    params = make_params()
    tx = jmp_policy.loss_scaling(optax.adamw(1e-2), "dynamic")
    state = tx.init(params)
    step = jax.jit(tx.update)
    _, state = step(grads_like(params, 0.5), state, params)  # a real step first: state is not zeros
    grads = grads_like(params, 0.25)
    grads["dense"]["kernel"] = grads["dense"]["kernel"].at[1, 2].set(bad)

    updates, new_state = step(grads, state, params)
    assert_trees_identical(updates, jax.tree_util.tree_map(jnp.zeros_like, updates))
    assert jax.tree_util.tree_map(lambda u: u.dtype, updates) == jax.tree_util.tree_map(
        lambda p: p.dtype, params)
    assert_trees_identical(new_state.inner_state, state.inner_state)
    assert not bool(new_state.grads_finite) and int(new_state.skipped_steps) == 1
    assert float(new_state.loss_scale.loss_scale) == 2.0**14


def test_finiteness_is_judged_on_unscaled_grads():
    # Scale < 1: finite scaled grads whose unscaled value overflows must be skipped,
    # in float32 and in float16 (where unscale rounds back to float16).
    params = {"f32": jnp.zeros(2), "f16": jnp.zeros(2, jnp.float16)}
    tx = jmp_policy.loss_scaling(optax.sgd(1.0), StaticLossScale(0.5))
    state = tx.init(params)
    ok = {"f32": jnp.array([1.0, 1e38]), "f16": jnp.array([1.0, 30000.0], jnp.float16)}
    _, s = tx.update(ok, state)
    assert bool(s.grads_finite)
    for name, big in (("f32", 3e38), ("f16", 40000.0)):
        grads = dict(ok, **{name: ok[name].at[1].set(big)})
        assert bool(jmp_policy.all_finite(grads))  # finite before unscaling
        _, s = tx.update(grads, state)
        assert not bool(s.grads_finite), name


@pytest.mark.parametrize(
    "inner",
    [
        optax.adafactor(1e-3),
        optax.masked(optax.lion(1e-3), {"dense": {"kernel": True, "bias": False}, "scale": True}),
        optax.multi_transform({"a": optax.adam(1e-3), "s": optax.sgd(1e-2, momentum=0.9)},
                              {"dense": {"kernel": "a", "bias": "s"}, "scale": "s"}),
        # Changes a state dtype on its first update (bfloat16 moments become float32).
        optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
    ],
    ids=["adafactor", "masked", "multi_transform", "inject_hyperparams"],
)
def test_skip_with_various_inner_optimizers(inner):
    params = make_params()
    tx = jmp_policy.loss_scaling(inner, 4.0)
    step = jax.jit(tx.update)
    state = tx.init(params)
    updates, state = step(grads_like(params, 4.0), state, params)
    expected, _ = jax.jit(inner.update)(grads_like(params, 1.0), inner.init(params), params)
    assert_trees_close(updates, expected)
    bad = grads_like(params, 4.0)
    bad["scale"] = bad["scale"].at[0].set(jnp.inf)
    updates, skipped = step(bad, state, params)
    assert_trees_identical(skipped.inner_state, state.inner_state)
    assert not any(np.any(np.asarray(u, np.float32)) for u in jax.tree_util.tree_leaves(updates))


def test_loss_scale_none_still_skips_non_finite_steps():
    tx = jmp_policy.loss_scaling(optax.sgd(0.1), None)
    state = tx.init({"w": jnp.ones(2)})
    assert isinstance(jmp_policy.get_loss_scale(state), NoOpLossScale)
    updates, state = tx.update({"w": jnp.array([1.0, 2.0])}, state)
    np.testing.assert_allclose(updates["w"], [-0.1, -0.2])
    updates, state = tx.update({"w": jnp.array([1.0, np.nan])}, state)
    np.testing.assert_array_equal(updates["w"], [0.0, 0.0])
    assert int(state.skipped_steps) == 1


@pytest.mark.parametrize(
    "arg, kind, value",
    [
        ("dynamic", DynamicLossScale, 2.0**15),
        (128.0, StaticLossScale, 128.0),
        (None, NoOpLossScale, 1.0),
        (DynamicLossScale(64.0, period=3), DynamicLossScale, 64.0),
        (jmp_policy.Policy("mixed_float16"), DynamicLossScale, None),
        (jmp_policy.Policy("mixed_bfloat16"), NoOpLossScale, 1.0),
        (jmp_policy.Policy("mixed_float16", loss_scale=None), NoOpLossScale, 1.0),
    ],
)
def test_loss_scale_argument_forms(arg, kind, value):
    state = jmp_policy.loss_scaling(optax.sgd(0.1), arg).init({"w": jnp.ones(2)})
    scale = jmp_policy.get_loss_scale(state)
    assert type(scale) is kind
    if value is None:  # a policy's own default dynamic scale
        value = float(arg.loss_scale.loss_scale)
    assert float(scale.loss_scale) == value


@pytest.mark.parametrize("arg, error", [("static", ValueError), (object(), TypeError), (True, TypeError)])
def test_bad_loss_scale_argument(arg, error):
    with pytest.raises(error, match="loss_scale"):
        jmp_policy.loss_scaling(optax.sgd(0.1), arg)


def test_skipped_steps_saturates_at_int32_max():
    tx = jmp_policy.loss_scaling(optax.sgd(0.1), 1.0)
    state = tx.init({"w": jnp.ones(2)})._replace(skipped_steps=jnp.int32(np.iinfo(np.int32).max))
    _, state = jax.jit(tx.update)({"w": jnp.full(2, np.inf)}, state)
    assert int(state.skipped_steps) == np.iinfo(np.int32).max
    assert state.skipped_steps.dtype == jnp.int32


def test_update_rejects_a_foreign_state():
    tx = jmp_policy.loss_scaling(optax.sgd(0.1))
    with pytest.raises(TypeError, match="LossScalingState"):
        tx.update({"w": jnp.ones(2)}, optax.sgd(0.1).init({"w": jnp.ones(2)}))


def test_extra_args_reach_an_inner_that_accepts_them():
    def scale_by_value():
        def update(updates, state, params=None, *, value):
            return jax.tree_util.tree_map(lambda u: u * value, updates), state
        return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)

    tx = jmp_policy.loss_scaling(scale_by_value(), 4.0)
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    state = tx.init({"w": jnp.ones(2)})
    updates, _ = jax.jit(tx.update)({"w": jnp.full(2, 4.0)}, state, None, value=jnp.float32(3.0))
    np.testing.assert_array_equal(updates["w"], [3.0, 3.0])
    updates, _ = tx.update({"w": jnp.full(2, 4.0)}, state, None, value=2.0)  # non-array: closed over
    np.testing.assert_array_equal(updates["w"], [2.0, 2.0])
    # A plain GradientTransformation inner ignores extra arguments.
    tx = jmp_policy.loss_scaling(optax.sgd(1.0), 4.0)
    updates, _ = tx.update({"w": jnp.full(2, 4.0)}, tx.init({"w": jnp.ones(2)}), None, value=1.0)
    np.testing.assert_array_equal(updates["w"], [-1.0, -1.0])


def _all_primitives(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _all_primitives(sub)


def _runtime_conds(jaxpr):
    """Top-level conds, less those on `platform_index`: those pick the check's
    form per backend and are resolved when the step is lowered."""
    platform = {v for e in jaxpr.eqns if e.primitive.name == "platform_index" for v in e.outvars}
    return [e for e in jaxpr.eqns if e.primitive.name == "cond" and e.invars[0] not in platform]


def test_update_jaxpr_has_one_cond_no_callbacks_and_no_boolean_masks(xla_cpu):
    params = make_params()
    tx = jmp_policy.loss_scaling(optax.adam(1e-3), "dynamic")
    state = tx.init(params)
    closed = jax.make_jaxpr(tx.update)(grads_like(params, 1.0), state, params)
    eqns = list(_all_primitives(closed.jaxpr))
    names = {e.primitive.name for e in eqns}
    assert not {n for n in names if "callback" in n or "feed" in n or n in ("device_put", "outside_call")}
    assert len(_runtime_conds(closed.jaxpr)) == 1
    # (XLA:GPU may turn the cond into selects: counted on XLA:CPU.)
    hlo = jax.jit(tx.update).lower(grads_like(params, 1.0), state, params).compile().as_text()
    assert hlo.count(" conditional(") == 1
    # Finiteness: a single scalar isfinite outside the branches, no per-element masks.
    top_isfinite = [e for e in closed.jaxpr.eqns if e.primitive.name == "is_finite"]
    assert len(top_isfinite) == 1 and top_isfinite[0].invars[0].aval.shape == ()
    assert all(e.invars[0].aval.shape == () for e in eqns if e.primitive.name == "is_finite")


def _scalar_divisions(eqns):
    return [e for e in eqns if e.primitive.name == "div" and e.outvars[0].aval.shape == ()]


@pytest.mark.parametrize("fused", [False, True])
def test_a_dynamic_scale_is_inverted_before_the_cond(fused):
    # Inside the taken branch `1 / scale` is a scalar kernel that every
    # optimizer kernel waits for: 1.23x instead of 1.15x the wall time of
    # plain donated Adam on XLA:CPU (benchmarks/RESULTS.md).
    params = make_params()
    tx = jmp_policy.loss_scaling(optax.adam(1e-3), "dynamic")
    state = tx.init(params)
    step = (lambda g, s, p: tx.update_and_apply(g, s, p)) if fused else tx.update
    closed = jax.make_jaxpr(step)(grads_like(params, 1.0), state, params)
    (cond,) = _runtime_conds(closed.jaxpr)
    for branch in cond.params["branches"]:
        assert not _scalar_divisions(_all_primitives(branch.jaxpr))
    assert len(_scalar_divisions(closed.jaxpr.eqns)) == 1


# ---------------------------------------------------------------------------
# get_loss_scale.


@pytest.mark.parametrize(
    "build",
    [
        lambda ls: ls,
        lambda ls: optax.chain(optax.clip(1.0), ls),
        lambda ls: optax.named_chain(("clip", optax.clip(1.0)), ("ls", ls)),
        lambda ls: optax.MultiSteps(ls, every_k_schedule=2),
        lambda ls: optax.chain(optax.MultiSteps(optax.chain(optax.identity(), ls), every_k_schedule=3)),
    ],
)
def test_get_loss_scale_finds_the_state_anywhere(build):
    tx = build(jmp_policy.loss_scaling(optax.sgd(0.1), DynamicLossScale(256.0)))
    state = tx.init({"w": jnp.ones(2)})
    assert float(jmp_policy.get_loss_scale(state).loss_scale) == 256.0
    assert float(jax.jit(lambda s: jmp_policy.get_loss_scale(s).loss_scale)(state)) == 256.0


def test_get_loss_scale_inside_inject_hyperparams():
    tx = optax.inject_hyperparams(
        lambda learning_rate: jmp_policy.loss_scaling(optax.sgd(learning_rate), 512.0))(learning_rate=0.1)
    state = tx.init({"w": jnp.ones(2)})
    assert float(jmp_policy.get_loss_scale(state).loss_scale) == 512.0
    _, state = tx.update({"w": jnp.ones(2)}, state)
    assert float(jmp_policy.get_loss_scale(state).loss_scale) == 512.0


def test_get_loss_scale_errors():
    with pytest.raises(ValueError, match="no LossScalingState"):
        jmp_policy.get_loss_scale(optax.adam(1e-3).init({"w": jnp.ones(2)}))
    two = optax.chain(jmp_policy.loss_scaling(optax.sgd(0.1)), jmp_policy.loss_scaling(optax.sgd(0.1)))
    with pytest.raises(ValueError, match="ambiguous"):
        jmp_policy.get_loss_scale(two.init({"w": jnp.ones(2)}))
    nested = jmp_policy.loss_scaling(jmp_policy.loss_scaling(optax.sgd(0.1)))
    with pytest.raises(ValueError, match="ambiguous"):
        jmp_policy.get_loss_scale(nested.init({"w": jnp.ones(2)}))


# ---------------------------------------------------------------------------
# scaled_value_and_grad.


def test_scaled_value_and_grad_scales_grads_not_value():
    def loss_fn(w, x, *, shift):
        return jnp.sum((w * x - shift) ** 2)

    w, x = jnp.array([1.0, -2.0, 0.5]), jnp.array([0.3, 0.2, 0.1])
    value, grads = jmp_policy.scaled_value_and_grad(loss_fn)(DynamicLossScale(1024.0), w, x, shift=1.0)
    ref_value, ref_grads = jax.value_and_grad(loss_fn)(w, x, shift=1.0)
    assert float(value) == float(ref_value)
    np.testing.assert_array_equal(grads, ref_grads * 1024.0)
    # A plain number, argnums and has_aux.
    (value, aux), (gw, gx) = jmp_policy.scaled_value_and_grad(
        lambda w, x: (loss_fn(w, x, shift=0.0), {"n": 3}), argnums=(0, 1), has_aux=True)(8.0, w, x)
    assert aux == {"n": 3}
    np.testing.assert_array_equal(gw, jax.grad(loss_fn)(w, x, shift=0.0) * 8.0)
    np.testing.assert_array_equal(gx, jax.grad(loss_fn, argnums=1)(w, x, shift=0.0) * 8.0)


def test_float16_loss_is_promoted_before_scaling():
    # float16(3000) * 2**15 overflows float16; promoted to float32 it does not.
    def loss_fn(w):
        return jnp.sum(w.astype(jnp.float16)) * jnp.float16(1000.0)

    w = jnp.ones(3)
    value, grads = jax.jit(jmp_policy.scaled_value_and_grad(loss_fn))(DynamicLossScale(2.0**15), w)
    assert value.dtype == jnp.float16 and float(value) == 3000.0
    assert grads.dtype == jnp.float32  # grads w.r.t. float32 params stay float32
    # The scaled cotangent reaching float16 (1000 * 2**15) overflows float16: that
    # is a genuine overflow for the dynamic scale to detect, not a NaN loss.
    assert not bool(jmp_policy.all_finite(grads))
    value, grads = jmp_policy.scaled_value_and_grad(loss_fn)(32.0, w)
    np.testing.assert_array_equal(grads, np.full(3, 32000.0, np.float32))


def test_scaled_value_and_grad_errors():
    g = jmp_policy.scaled_value_and_grad(lambda w: w * 2)
    with pytest.raises(TypeError, match="scalar loss"):
        g(2.0, jnp.ones(3))
    with pytest.raises(TypeError, match="loss_scale"):
        jmp_policy.scaled_value_and_grad(jnp.sum)("big", jnp.ones(3))
    with pytest.raises(TypeError, match=r"\(loss, aux\)"):
        jmp_policy.scaled_value_and_grad(jnp.sum, has_aux=True)(2.0, jnp.ones(3))


def test_spec_train_step_trains_in_float16():
    """The complete jitted train step from SPEC section 3, with float16 compute."""
    policy = jmp_policy.Policy("mixed_float16")
    tx = jmp_policy.loss_scaling(optax.adamw(1e-2), policy)
    params = {"w": jnp.full((8, 4), 0.1), "b": jnp.zeros(4)}
    opt_state = tx.init(params)
    batch = {"x": jnp.linspace(-1, 1, 32).reshape(4, 8), "y": jnp.array([0, 1, 2, 3])}

    def apply(p, x):
        return x @ p["w"] + p["b"]

    @jax.jit
    def train_step(params, opt_state, batch):
        def loss_fn(p):
            logits = policy.wrap(apply)(p, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        scale = jmp_policy.get_loss_scale(opt_state)
        loss, grads = jmp_policy.scaled_value_and_grad(loss_fn)(scale, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(20):
        params, opt_state, loss = train_step(params, opt_state, batch)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))
    assert bool(jmp_policy.all_finite((params, opt_state)))


def test_axis_name_under_shard_map_types_both_branches_alike():
    # One device is enough to exercise shard_map's varying-value typing: zero
    # updates and kept state must vary over the axis like computed ones do.
    mesh = jax.make_mesh((1,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.sharding.PartitionSpec
    tx = jmp_policy.loss_scaling(optax.sgd(0.1), DynamicLossScale(8.0), axis_name="batch")
    params = jnp.ones((2, 3))
    state = tx.init(params)

    @jax.jit
    def step(grads, state, params):
        # Per-device grads and params, replicated optimizer state: the psum-ed
        # finiteness keeps the loss scale and counters replicated.
        return jax.shard_map(tx.update, mesh=mesh, in_specs=(spec("batch"), spec(), spec("batch")),
                             out_specs=(spec("batch"), spec()), check_vma=True)(grads, state, params)

    updates, state = step(jnp.full((2, 3), 8.0), state, params)
    np.testing.assert_allclose(updates, np.full((2, 3), -0.1))
    updates, state = step(jnp.full((2, 3), 8.0).at[0, 0].set(np.inf), state, params)
    np.testing.assert_array_equal(updates, np.zeros((2, 3)))
    assert int(state.skipped_steps) == 1 and float(state.loss_scale.loss_scale) == 4.0


def test_each_init_owns_its_loss_scale_buffers_under_donation():
    tx = jmp_policy.loss_scaling(optax.sgd(0.1), "dynamic")
    params = {"w": jnp.ones(3)}
    s1, s2 = tx.init(params), tx.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step({"w": jnp.ones(3)}, s1, {"w": jnp.ones(3)})  # donates s1's buffers
    assert float(jmp_policy.get_loss_scale(s2).loss_scale) == 2.0**15  # s2 untouched


def test_update_and_apply_is_bit_identical_to_update_then_apply_updates():
    tx = jmp_policy.loss_scaling(optax.adam(1e-2), jmp_policy.DynamicLossScale(2.0**4, period=2))
    params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.zeros(3)}
    grads_seq = [
        {"w": jnp.full((2, 3), 3.0), "b": jnp.arange(3.0)},
        {"w": jnp.full((2, 3), jnp.nan), "b": jnp.ones(3)},          # skipped
        {"w": jnp.full((2, 3), -2.0), "b": jnp.array([jnp.inf, 0.0, 1.0])},  # skipped
        {"w": jnp.full((2, 3), 1.5), "b": jnp.ones(3)},
        {"w": jnp.full((2, 3), 0.5), "b": -jnp.ones(3)},
    ]

    @jax.jit
    def two_calls(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    fused = jax.jit(functools.partial(tx.update_and_apply), donate_argnums=(1, 2))
    p1, s1 = params, tx.init(params)
    p2, s2 = jax.tree_util.tree_map(jnp.copy, params), tx.init(params)
    for grads in grads_seq:
        p1, s1 = two_calls(p1, s1, grads)
        p2, s2 = fused(grads, s2, p2)
        chex.assert_trees_all_equal(p1, p2)
        chex.assert_trees_all_equal(s1, s2)
    assert int(s2.skipped_steps) == 2


# ---------------------------------------------------------------------------
# donated=: the same results either way; no parameter-sized copies when it
# matches how the step is jitted.

_SPECIAL = [0.0, -0.0, 1e-40, -3e-39, 1.5, -2.0**100, 3e38]  # float32 subnormals, signed zero, huge


def _special_tree():
    f32 = jnp.array(_SPECIAL, jnp.float32)
    return {
        "f32": f32.reshape(7, 1) * jnp.ones((7, 3), jnp.float32),
        "bf16": jnp.array([0.0, -0.0, 1e-40, 2.0**-130, 3.0, -1e38], jnp.bfloat16),
        "f16": jnp.array([0.0, -0.0, 6e-8, -3e-5, 65504.0], jnp.float16),
    }


@pytest.mark.parametrize("donated", [True, False])
@pytest.mark.parametrize("fused", [False, True], ids=["update", "update_and_apply"])
def test_skip_is_bit_for_bit_with_either_donated_setting(donated, fused):
    params = _special_tree()
    tx = jmp_policy.loss_scaling(optax.trace(decay=0.9), "dynamic", donated=donated)
    state = tx.init(params)
    # Inner state full of values an inexact "copy" would change (subnormals, -0.0).
    state = state._replace(inner_state=optax.TraceState(trace=_special_tree()))
    grads = grads_like(params, 1.0)
    grads["f16"] = grads["f16"].at[2].set(jnp.inf)

    if fused:
        step = jax.jit(tx.update_and_apply, donate_argnums=(1, 2) if donated else ())
        new_params, new_state = step(grads, state, jax.tree_util.tree_map(jnp.copy, params))
        assert_trees_identical(new_params, params)
    else:
        step = jax.jit(tx.update, donate_argnums=(1,) if donated else ())
        updates, new_state = step(grads, jax.tree_util.tree_map(jnp.copy, state), params)
        assert_trees_identical(updates, jax.tree_util.tree_map(jnp.zeros_like, params))
    for x, y in zip(jax.tree_util.tree_leaves(new_state.inner_state), jax.tree_util.tree_leaves(_special_tree())):
        assert x.dtype == y.dtype
        # Bit patterns, not values: -0.0 == 0.0 and subnormals compare loosely.
        np.testing.assert_array_equal(np.asarray(x).view(f"u{x.dtype.itemsize}"),
                                      np.asarray(y).view(f"u{y.dtype.itemsize}"))
    assert int(new_state.skipped_steps) == 1


@pytest.mark.parametrize("donate", [True, False], ids=["donated", "not-donated"])
@pytest.mark.parametrize("fused", [False, True], ids=["update", "update_and_apply"])
def test_no_parameter_sized_copies_when_donated_matches_the_jit(donate, fused, xla_cpu):
    shapes = {"a": (256, 384), "b": (384, 256), "c": (384,)}
    params = {k: jnp.full(s, 0.5) for k, s in shapes.items()}
    grads = {k: jnp.full(s, 0.25) for k, s in shapes.items()}
    tx = jmp_policy.loss_scaling(optax.adam(1e-3), "dynamic", donated=donate)

    def step(params, state, grads):
        if fused:
            return tx.update_and_apply(grads, state, params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    compiled = jax.jit(step, donate_argnums=(0, 1) if donate else ()).lower(
        params, tx.init(params), grads).compile()
    hlo = compiled.as_text()
    big = ("f32[256,384]", "f32[384,256]")
    copies = [line for line in hlo.splitlines() if " copy(" in line and any(s in line for s in big)]
    assert not copies, copies[:3]

    def adam_step(params, state, grads):
        updates, state = optax.adam(1e-3).update(grads, state, params)
        return optax.apply_updates(params, updates), state

    plain = jax.jit(adam_step, donate_argnums=(0, 1) if donate else ()).lower(
        params, optax.adam(1e-3).init(params), grads).compile()
    ratio = _bytes_accessed(compiled) / _bytes_accessed(plain)
    # One extra read of the grads (+0.1x of adam's ~10 passes); update + apply
    # also writes the updates out and reads them back (+0.2x).
    assert ratio <= (1.13 if fused else 1.33), ratio


def _bytes_accessed(compiled):
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return cost["bytes accessed"]


def test_donated_must_be_a_bool():
    with pytest.raises(TypeError, match="donated must be True"):
        jmp_policy.loss_scaling(optax.sgd(0.1), "dynamic", donated="no")
