"""Tests for loss scaling (jmp_policy.optim): loss_scaling, get_loss_scale, scaled_value_and_grad."""

import functools

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


def test_update_is_one_cond_with_no_host_round_trip():
    params = make_params()
    tx = jmp_policy.loss_scaling(optax.adam(1e-3), "dynamic")
    closed = jax.make_jaxpr(tx.update)(grads_like(params, 1.0), tx.init(params), params)
    names = {e.primitive.name for e in _all_primitives(closed.jaxpr)}
    assert not {n for n in names if "callback" in n or "feed" in n or n == "device_put"}
    assert [e.primitive.name for e in closed.jaxpr.eqns].count("cond") == 1
    # The finiteness check writes no per-element boolean mask.
    assert all(e.outvars[0].aval.shape == () for e in _all_primitives(closed.jaxpr)
               if e.primitive.name == "is_finite")


def test_update_traces_the_inner_optimizer_once():
    calls = []
    adam = optax.adam(1e-3)

    def update(updates, state, params=None):
        calls.append(1)
        return adam.update(updates, state, params)

    tx = jmp_policy.loss_scaling(optax.GradientTransformation(adam.init, update), "dynamic")
    params = make_params()
    jax.make_jaxpr(tx.update)(grads_like(params, 1.0), tx.init(params), params)
    assert len(calls) == 1


# ---------------------------------------------------------------------------
# get_loss_scale.


def _ls(inner):
    return jmp_policy.loss_scaling(inner, DynamicLossScale(256.0))


# Compositions in which loss_scaling is the first to see the gradients.
RIGHT_COMPOSITIONS = {
    "alone": lambda: _ls(optax.sgd(0.1)),
    "chain, first": lambda: optax.chain(_ls(optax.sgd(0.1)), optax.identity()),
    "chain of one": lambda: optax.chain(_ls(optax.sgd(0.1))),
    "named_chain, first": lambda: optax.named_chain(("z", _ls(optax.sgd(0.1))), ("a", optax.identity())),
    "clip inside": lambda: _ls(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))),
    "MultiSteps inside": lambda: _ls(optax.MultiSteps(optax.adam(0.1), every_k_schedule=2)),
    "inject_hyperparams": lambda: optax.inject_hyperparams(lambda learning_rate: _ls(optax.sgd(learning_rate)))(learning_rate=0.1),
    "masked": lambda: optax.masked(_ls(optax.sgd(0.1)), {"w": True}),
    "nested chains": lambda: optax.chain(optax.chain(_ls(optax.sgd(0.1)), optax.identity()), optax.identity()),
    "apply_if_finite inside": lambda: _ls(optax.apply_if_finite(optax.sgd(0.1), 3)),
}

# Compositions in which another transformation sees the scaled gradients first.
WRONG_COMPOSITIONS = {
    "MultiSteps outside": (lambda: optax.MultiSteps(_ls(optax.sgd(0.1)), every_k_schedule=2),
                           r"opt_state\.inner_opt_state .*inside optax\.MultiSteps.*"
                           r"jmp_policy\.loss_scaling\(optax\.MultiSteps\(inner"),
    "clip before": (lambda: optax.chain(optax.clip(1.0), _ls(optax.sgd(0.1))),
                    r"opt_state\[1\] .*after 1 other transformation in an optax\.chain "
                    r"\(state opt_state\[0\]\).*jmp_policy\.loss_scaling\(optax\.chain\("),
    "clip_by_global_norm before": (
        lambda: optax.chain(optax.clip_by_global_norm(1.0), _ls(optax.sgd(0.1))),
        r"optax\.chain.*loss_scaling\(optax\.chain\("),
    "named_chain, second": (
        lambda: optax.named_chain(("clip", optax.clip(1.0)), ("ls", _ls(optax.sgd(0.1)))),
        r"opt_state\['ls'\] .*optax\.named_chain \(state opt_state\['clip'\]\)"),
    "stateful before": (lambda: optax.chain(optax.zero_nans(), optax.identity(), _ls(optax.sgd(0.1))),
                        r"after 2 other transformations .*opt_state\[0\], opt_state\[1\]"),
    "in inject_hyperparams, after a clip": (
        lambda: optax.inject_hyperparams(
            lambda learning_rate: optax.chain(optax.clip(1.0), _ls(optax.sgd(learning_rate))))(learning_rate=0.1),
        r"opt_state\.inner_state\[1\]"),
    "apply_if_finite outside": (lambda: optax.apply_if_finite(_ls(optax.sgd(0.1)), 3),
                                r"opt_state\.inner_state .*inside optax\.apply_if_finite.*"
                                r"jmp_policy\.loss_scaling\(optax\.apply_if_finite\(inner"),
    "apply_if_finite around a chain": (
        lambda: optax.chain(optax.apply_if_finite(optax.chain(_ls(optax.sgd(0.1)), optax.identity()), 3)),
        r"opt_state\[0\]\.inner_state\[0\] .*apply_if_finite"),
    "MultiSteps around a chain": (
        lambda: optax.chain(optax.MultiSteps(optax.chain(optax.identity(), _ls(optax.sgd(0.1))), every_k_schedule=3)),
        r"opt_state\[0\]\.inner_opt_state\[1\] .*MultiSteps"),
}


