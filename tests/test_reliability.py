"""Reliability of loss_scaling: fault injection, checkpoint/resume, properties, composition.

Helper B's multi-device / multi-process tests live in their own files; these
run on one CPU device.
"""

import random

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from hypothesis import given, settings, strategies as st

import jmp_policy
from jmp_policy import DynamicLossScale

TINY = float(np.finfo(np.float32).tiny)
POLICY = jmp_policy.Policy("mixed_float16")


# ---------------------------------------------------------------------------
# A small float16-compute regression model.


def init_params(seed=0):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {
        "hidden": {"w": jax.random.normal(k1, (8, 16)) * 0.3, "b": jnp.zeros(16)},
        "out": {"w": jax.random.normal(k2, (16, 1)) * 0.3, "b": jnp.zeros(1)},
    }


def make_data(n=64, seed=1):
    x = jax.random.normal(jax.random.PRNGKey(seed), (n, 8))
    y = jnp.sin(x.sum(axis=1, keepdims=True))
    return x, y


def model(params, x):
    h = jnp.tanh(x @ params["hidden"]["w"] + params["hidden"]["b"])
    return h @ params["out"]["w"] + params["out"]["b"]


def loss_fn(params, x, y):
    pred = POLICY.wrap(model)(params, x)  # float16 compute, float16 output
    return jnp.mean((pred - y.astype(pred.dtype)) ** 2)


def float32_loss(params, x, y):
    return float(jnp.mean((model(params, x) - y) ** 2))


def tree_all_finite_elementwise(tree):
    """Independent of the library: isfinite on every element of every float leaf."""
    leaves = [l for l in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(l.dtype, jnp.floating)]
    return jnp.all(jnp.array([jnp.all(jnp.isfinite(l)) for l in leaves]))


def make_train_step(tx):
    @jax.jit
    def train_step(params, opt_state, x, y, fault):
        scale = jmp_policy.get_loss_scale(opt_state)
        _, grads = jmp_policy.scaled_value_and_grad(loss_fn)(scale, params, x, y)
        genuinely_finite = tree_all_finite_elementwise(grads)
        grads = jax.tree_util.tree_map(jnp.add, grads, fault)  # NaN/inf at one spot, or + 0
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        healthy = tree_all_finite_elementwise((params, opt_state))
        return params, opt_state, genuinely_finite, healthy

    return train_step


# ---------------------------------------------------------------------------
# Fault injection.


@pytest.mark.slow  # a system test: a training run (500 steps)
def test_fault_injection_500_steps():
    rng = random.Random(1234)
    x, y = make_data()
    params0 = init_params()
    # period=4: the scale keeps trying 2**16, where float16 backward overflows,
    # so genuine overflows happen besides the injected faults.
    tx = jmp_policy.loss_scaling(optax.adam(3e-3), DynamicLossScale(2.0**15, period=4))
    train_step = make_train_step(tx)
    zero_fault = jax.tree_util.tree_map(jnp.zeros_like, params0)
    leaves, treedef = jax.tree_util.tree_flatten(zero_fault)

    n_steps = 500
    fault_steps = set(rng.sample(range(n_steps), n_steps // 10))
    params, opt_state = params0, tx.init(params0)
    injected = genuine = 0
    for step in range(n_steps):
        fault = zero_fault
        if step in fault_steps:
            i = rng.randrange(len(leaves))
            bad = rng.choice([np.nan, np.inf, -np.inf])
            flat = np.zeros(leaves[i].size, np.float32)
            flat[rng.randrange(leaves[i].size)] = bad
            fault = jax.tree_util.tree_unflatten(
                treedef, [jnp.asarray(flat.reshape(l.shape)) if j == i else l for j, l in enumerate(leaves)])
            injected += 1
        params, opt_state, genuinely_finite, healthy = train_step(params, opt_state, x, y, fault)
        assert bool(healthy), f"non-finite value in params or optimizer state at step {step}"
        genuine += step not in fault_steps and not bool(genuinely_finite)
        # The transform's verdict matches the independent one on every step.
        assert bool(opt_state.grads_finite) == (step not in fault_steps and bool(genuinely_finite))

    assert injected == 50 and genuine > 0
    assert int(opt_state.skipped_steps) == injected + genuine
    applied = n_steps - int(opt_state.skipped_steps)

    # An uninterrupted run (same transform, no injected faults) applying as many updates.
    ref_params, ref_state, ref_applied = params0, tx.init(params0), 0
    while ref_applied < applied:
        ref_params, ref_state, _, _ = train_step(ref_params, ref_state, x, y, zero_fault)
        ref_applied += bool(ref_state.grads_finite)
    final, reference = float32_loss(params, x, y), float32_loss(ref_params, x, y)
    assert final < 0.5 * float32_loss(params0, x, y)  # it did train
    assert abs(final - reference) <= 0.05 * reference


# ---------------------------------------------------------------------------
# Checkpoint and resume.


def test_orbax_round_trip_and_bit_identical_resume(tmp_path):
    x, y = make_data()
    tx = jmp_policy.loss_scaling(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
        DynamicLossScale(2.0**15, period=2, min_loss_scale=0.5, max_loss_scale=2.0**15))
    train_step = make_train_step(tx)
    params0 = init_params()
    zero = jax.tree_util.tree_map(jnp.zeros_like, params0)
    nan = jax.tree_util.tree_map(lambda z: z.at[(0,) * z.ndim].set(jnp.nan), zero)
    faults = [zero, zero, nan, zero, zero, zero, nan, zero, zero, zero]

    def run(params, opt_state, steps):
        for fault in steps:
            params, opt_state, _, _ = train_step(params, opt_state, x, y, fault)
        return params, opt_state

    state = run(params0, tx.init(params0), faults[:5])
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "ckpt", jax.eval_shape(lambda: state))

    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(state)
    restored_scale = jmp_policy.get_loss_scale(restored[1])
    assert (restored_scale.period, restored_scale.min_loss_scale, restored_scale.max_loss_scale) == (2, 0.5, 2.0**15)
    for a, b in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(state)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)

    resumed = run(*restored, faults[5:])
    never_stopped = run(*state, faults[5:])
    assert int(never_stopped[1].skipped_steps) == 2
    for a, b in zip(jax.tree_util.tree_leaves(resumed), jax.tree_util.tree_leaves(never_stopped)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("loss_scale", [128.0, None], ids=["static", "none"])
def test_orbax_round_trip_of_leafless_loss_scales(tmp_path, loss_scale):
    tx = jmp_policy.loss_scaling(optax.sgd(0.1, momentum=0.9), loss_scale)
    params = {"w": jnp.arange(3.0)}
    state = tx.update({"w": jnp.ones(3)}, tx.init(params), params)[1]
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "ckpt", jax.eval_shape(lambda: state))
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(state)
    assert jmp_policy.get_loss_scale(restored) == jmp_policy.get_loss_scale(state)
    for a, b in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(state)):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------