@pytest.mark.parametrize("build", RIGHT_COMPOSITIONS.values(), ids=RIGHT_COMPOSITIONS.keys())
def test_get_loss_scale_finds_the_state_of_every_right_composition(build):
    tx = build()
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    assert float(jmp_policy.get_loss_scale(state).loss_scale) == 256.0

    @jax.jit
    def step(state, g):
        updates, state = tx.update({"w": g}, state, params)
        return jmp_policy.get_loss_scale(state).loss_scale, state

    scale, state = step(state, jnp.full(2, jnp.inf))
    assert float(scale) == 128.0  # the overflow reached loss_scaling
    assert int(jmp_policy.optim.loss_scaling_state(state).skipped_steps) == 1


@pytest.mark.parametrize("build, match", WRONG_COMPOSITIONS.values(), ids=WRONG_COMPOSITIONS.keys())
def test_get_loss_scale_refuses_a_composition_that_feeds_loss_scaling_transformed_gradients(build, match):
    tx = build()
    state = tx.init({"w": jnp.ones(2)})
    with pytest.raises(ValueError, match=match):
        jmp_policy.get_loss_scale(state)
    with pytest.raises(ValueError, match=match):  # under jit too: the check is on the structure
        jax.jit(jmp_policy.get_loss_scale)(state)


@pytest.mark.parametrize("build", [
    lambda: optax.masked(_ls(optax.sgd(0.1)), {"w": True, "b": False}),
    lambda: optax.multi_transform({"a": _ls(optax.sgd(0.1)), "b": optax.sgd(0.1)},
                                  {"w": "a", "b": "b"}),
], ids=["masked, some parameters", "multi_transform"])
def test_loss_scaling_handed_only_some_parameters_is_refused(build):
    # Unrefused, "b" would be updated with its gradient still times the loss scale.
    with pytest.raises(ValueError, match=r"inside optax\.masked or optax\.multi_transform.*"
                                         r"\['b'\].*loss_scaling\(optax\.multi_transform"):
        build().init({"w": jnp.ones(2), "b": jnp.ones(2)})


def test_loss_scaling_around_multi_transform_unscales_every_partition():
    tx = _ls(optax.multi_transform({"a": optax.sgd(0.1), "b": optax.sgd(0.2)},
                                   {"w": "a", "b": "b"}))
    params = {"w": jnp.ones(2), "b": jnp.ones(2)}
    state = tx.init(params)
    scale = float(jmp_policy.get_loss_scale(state).loss_scale)
    updates, _ = jax.jit(tx.update)({"w": jnp.full(2, scale), "b": jnp.full(2, scale)}, state)
    np.testing.assert_allclose(updates["w"], -0.1)
    np.testing.assert_allclose(updates["b"], -0.2)


def _train(tx, micro_grads, params):
    """Jitted train steps (the loss's gradient is the batch), one per micro-batch."""
    loss_fn = lambda p, x: jnp.sum(p["w"] * x)

    @jax.jit
    def step(params, opt_state, x):
        scale = jmp_policy.get_loss_scale(opt_state)
        _, grads = jmp_policy.scaled_value_and_grad(loss_fn)(scale, params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    state, history = tx.init(params), []
    for x in micro_grads:
        params, state = step(params, state, jnp.asarray(x, jnp.float32))
        history.append((params, state))
    return history


def test_multisteps_outside_loss_scaling_is_poisoned_by_one_overflow_and_refused():
    # What the refusal prevents: MultiSteps accumulates the scaled gradients and
    # keeps a non-finite micro-step in its accumulator (0 * inf is nan), so
    # every later accumulated step is skipped.
    tx = optax.MultiSteps(jmp_policy.loss_scaling(optax.sgd(1.0), 4.0), every_k_schedule=2)
    state, upd = tx.init({"w": jnp.ones(2)}), jax.jit(tx.update)
    for i in range(8):
        updates, state = upd({"w": jnp.full(2, np.inf if i == 1 else 4.0)}, state)
    inner = jmp_policy.optim._loss_scaling._loss_scaling_states(state)[0]
    assert int(inner.skipped_steps) == 4  # 4 of 4 accumulated steps skipped
    assert not np.isfinite(state.acc_grads["w"]).any()
    with pytest.raises(ValueError, match=r"loss_scaling\(optax\.MultiSteps\(inner"):
        jmp_policy.get_loss_scale(state)


def test_apply_if_finite_outside_loss_scaling_keeps_the_overflowing_scale_and_is_refused():
    # What the refusal prevents: apply_if_finite skips the overflowing steps before
    # loss_scaling sees them, so the scale that overflows is kept for the next step.
    tx = optax.apply_if_finite(_ls(optax.sgd(1.0)), max_consecutive_errors=3)
    state, upd = tx.init({"w": jnp.ones(2)}), jax.jit(tx.update)
    for _ in range(3):
        _, state = upd({"w": jnp.full(2, np.inf)}, state)
    inner = state.inner_state  # the LossScalingState
    assert float(inner.loss_scale.loss_scale) == 256.0 and int(inner.skipped_steps) == 0
    with pytest.raises(ValueError, match=r"drop apply_if_finite"):
        jmp_policy.get_loss_scale(state)
    # Around it, each overflow halves the scale.
    tx = _ls(optax.apply_if_finite(optax.sgd(1.0), max_consecutive_errors=3))
    state, upd = tx.init({"w": jnp.ones(2)}), jax.jit(tx.update)
    for _ in range(3):
        _, state = upd({"w": jnp.full(2, np.inf)}, state)
    assert float(jmp_policy.get_loss_scale(state).loss_scale) == 32.0


def test_loss_scaling_around_multisteps_skips_only_the_overflowing_micro_step():
    k = 2
    micro = [[1.0, -2.0], [np.inf, 0.0], [3.0, -4.0], [5.0, 6.0], [7.0, -8.0], [np.nan, 1.0], [1.0, 1.0]]
    params = {"w": jnp.ones(2)}
    tx = jmp_policy.loss_scaling(optax.MultiSteps(optax.adam(0.1), every_k_schedule=k),
                                 DynamicLossScale(2.0**10, period=2))
    history = _train(tx, micro, params)
    scales = [float(s.loss_scale.loss_scale) for _, s in history]
    # Each micro-step adjusts the scale: halved by each overflow, doubled after 2 finite ones.
    assert scales == [2.0**10, 2.0**9, 2.0**9, 2.0**10, 2.0**10, 2.0**9, 2.0**9]
    assert [int(s.skipped_steps) for _, s in history] == [0, 1, 1, 1, 1, 2, 2]
    assert [int(s.inner_state.mini_step) for _, s in history] == [1, 1, 0, 1, 0, 0, 1]
    # The reference: MultiSteps(adam) given only the finite micro-steps' (unscaled)
    # gradients, as MultiSteps defines accumulation (their mean over k).
    reference = optax.MultiSteps(optax.adam(0.1), every_k_schedule=k)
    ref_state, ref_params, ref_history = reference.init(params), params, []
    for x in micro:
        if np.isfinite(x).all():
            updates, ref_state = reference.update({"w": jnp.asarray(x)}, ref_state, ref_params)
            ref_params = optax.apply_updates(ref_params, updates)
        ref_history.append(ref_params)
    for (got, _), want in zip(history, ref_history):
        np.testing.assert_allclose(got["w"], want["w"], rtol=1e-6)
    # Two accumulated steps were emitted, each by 0.1 per coordinate (Adam's first step
    # moves each coordinate by the learning rate, in the sign of the mean gradient).
    np.testing.assert_allclose(history[2][0]["w"], [0.9, 1.1], rtol=1e-6)  # means 2 and -3
    assert not np.array_equal(history[4][0]["w"], history[2][0]["w"])
    np.testing.assert_array_equal(history[6][0]["w"], history[4][0]["w"])  # accumulating


def test_clipping_inside_loss_scaling_clips_the_unscaled_gradients():
    params = {"w": jnp.ones(2)}
    g = [0.5, 0.5]  # norm 0.71 < 1: no clipping of the true gradients
    right = jmp_policy.loss_scaling(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.01)))
    (new, _), = _train(right, [g], params)
    np.testing.assert_allclose(new["w"], [0.995, 0.995], rtol=1e-7)  # an update of -0.005
    # The order that clips the scaled gradients (norm 2**15 * 0.71) moves them by 2e-7;
    # its state is refused by get_loss_scale, which every train step calls.
    wrong = optax.chain(optax.clip_by_global_norm(1.0), jmp_policy.loss_scaling(optax.sgd(0.01)))
    with pytest.raises(ValueError, match=r"a clip would clip the gradients times the loss scale"):
        _train(wrong, [g], params)