# Properties of the dynamic scale.


@st.composite
def scale_settings(draw):
    initial = 2.0 ** draw(st.integers(-30, 100)) * draw(st.sampled_from([1.0, 1.5, 0.7]))
    factor = draw(st.sampled_from([1.5, 2, 3, 8, 1000]))
    min_scale = min(draw(st.sampled_from([0.0, 1e-30, 1e-3, 1.0, 2.0**20])), initial)
    max_scale = draw(st.one_of(st.none(), st.floats(1.0, 2.0**40).map(lambda m: max(m, initial))))
    period = draw(st.integers(1, 6))
    return dict(loss_scale=initial, period=period, factor=factor,
                min_loss_scale=min_scale, max_loss_scale=max_scale)


@settings(max_examples=60, deadline=None)
@given(config=scale_settings(), finite_steps=st.lists(st.booleans(), max_size=80))
def test_scale_stays_finite_and_within_bounds(config, finite_steps):
    ls = DynamicLossScale(**config)
    # Bounds as float32, the precision the scale lives in.
    low = max(float(np.float32(config["min_loss_scale"])), TINY)
    high = float(np.float32(config["max_loss_scale"] or np.finfo(np.float32).max))
    for finite in finite_steps:
        ls = ls.adjust(jnp.asarray(finite))
        value = float(ls.loss_scale)
        assert ls.loss_scale.dtype == jnp.float32
        assert np.isfinite(value) and low <= value <= high
        assert 0 <= int(ls.counter) < config["period"]


_SEQUENCE_TX = jmp_policy.loss_scaling(
    optax.adam(1e-2), DynamicLossScale(2.0**4, period=2, min_loss_scale=0.25, max_loss_scale=2.0**6))


@jax.jit
def _sequence_step(params, state, finite):
    grads = {"w": jnp.where(finite, jnp.ones(4), jnp.nan), "b": jnp.ones(2, jnp.bfloat16)}
    updates, new_state = _SEQUENCE_TX.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    return params, new_state, tree_all_finite_elementwise((params, new_state))


@settings(max_examples=25, deadline=None)
@given(finite_steps=st.lists(st.booleans(), min_size=1, max_size=40))
def test_transform_over_random_finite_non_finite_sequences(finite_steps):
    params = {"w": jnp.ones(4), "b": jnp.zeros(2, jnp.bfloat16)}
    state = _SEQUENCE_TX.init(params)
    for finite in finite_steps:
        previous = jax.device_get(state.inner_state)
        params, state, healthy = _sequence_step(params, state, finite)
        scale = float(state.loss_scale.loss_scale)
        assert bool(healthy) and np.isfinite(scale) and 0.25 <= scale <= 2.0**6
        if not finite:  # a skipped step leaves the inner state bit-for-bit unchanged
            for a, b in zip(jax.tree_util.tree_leaves(state.inner_state), jax.tree_util.tree_leaves(previous)):
                np.testing.assert_array_equal(a, b)
    assert int(state.skipped_steps) == finite_steps.count(False)
    assert int(state.inner_state[0].count) == finite_steps.count(True)