def test_nnx_optimizer_compositions():
    nnx = pytest.importorskip("flax.nnx")
    import jmp_policy.flax

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(2))

    right = nnx.Optimizer(Model(), _ls(optax.MultiSteps(optax.adam(0.1), 2)), wrt=nnx.Param)
    assert float(jmp_policy.flax.optimizer_loss_scale(right).loss_scale) == 256.0
    assert float(jmp_policy.get_loss_scale(right.opt_state).loss_scale) == 256.0
    wrong = nnx.Optimizer(Model(), optax.chain(optax.clip(1.0), _ls(optax.adam(0.1))), wrt=nnx.Param)
    with pytest.raises(ValueError, match=r"optax\.chain"):
        jmp_policy.flax.optimizer_loss_scale(wrong)


def test_get_loss_scale_inside_inject_hyperparams():
    tx = optax.inject_hyperparams(
        lambda learning_rate: jmp_policy.loss_scaling(optax.sgd(learning_rate), 512.0))(learning_rate=0.1)
    state = tx.init({"w": jnp.ones(2)})
    assert float(jmp_policy.get_loss_scale(state).loss_scale) == 512.0
    _, state = tx.update({"w": jnp.ones(2)}, state)
    assert float(jmp_policy.get_loss_scale(state).loss_scale) == 512.0


def test_get_loss_scale_errors():
    with pytest.raises(ValueError, match="No LossScalingState"):
        jmp_policy.get_loss_scale(optax.adam(1e-3).init({"w": jnp.ones(2)}))
    two = optax.chain(jmp_policy.loss_scaling(optax.sgd(0.1)), jmp_policy.loss_scaling(optax.sgd(0.1)))
    with pytest.raises(ValueError, match="ambiguous"):
        jmp_policy.get_loss_scale(two.init({"w": jnp.ones(2)}))


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
    with pytest.raises(ValueError, match="Unknown loss_scale 'big'"):
        jmp_policy.scaled_value_and_grad(jnp.sum)("big", jnp.ones(3))
    with pytest.raises(TypeError, match="loss_scale must be one of"):
        jmp_policy.scaled_value_and_grad(jnp.sum)([2.0], jnp.ones(3))
    with pytest.raises(TypeError, match=r"\(loss, aux\)"):
        jmp_policy.scaled_value_and_grad(jnp.sum, has_aux=True)(2.0, jnp.ones(3))


@pytest.mark.slow  # a system test: a training run
def test_spec_train_step_trains_in_float16():
    """A complete jitted train step with loss scaling and float16 compute."""
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