# ---------------------------------------------------------------------------
# Composition with optax: clipping sees unscaled grads; MultiSteps.


def record_global_norm():
    """An identity transformation whose state is the global norm it last saw."""
    return optax.GradientTransformation(
        lambda params: jnp.zeros((), jnp.float32),
        lambda updates, state, params=None: (updates, optax.tree.norm(updates)),
    )


@pytest.mark.parametrize("unscaled_norm", [0.5, 3.0])
def test_clipping_inside_loss_scaling_sees_unscaled_grads(unscaled_norm):
    params = {"a": jnp.ones(3), "b": jnp.ones((2, 2))}
    direction = {"a": jnp.array([1.0, -2.0, 2.0]), "b": jnp.array([[0.0, 4.0], [0.0, 0.0]])}
    grads = jax.tree_util.tree_map(lambda d: d * unscaled_norm / 5.0, direction)  # norm(direction) = 5
    inner = optax.chain(optax.clip_by_global_norm(1.0), record_global_norm(), optax.adamw(1e-2))
    tx = jmp_policy.loss_scaling(inner, DynamicLossScale(2.0**15))
    scaled = jax.tree_util.tree_map(lambda g: g * 2.0**15, grads)

    updates, state = jax.jit(tx.update)(scaled, tx.init(params), params)
    seen_norm = float(state.inner_state[1])
    assert seen_norm == pytest.approx(min(unscaled_norm, 1.0), rel=1e-6)
    expected, _ = jax.jit(inner.update)(grads, inner.init(params), params)
    for u, e in zip(jax.tree_util.tree_leaves(updates), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(u, e, rtol=1e-6)


def test_loss_scaling_as_the_inner_of_multisteps_is_poisoned_and_refused():
    params = {"w": jnp.zeros(2)}
    inner = optax.chain(optax.clip_by_global_norm(10.0), record_global_norm(), optax.sgd(1.0))
    tx = optax.MultiSteps(jmp_policy.loss_scaling(inner, DynamicLossScale(2.0**10)), every_k_schedule=2)
    state = tx.init(params)
    step = jax.jit(tx.update)

    def scaled(values):
        return {"w": jnp.asarray(values, jnp.float32) * state.inner_opt_state.loss_scale.loss_scale}

    # Window 1: the mean of the unscaled micro-grads is applied; clipping saw it unscaled.
    updates, state = step(scaled([1.0, 2.0]), state, params)
    np.testing.assert_array_equal(updates["w"], [0.0, 0.0])
    updates, state = step(scaled([3.0, 4.0]), state, params)
    np.testing.assert_allclose(updates["w"], [-2.0, -3.0])
    params = optax.apply_updates(params, updates)

    # Window 2 has a NaN micro-step: optax's MultiSteps keeps it in its accumulator
    # (`0 * nan`), so windows 3 and 4, all finite, are skipped too.
    for micro in ([1.0, 2.0], [np.nan, 0.0], [1.0, 2.0], [1.0, 2.0], [1.0, 2.0], [1.0, 2.0]):
        updates, state = step(scaled(micro), state, params)
        np.testing.assert_array_equal(updates["w"], [0.0, 0.0])
    assert int(state.inner_opt_state.skipped_steps) == 3
    # Hence get_loss_scale, which every train step calls, refuses this order.
    with pytest.raises(ValueError, match=r"jmp_policy\.loss_scaling\(optax\.MultiSteps\(inner"):
        jmp_policy.get_loss_scale(state)


def test_multisteps_inside_loss_scaling_trains_through_overflows():
    params = {"w": jnp.zeros(2)}
    inner = optax.MultiSteps(
        optax.chain(optax.clip_by_global_norm(10.0), record_global_norm(), optax.sgd(1.0)),
        every_k_schedule=2)
    tx = jmp_policy.loss_scaling(inner, DynamicLossScale(2.0**10))
    state = tx.init(params)
    step = jax.jit(tx.update)
    applied = []
    for micro in ([1.0, 2.0], [np.nan, 0.0], [3.0, 4.0], [np.inf, 1.0], [5.0, 6.0], [7.0, 8.0]):
        grads = {"w": jnp.asarray(micro, jnp.float32) * jmp_policy.get_loss_scale(state).loss_scale}
        updates, state = step(grads, state, params)
        applied.append(np.asarray(updates["w"]))
    # Non-finite micro-steps never reach the accumulator; each window averages two finite ones.
    np.testing.assert_allclose(applied[2], [-2.0, -3.0])
    np.testing.assert_allclose(applied[5], [-6.0, -7.0])
    for i in (0, 1, 3, 4):
        np.testing.assert_array_equal(applied[i], [0.0, 0.0])
    assert int(state.skipped_steps) == 2
    assert float(jmp_policy.get_loss_scale(state).loss_scale) == 2.0**8
    assert float(state.inner_state.inner_opt_state[1]) == pytest.approx(np.hypot(6.0, 7.0))