def test_axis_name_under_shard_map_keeps_each_leaf_varying_or_invariant():
    # Per-device gradients ("a") next to replicated ones ("b"), and Adam moments of
    # each: a skipped step's zero updates and kept moments must vary where the
    # computed ones do, and only there (check_vma checks the outputs' specs).
    mesh = jax.make_mesh((1,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.sharding.PartitionSpec
    tx = jmp_policy.loss_scaling(optax.adam(0.1), DynamicLossScale(8.0), axis_name="batch")
    params = {"a": jnp.ones((2, 3)), "b": jnp.ones(3)}
    state = tx.init(params)
    per_leaf = lambda path, _: spec("batch") if "'a'" in jax.tree_util.keystr(path) else spec()
    state_specs = jax.tree_util.tree_map_with_path(per_leaf, state)
    tree_specs = {"a": spec("batch"), "b": spec()}

    @jax.jit
    def step(grads, state, params):
        return jax.shard_map(tx.update, mesh=mesh, in_specs=(tree_specs, state_specs, tree_specs),
                             out_specs=(tree_specs, state_specs), check_vma=True)(grads, state, params)

    grads = {"a": jnp.full((2, 3), 8.0), "b": jnp.full(3, 8.0)}
    updates, state = step(grads, state, params)
    np.testing.assert_allclose(updates["b"], np.full(3, -0.1), rtol=1e-4)
    before = state
    updates, state = step({"a": grads["a"].at[0, 0].set(np.inf), "b": grads["b"]}, state, params)
    assert all(np.array_equal(u, np.full_like(u, -0.0)) for u in jax.tree_util.tree_leaves(updates))
    for kept, old in zip(jax.tree_util.tree_leaves(state.inner_state),
                         jax.tree_util.tree_leaves(before.inner_state)):
        np.testing.assert_array_equal(kept, old)
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


# ---------------------------------------------------------------------------
# Skipped steps are bit for bit; donated steps update in place.

_SPECIAL = [0.0, -0.0, 1e-40, -3e-39, 1.5, -2.0**100, 3e38]  # float32 subnormals, signed zero, huge


def _special_tree():
    f32 = jnp.array(_SPECIAL, jnp.float32)
    return {
        "f32": f32.reshape(7, 1) * jnp.ones((7, 3), jnp.float32),
        "bf16": jnp.array([0.0, -0.0, 1e-40, 2.0**-130, 3.0, -1e38], jnp.bfloat16),
        "f16": jnp.array([0.0, -0.0, 6e-8, -3e-5, 65504.0], jnp.float16),
    }


def _assert_same_bits(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        assert x.dtype == y.dtype
        # Bit patterns, not values: -0.0 == 0.0 and subnormals compare loosely.
        np.testing.assert_array_equal(np.asarray(x).view(f"u{x.dtype.itemsize}"),
                                      np.asarray(y).view(f"u{y.dtype.itemsize}"))


@pytest.mark.parametrize("donate", [True, False], ids=["donated", "not-donated"])
def test_a_skipped_step_leaves_params_and_state_bit_for_bit(donate):
    params = _special_tree()
    tx = jmp_policy.loss_scaling(optax.trace(decay=0.9), "dynamic")
    # Inner state full of values an inexact copy would change (subnormals, -0.0).
    state = tx.init(params)._replace(inner_state=optax.TraceState(trace=_special_tree()))
    grads = grads_like(params, 1.0)
    grads["f16"] = grads["f16"].at[2].set(jnp.inf)

    @functools.partial(jax.jit, donate_argnums=(0, 1) if donate else ())
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    # Parameters without subnormals: XLA flushes them to zero in any addition,
    # optax.apply_updates' included, skipped step or not.
    params = jax.tree_util.tree_map(
        lambda x: jnp.where(jnp.abs(x) < jnp.finfo(x.dtype).tiny, x * 0, x), params)
    copy = lambda tree: jax.tree_util.tree_map(jnp.copy, tree)  # noqa: E731
    new_params, new_state = step(copy(params), copy(state), grads)
    _assert_same_bits(new_params, params)  # -0.0 parameters included
    _assert_same_bits(new_state.inner_state, _special_tree())
    assert int(new_state.skipped_steps) == 1


@pytest.mark.parametrize("donate", [True, False], ids=["donated", "not-donated"])
def test_a_donated_step_has_no_parameter_sized_copy(donate, xla_cpu):
    shapes = {"a": (256, 384), "b": (384, 256), "c": (384,)}
    params = {k: jnp.full(s, 0.5) for k, s in shapes.items()}
    grads = {k: jnp.full(s, 0.25) for k, s in shapes.items()}
    tx = jmp_policy.loss_scaling(optax.adam(1e-3), "dynamic")

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def adam_step(params, state, grads):
        updates, state = optax.adam(1e-3).update(grads, state, params)
        return optax.apply_updates(params, updates), state

    donated = dict(donate_argnums=(0, 1)) if donate else {}
    compiled = jax.jit(step, **donated).lower(params, tx.init(params), grads).compile()
    plain = jax.jit(adam_step, **donated).lower(
        params, optax.adam(1e-3).init(params), grads).compile()
    copies = [line for line in compiled.as_text().splitlines()
              if " copy(" in line and ("f32[256,384]" in line or "f32[384,256]" in line)
              and "conditional" not in line]
    if donate:
        # The skip passes params and state through, so XLA updates them in place.
        assert not copies, copies[:3]
        # One more read of the gradients (the check) and the updates written
        # out of the cond and read back by apply_updates.
        assert _bytes_accessed(compiled) <= 1.33 * _bytes_accessed(plain)
    else:
        # Without donation XLA must keep the inputs: the cost the docs warn of.
        assert _bytes_accessed(compiled) <= 1.8 * _bytes_accessed(plain)


def _bytes_accessed(compiled):
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return cost["bytes accessed"]


# ---------------------------------------------------------------------------
# Bad input: errors at construction, clear errors at update.


def test_a_static_scale_of_zero_is_refused():
    with pytest.raises(ValueError, match="every step would be skipped"):
        jmp_policy.loss_scaling(optax.adam(1e-3), 0.0)
    with pytest.raises(ValueError, match="every step would be skipped"):
        jmp_policy.loss_scaling(optax.adam(1e-3), StaticLossScale(0.0))
    assert float(StaticLossScale(0.0).loss_scale) == 0.0  # jmp allows the object itself


@pytest.mark.parametrize("nest", [
    lambda tx: tx,
    lambda tx: tx._replace(init=tx.init),
    lambda tx: optax.chain(optax.clip(1.0), tx),
    lambda tx: optax.MultiSteps(tx, every_k_schedule=2),
], ids=["direct", "_replace", "chain", "MultiSteps"])
def test_nested_loss_scaling_is_refused(nest):
    inner = nest(jmp_policy.loss_scaling(optax.sgd(1.0), 16.0))
    with pytest.raises(ValueError, match="unscaled twice"):
        tx = jmp_policy.loss_scaling(inner, 16.0)
        tx.init({"w": jnp.ones(2)})  # a chain is only seen through its state


@pytest.mark.parametrize("axis_name", [3, ["batch", 3], b"batch", {"batch": 1}])
def test_axis_name_must_be_names(axis_name):
    with pytest.raises(TypeError, match="axis_name must be a mapped axis name"):
        jmp_policy.loss_scaling(optax.sgd(0.1), axis_name=axis_name)
    jmp_policy.loss_scaling(optax.sgd(0.1), axis_name=("data", "model"))


def test_a_state_of_another_optimizer_is_named_as_such():
    params = {"w": jnp.ones(2)}
    sgd_state = jmp_policy.loss_scaling(optax.sgd(0.1)).init(params)
    adam = jmp_policy.loss_scaling(optax.adam(0.1))
    with pytest.raises(ValueError, match="does not belong to this optimizer"):
        adam.update(params, sgd_state, params)


@pytest.mark.parametrize("fake", [
    type("LooksLikeALossScale", (), {"loss_scale": "big", "scale": lambda s, t: t,
                                     "unscale": lambda s, t: t, "adjust": lambda s, f: s})(),
    object(),
    True,
])
def test_only_loss_scales_are_accepted_at_construction(fake):
    with pytest.raises(TypeError, match="loss_scale must be one of"):
        jmp_policy.loss_scaling(optax.sgd(0.1), fake)


def test_integer_gradients_are_an_error_and_float0_passes_through():
    params = {"w": jnp.ones(2), "step": jnp.int32(0)}
    tx = jmp_policy.loss_scaling(optax.sgd(1.0), 4.0)
    state = tx.init({"w": jnp.ones(2)})
    with pytest.raises(TypeError, match=r"\['step'\].*int32.*must be floating"):
        tx.update({"w": jnp.ones(2), "step": jnp.int32(1)}, state)
    # jax.grad with allow_int gives float0 for integer inputs: left alone.
    grads = jax.grad(lambda p: jnp.sum(p["w"]) * 4.0, allow_int=True)(params)
    tx = jmp_policy.loss_scaling(optax.masked(optax.sgd(1.0), {"w": True, "step": False}), 4.0)
    updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_array_equal(updates["w"], [-1.0, -1.0])
    assert updates["step"].dtype == jax.dtypes.float0


def test_a_loss_scale_built_inside_a_jitted_init():
    # optax.inject_hyperparams builds the transformation inside init.
    params = {"w": jnp.ones(2)}
    tx = optax.inject_hyperparams(
        lambda lr: jmp_policy.loss_scaling(optax.sgd(lr), DynamicLossScale(2.0**7, period=5.0))
    )(lr=0.1)
    state = jax.jit(tx.init)(params)
    assert float(jmp_policy.get_loss_scale(state).loss_scale) == 2.0**7
    updates, state = jax.jit(tx.update)({"w": jnp.full(2, 2.0**7)}, state, params)
    np.testing.assert_allclose(updates["w"], [-0.1, -0.1])


def test_scaled_value_and_grad_refuses_an_integer_leaf_as_jax_grad_does():
    params = {"w": jnp.ones(2), "step": jnp.int32(0)}
    loss_fn = lambda p, x: jnp.sum(p["w"] * x)
    with pytest.raises(TypeError, match=r"argument 0 has an integer or boolean leaf at \"\['step'\]\" "
                                        r"\(int32\).*not in argnums"):
        jax.jit(jmp_policy.scaled_value_and_grad(loss_fn))(2.0, params, jnp.ones(2))
    with pytest.raises(TypeError, match=r"argument 1 .*\[1\]"):
        jmp_policy.scaled_value_and_grad(lambda x, p: loss_fn(p[0], x), argnums=1)(
            2.0, jnp.ones(2), ({"w": jnp.ones(2)}, jnp.array([True])))
    # What it says to do: the integer leaf as an argument that is not differentiated.
    loss, grads = jmp_policy.scaled_value_and_grad(lambda p, step: loss_fn(p, step + 1.0))(
        2.0, {"w": jnp.ones(2)}, jnp.int32(1))
    np.testing.assert_array_equal(grads["w"], [4.0, 4.0])


def test_integer_leaves_of_an_equinox_module_get_none_gradients():
    eqx = pytest.importorskip("equinox")

    class Model(eqx.Module):
        w: jax.Array
        ids: jax.Array
        size: int

    model = Model(jnp.ones(2), jnp.arange(3), 3)
    _, grads = jmp_policy.scaled_value_and_grad(lambda m: jnp.sum(m.w * m.size))(2.0, model)
    assert grads.ids is None and grads.size is None
    np.testing.assert_array_equal(grads.w, [6.0, 6.0])
    tx = jmp_policy.loss_scaling(optax.adam(0.1), 2.0)
    trainable = eqx.filter(model, eqx.is_inexact_array)
    updates, _ = jax.jit(tx.update)(grads, tx.init(trainable), trainable)
    new = eqx.apply_updates(model, updates)
    np.testing.assert_allclose(new.w, [0.9, 0.9], rtol=1e-6)
    np.testing.assert_array_equal(new.ids, model.ids)
    # Giving the optimizer the integer leaf too: the error names it (it blamed the state).
    everything = eqx.filter(model, eqx.is_array)
    with pytest.raises(TypeError, match=r"gradient at '\.ids' is None and the parameter there is "
                                        r"int32.*eqx\.is_inexact_array"):
        tx.update(grads, tx.init(everything), everything)
