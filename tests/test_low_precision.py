"""bfloat16 parameters and optimizer states: low_precision_params, cast_state, master_params."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_policy
from support.compiled_kernels import step_kernels
from support.excess_precision import with_excess_precision

METHODS = ["kahan", "stochastic", "split"]
BF16 = jnp.bfloat16
EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples")


def bits(x):
    x = np.asarray(x)
    return x.view(f"uint{8 * x.dtype.itemsize}")


def assert_bitwise_equal(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(bits(x), bits(y))


def ulp(x, dtype=BF16):
    """The spacing of ``dtype`` at ``x`` (away from zero)."""
    x = jnp.asarray(x).astype(dtype)
    up = jnp.nextafter(x, jnp.asarray(jnp.inf, dtype))
    return (up.astype(jnp.float32) - x.astype(jnp.float32))


def step(tx, params, grads, state):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


# XLA:CPU keeps every rounding; XLA:GPU under jit drops narrowing round trips
# (tests/support/excess_precision.py). The methods must be exact either way.
COMPILERS = {"jit": jax.jit, "jit, excess precision as on a GPU":
             lambda f: jax.jit(with_excess_precision(f))}
compilers = pytest.mark.parametrize("compile", list(COMPILERS.values()), ids=list(COMPILERS))


# --------------------------------------------------------------------------- #
# Exactness.
# --------------------------------------------------------------------------- #

def _load_digits_example():
    spec = importlib.util.spec_from_file_location(
        "_example_train_digits", os.path.join(EXAMPLES, "train_digits.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # flax modules are dataclasses: they look their module up
    spec.loader.exec_module(module)
    return module


def _high_half(x):
    """float32 -> its high 16 bits, as float32 (the weight "split" shows the model)."""
    return jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000), jnp.float32)


@pytest.mark.slow  # a system test: 100 steps of the digits example's CNN
def test_split_reproduces_float32_master_training_bit_for_bit(xla_cpu):
    """100 steps of the digits CNN: split's rebuilt float32 weights equal float32 master weights.

    The reference keeps float32 weights and float32 AdamW and runs the model
    (bfloat16 compute) on the weights' high halves, the weights "split" hands
    the model; its gradient is the model's, passed straight through.

    Two programs agree bit for bit where the compiler rounds alike in both:
    XLA:CPU does; XLA:GPU fuses each copy of the model and of AdamW on its own
    (excess precision, contracted multiply-adds), and on a GPU the two runs drift
    apart. Hence the CPU backend, on every machine.
    """
    pytest.importorskip("flax")
    pytest.importorskip("sklearn")
    digits = _load_digits_example()
    x_train, _, y_train, _ = digits.load_data()
    policy = jmp_policy.Policy("params=bfloat16,compute=bfloat16")
    model = digits.CNN(policy, width=8)
    # Random weights drawn with NumPy: compiling Flax's initializers takes longer than training.
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8, 8, 1)))["params"]
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: jnp.asarray(
        rng.normal(0, np.prod(s.shape[:-1]) ** -0.5 if len(s.shape) > 1 else 0.01, s.shape), BF16),
        shapes)
    batches = np.random.RandomState(0).randint(0, len(x_train), (100, 32))
    xs, ys = jnp.asarray(x_train[batches]), jnp.asarray(y_train[batches])

    def loss(params, x, y):
        logits = model.apply({"params": params}, x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def reference_loss(master, x, y):
        shown = jax.tree.map(lambda w: (w + jax.lax.stop_gradient(_high_half(w) - w)).astype(BF16),
                             master)
        return loss(shown, x, y)

    inner = optax.adamw(3e-3, weight_decay=1e-2)
    tx = jmp_policy.low_precision_params(inner, "split")

    @jax.jit
    def train(params):
        def body(carry, batch):
            (params, state), (master, reference) = carry
            params, state = step(tx, params, jax.grad(loss)(params, *batch), state)
            master, reference = step(inner, master, jax.grad(reference_loss)(master, *batch),
                                     reference)
            return ((params, state), (master, reference)), None

        master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        init = ((params, tx.init(params)), (master, inner.init(master)))
        (params, state), (master, reference) = jax.lax.scan(body, init, (xs, ys))[0]
        high_halves = jax.tree.map(lambda w: _high_half(w).astype(BF16), master)
        return (params, high_halves), (state.inner_state, reference), (
            jmp_policy.master_params(params, state), master)

    weights, moments, masters = train(params)
    for split_run, reference_run in (weights, moments, masters):
        assert_bitwise_equal(split_run, reference_run)
    assert not np.array_equal(masters[0]["Dense_0"]["kernel"], weights[0]["Dense_0"]["kernel"])


@compilers
def test_kahan_sums_updates_below_the_rounding_threshold(compile):
    """10**4 updates, each below half a bfloat16 ulp of its weight: Kahan against round to nearest.

    Kahan's weights end within 0.6 ulp of the float32 sum; stochastic rounding, unbiased
    but uncompensated, ends 52 ulp away (10**4 steps of a while loop: 0.6 s, 10**5: 4 s).
    """
    n, steps = 256, 10_000
    rng = np.random.default_rng(0)
    w0 = jnp.asarray(rng.choice([-1, 1], n) * 10.0 ** rng.uniform(-3, 3, n), BF16)
    kahan = jmp_policy.low_precision_params(optax.identity(), "kahan")
    nearest = optax.identity()  # plain bfloat16 weights

    @compile
    def run(w0):
        def body(k, carry):
            (w, state), (v, plain), total = carry
            r = jax.random.uniform(jax.random.fold_in(jax.random.key(1), k), (n,), jnp.float32,
                                   -1.0, 1.0)
            # |u| <= 1.1 * 2**-10 |w0| < 2**-9 |w| <= half an ulp of w: a drift that
            # doubles the weight, plus a random walk around it.
            u = w0.astype(jnp.float32) * 2.0**-10 * (r + 0.1)
            return step(kahan, w, u, state), step(nearest, v, u, plain), total + u

        init = ((w0, kahan.init(w0)), (w0, nearest.init(w0)), w0.astype(jnp.float32))
        (w, _), (v, _), total = jax.lax.fori_loop(0, steps, body, init)
        return w, v, total

    w, v, total = run(w0)
    assert_bitwise_equal(v, w0)  # round to nearest never moves
    assert np.all(np.abs(total / w0.astype(jnp.float32) - 1) > 0.2)  # float32 moved a lot
    np.testing.assert_array_less(np.abs(w.astype(jnp.float32) - total), 2 * ulp(total))


@compilers
@pytest.mark.parametrize("dtype", [BF16, jnp.float16])
def test_stochastic_rounding_is_unbiased(dtype, compile):
    n = 2**18
    base = jnp.asarray([1.0, -3.0, 0.0078125, 1000.0], dtype)
    # Targets at fractions 1/2, 1/3 (inexact), 1/65536 and 1 - 2**-8 of an ulp above the base.
    fractions = jnp.asarray([0.5, 1 / 3, 2.0**-16, 1 - 2.0**-8])
    target = base.astype(jnp.float32) + fractions * ulp(base, dtype)
    params = {f"w{i}": jnp.full(n, b, dtype) for i, b in enumerate(base)}
    grads = {f"w{i}": jnp.full(n, t - b.astype(jnp.float32)) for i, (b, t) in
             enumerate(zip(base, target))}
    tx = jmp_policy.low_precision_params(optax.identity(), "stochastic", seed=3)
    new, _ = compile(functools.partial(step, tx))(params, grads, tx.init(params))
    for i, (b, t, f) in enumerate(zip(base, target, fractions)):
        values = np.asarray(new[f"w{i}"].astype(jnp.float32), np.float64)
        low, high = float(b.astype(jnp.float32)), float(b.astype(jnp.float32) + ulp(b, dtype))
        assert set(np.unique(values)) <= {low, high}
        # Each rounding is low + ulp * Bernoulli(f): the mean (taken in float64) is within
        # 5 standard deviations of the target, a false alarm once in 1.7 million runs.
        sigma = float(ulp(b, dtype)) * np.sqrt(float(f) * (1 - float(f)) / n)
        assert abs(values.mean() - float(t)) <= 5 * sigma


def test_stochastic_rounding_is_reproducible_and_differs_across_steps():
    params = {"w": jnp.ones(4096, BF16)}
    grads = {"w": jnp.full(4096, 2.0**-9)}  # half an ulp: up or down at even odds

    def two_steps(seed):
        # The seed sets the key in the state: one compiled update serves every seed.
        state = jmp_policy.low_precision_params(optax.identity(), "stochastic", seed=seed).init(
            params)
        return run(params, state)

    tx = jmp_policy.low_precision_params(optax.identity(), "stochastic")

    @jax.jit
    def run(params, state):
        first, next_state = step(tx, params, grads, state)
        # Same inputs, next key; the weights are not those the first step produced,
        # so the state that saw no update yet says what to expect of them: nothing.
        second, _ = step(tx, params, grads, next_state._replace(landed=state.landed))
        return first["w"], second["w"]

    a1, a2 = two_steps(0)
    b1, b2 = two_steps(0)
    c1, _ = two_steps(1)
    assert_bitwise_equal((a1, a2), (b1, b2))
    assert not np.array_equal(a1, a2)
    assert not np.array_equal(a1, c1)


# Adversarial float32 values: signed zeros, subnormals, the smallest and largest
# normals, powers of two and their neighbours, infinities and NaN.
SPECIAL = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-40, 1.17549435e-38, -1.17549435e-38, 2.4e-38,
                    1.0, -1.0, 1.0 + 2**-23, 1 - 2**-24, 2.0, 0.5, 3.0, 1e-20, 65504.0,
                    3.3895314e38, -3.3895314e38, 3.4028235e38, np.inf, -np.inf, np.nan],
                   np.float32)


def _adversarial_pairs(n=300_000, seed=0):
    """(weights in float32, float32 updates): random, cancelling, huge, tiny, special."""
    rng = np.random.default_rng(seed)
    w = (rng.choice([-1, 1], n) * 2.0 ** rng.uniform(-130, 128, n)).astype(np.float32)
    w[: len(SPECIAL) ** 2] = np.repeat(SPECIAL, len(SPECIAL))
    u = (rng.choice([-1, 1], n) * 2.0 ** rng.uniform(-140, 128, n)).astype(np.float32)
    u[: len(SPECIAL) ** 2] = np.tile(SPECIAL, len(SPECIAL))
    # Cancellations: u = -w plus a few float32 ulps of w, or scaled by 1 +- 2**-k.
    k = rng.integers(1, 4, n)
    cancel = k == 1
    scale = 1 + rng.choice([-1, 1], cancel.sum()) * 2.0 ** -rng.uniform(8, 30, cancel.sum())
    with np.errstate(over="ignore"):  # -w * scale may overflow to inf: one more special value
        u[cancel] = -w[cancel] * scale
    near = k == 2
    steps = rng.integers(-3000, 3000, near.sum()).astype(np.int32)
    u[near] = ((-w[near]).view(np.int32) + steps).view(np.float32)
    return w, u


def _unreachable(p, new):
    """Where apply_updates cannot move bfloat16 ``p`` to ``new`` with a float32 update on XLA:CPU.

    A -0.0 from any other value; subnormal results and differences (flushed
    to zero); a difference beyond float32's range; anything from inf or NaN.
    """
    p32, new32 = p.astype(np.float32), new.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        difference = new32.astype(np.float64) - p32.astype(np.float64)
    negative_zero = (bits(new) == 0x8000) & (bits(p) != 0x8000)
    subnormal = (np.abs(new32) < 2.0**-126) & (new32 != 0)
    tiny = (np.abs(difference) < 2.0**-126) & (difference != 0)
    return (negative_zero | subnormal | tiny | (np.abs(difference) > 3.4028235e38)
            | ~np.isfinite(p32))


@pytest.mark.parametrize("method", METHODS)
def test_apply_updates_lands_exactly_on_the_new_value(method, xla_cpu):
    w, u = _adversarial_pairs()
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    if method == "split":
        # Float32 master weights w, stored as a bfloat16 high half plus low bits.
        tx = jmp_policy.low_precision_params(optax.identity(), "split")
        p, low = _high_half(f32(w)).astype(BF16), (bits(w) & 0xFFFF).astype(np.uint16)
        state = tx.init(p)._replace(low_bits=jnp.asarray(low))
        new, state = jax.jit(step, static_argnums=0)(tx, p, f32(u), state)
        master = jmp_policy.master_params(new, state)
        expected = jax.jit(jnp.add)(f32(w), f32(u))  # what float32 master weights become
        # Every value float32 weights reach, split reaches bit for bit (NaNs as NaNs)...
        same = (bits(master) == bits(expected)) | (np.isnan(master) & np.isnan(expected))
        # ...but -0.0, which an underflow flushed to zero can be and no addition can
        # reach from another value: the rebuilt weight is +0.0.
        signed_zero = (bits(expected) == 0x80000000) & (bits(master) == 0) & (bits(p) != 0x8000)
        assert (same | signed_zero).all(), (w[~same][:5], u[~same][:5])
        assert signed_zero.mean() < 0.05
        return
    p = np.asarray(jnp.asarray(w, BF16))
    tx = jmp_policy.low_precision_params(optax.identity(), method, seed=0)
    state = tx.init(jnp.asarray(p))
    updates, state = jax.jit(tx.update)(f32(u), state, jnp.asarray(p))
    assert updates.dtype == jnp.float32
    new = np.asarray(optax.apply_updates(jnp.asarray(p), updates))
    total = jax.jit(jnp.add)(f32(p), f32(u))  # the float32 result, before rounding
    if method == "kahan":
        expected = np.asarray(total.astype(BF16))
        # What rounding took away is kept, measured against where the weight landed.
        kept = np.asarray(state.compensation).astype(np.float32)
        finite = np.isfinite(new.astype(np.float32))
        np.testing.assert_array_equal(
            kept[finite], np.asarray(
                (total - jnp.asarray(new).astype(jnp.float32)).astype(BF16), np.float32)[finite])
    else:
        down = np.asarray(total.astype(BF16))
        up = np.asarray(jnp.nextafter(jnp.asarray(down), jnp.asarray(np.where(
            total > down.astype(np.float32), np.inf, -np.inf), BF16)))
        expected = np.where(bits(new) == bits(up), up, down)  # either neighbour is right
    same = (bits(new) == bits(expected)) | (np.isnan(new) & np.isnan(expected))
    missed = ~same
    assert not np.any(missed & ~_unreachable(p, expected)), (p[missed][:5], expected[missed][:5])
    assert missed.mean() < 0.05  # the unreachable cases are the adversarial corner only


def test_split_keeps_every_float32_bit_pattern():
    """Rebuilt weights equal the float32 weights for all 2**32 values' high and low halves."""
    everything = np.arange(0, 2**32, 4099, dtype=np.uint64).astype(np.uint32).view(np.float32)
    tx = jmp_policy.low_precision_params(optax.identity(), "split")
    # The high halves by their bits: a cast would make every NaN the same NaN.
    p = jnp.asarray((bits(everything) >> 16).astype(np.uint16).view(BF16))
    state = tx.init(p)._replace(low_bits=jnp.asarray((bits(everything) & 0xFFFF).astype(np.uint16)))
    assert_bitwise_equal(jmp_policy.master_params(p, state), everything)


# --------------------------------------------------------------------------- #
# Optimizer state in bfloat16.
# --------------------------------------------------------------------------- #

def test_cast_state_stores_adams_moments_in_bfloat16_and_computes_in_float32():
    params = {"w": jnp.linspace(-1, 1, 8), "b": jnp.zeros(())}
    tx = jmp_policy.cast_state(optax.adam(1e-2), BF16, rounding="nearest")
    state = tx.init(params)
    grads = {"w": jnp.linspace(0.1, 1, 8), "b": jnp.ones(())}
    updates, state = tx.update(grads, state, params)
    adam_state = state.inner_state[0]
    assert adam_state.mu["w"].dtype == BF16 and adam_state.nu["w"].dtype == BF16
    assert adam_state.mu["b"].dtype == jnp.float32  # scalars stay
    assert adam_state.count.dtype == jnp.int32
    reference, _ = optax.adam(1e-2).update(grads, optax.adam(1e-2).init(params), params)
    chex.assert_trees_all_close(updates, reference, rtol=1e-6)  # the first step is exact


def test_stochastic_rounding_keeps_adams_second_moment_decaying():
    """With b2=0.999, nu shrinks 0.1% a step: below bfloat16's precision when rounded to nearest."""
    params = jnp.zeros(2**14)
    steps = 300
    txs = [jmp_policy.cast_state(optax.scale_by_adam(b2=0.999), BF16, rounding=rounding)
           for rounding in ("nearest", "stochastic")]

    @jax.jit
    def run(params):
        out = []
        for tx in txs:
            _, state = tx.update(jnp.ones_like(params), tx.init(params))
            body = lambda _, s, tx=tx: tx.update(jnp.zeros_like(params), s)[1]  # noqa: E731
            last = jax.lax.fori_loop(0, steps, body, state)
            out.append((state.inner_state.nu, last.inner_state.nu))
        return out

    (nu0, nearest), (_, stochastic) = run(params)
    np.testing.assert_array_equal(nearest, nu0)  # stuck
    expected = float(nu0[0]) * 0.999**steps
    assert abs(float(stochastic.astype(jnp.float32).mean()) / expected - 1) < 0.005


# --------------------------------------------------------------------------- #
# Composition.
# --------------------------------------------------------------------------- #

def _tiny_problem():
    # A weight of 0.0 among bfloat16 weights, and a float32 leaf, which passes through.
    params = {"w": jnp.linspace(-2, 2, 25, dtype=BF16)[:24].reshape(4, 6), "scale": jnp.ones(6)}

    def grads(k):  # cheap to compile, unlike jax.random.normal
        return jax.tree.map(lambda p: jnp.cos(
            1.7 * jnp.arange(p.size, dtype=jnp.float32) + k).reshape(p.shape), params)

    return params, grads


def _optimizer(method, rounding="stochastic", inner=None):
    """AdamW (or ``inner``) with bfloat16 moments (``rounding=None``: float32) for bfloat16 weights."""
    # RBG keys: XLA:CPU compiles their bits far faster than threefry's.
    inner = inner or optax.adamw(1e-3)
    if rounding is not None:
        inner = jmp_policy.cast_state(inner, BF16, rounding=rounding,
                                      seed=jax.random.key(5, impl="rbg"))
    return jmp_policy.low_precision_params(inner, method, seed=jax.random.key(7, impl="rbg"))


def _per_method(wrap=lambda tx: tx, rounding="stochastic", inner=None):
    return {method: wrap(_optimizer(method, rounding, inner)) for method in METHODS}


MOMENTUM = optax.sgd(1e-3, momentum=0.9)  # a state leaf per parameter, in fewer ops than Adam


def test_a_skipped_step_leaves_weights_buffers_keys_and_moments_bit_for_bit():
    params, grads = _tiny_problem()
    txs = _per_method(lambda tx: jmp_policy.loss_scaling(tx, "dynamic"))
    bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), grads(1))

    @jax.jit
    def run(params):
        out = {}
        for method, tx in txs.items():
            before, state = step(tx, params, grads(0), tx.init(params))
            out[method] = (before, state, step(tx, before, bad, state))
        return out

    for method, (before, state, (after, skipped)) in run(params).items():
        assert not bool(skipped.grads_finite), method
        assert_bitwise_equal((after, skipped.inner_state), (before, state.inner_state))
        assert not np.array_equal(before["w"], params["w"]), method  # a finite step moves


@pytest.mark.parametrize("wrapper", [jmp_policy.low_precision_params, jmp_policy.cast_state])
def test_loss_scaling_inside_is_refused(wrapper):
    tx = wrapper(jmp_policy.loss_scaling(optax.adam(1e-3)))
    with pytest.raises(ValueError, match=r"Put loss_scaling outside"):
        tx.init({"w": jnp.ones(2, BF16)})


def test_multisteps_of_two_equals_one_step_on_the_mean_gradient(xla_cpu):
    # Bit for bit across two programs: on the CPU backend, as the split test above.
    params, grads = _tiny_problem()
    accumulated = _per_method(lambda tx: optax.MultiSteps(tx, every_k_schedule=2), None, MOMENTUM)
    single = _per_method(rounding=None, inner=MOMENTUM)
    # The mean as MultiSteps computes it (Welford's update).
    mean = jax.tree.map(lambda a, b: a + (b - a) / 2, grads(0), grads(1))
    # States built outside the step, as in a train loop, so that XLA folds no
    # constant of one program that it computes at run time in the other.
    states = jax.jit(lambda p: {m: (accumulated[m].init(p), single[m].init(p)) for m in METHODS})(
        params)

    @jax.jit
    def run(params, states):
        out = {}
        for method, (state, single_state) in states.items():
            tx = accumulated[method]
            mid, state = step(tx, params, grads(0), state)
            new, state = step(tx, mid, grads(1), state)
            expected, expected_state = step(single[method], params, mean, single_state)
            out[method] = (mid, (new, jmp_policy.master_params(new, state)),
                           (expected, jmp_policy.master_params(expected, expected_state)))
        return out

    for method, (mid, got, expected) in run(params, states).items():
        assert_bitwise_equal(mid, params)  # the first mini-step changes nothing
        assert_bitwise_equal(got, expected)


def test_chain_clips_before_the_low_precision_step():
    params, grads = _tiny_problem()
    clipped = jmp_policy.low_precision_params(
        optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(1e-2)), "split")
    outer = optax.chain(optax.clip_by_global_norm(0.1),
                        jmp_policy.low_precision_params(optax.sgd(1e-2), "split"))

    @jax.jit
    def run(params):
        return [jmp_policy.master_params(*step(tx, params, grads(0), tx.init(params)))
                for tx in (clipped, outer)]

    assert_bitwise_equal(*run(params))


def test_orbax_checkpoint_resumes_bit_identically(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    params, grads = _tiny_problem()
    txs = _per_method(lambda tx: jmp_policy.loss_scaling(tx, None))

    @jax.jit
    def train(states, k):
        return {m: step(tx, states[m][0], grads(k), states[m][1]) for m, tx in txs.items()}

    # Committed to the device, as restored arrays are, so that one compiled step serves both.
    state = jax.device_put({m: (params, tx.init(params)) for m, tx in txs.items()}, jax.devices()[0])
    for k in range(3):
        state = train(state, k)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "ckpt", jax.eval_shape(lambda: state))
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(state)
    for k in range(3, 6):
        state, restored = train(state, k), train(restored, k)
    assert_bitwise_equal(restored, state)


_SHARDED = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jmp_policy

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    spec = {"w": P("data", "model"), "b": P("model"), "scale": P()}
    params = {"w": jnp.linspace(-2, 2, 64 * 32, dtype=jnp.bfloat16).reshape(64, 32),
              "b": jnp.zeros(32, jnp.bfloat16), "scale": jnp.ones(32)}
    grads = jax.tree.map(lambda p: jnp.cos(jnp.arange(p.size, dtype=jnp.float32)).reshape(p.shape),
                         params)
    # Momentum, stored in bfloat16: a state leaf per parameter, like Adam's, in fewer ops.
    txs = {method: jmp_policy.low_precision_params(
               jmp_policy.cast_state(optax.sgd(1e-3, momentum=0.9), jnp.bfloat16), method)
           for method in ("kahan", "stochastic", "split")}

    def init(params):
        return {method: tx.init(params) for method, tx in txs.items()}

    def train(params, states, grads):
        # Steps after the first: states are arguments, as in a train loop (not
        # constants XLA could fold), so that both programs compute alike.
        out = {}
        for method, tx in txs.items():
            updates, new_state = tx.update(grads, states[method], params)
            out[method] = (states[method], optax.apply_updates(params, updates), new_state)
        return out

    single = jax.jit(train)(params, jax.jit(init)(params), grads)
    put = lambda tree: jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree,
                                    spec)
    with jax.set_mesh(mesh):
        sharded = jax.jit(train)(put(params), jax.jit(init)(put(params)), put(grads))

    like = lambda tree: all(
        x.sharding.is_equivalent_to(NamedSharding(mesh, spec[name]), x.ndim)
        for name, x in tree.items() if hasattr(x, "sharding"))
    facts = {}
    for method, (state, new_params, new_state) in sharded.items():
        buffers = {"kahan": lambda s: s.compensation, "split": lambda s: s.low_bits,
                   "stochastic": lambda s: {}}[method]
        facts[method] = {
            "buffers_like_params": like(buffers(state)) and like(buffers(new_state)),
            "moments_like_params": like(new_state.inner_state.inner_state[0].trace),
            "params_keep_sharding": like(new_params),
            "same_as_one_device": all(
                np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in
                zip(jax.tree.leaves(sharded[method]), jax.tree.leaves(single[method]))),
        }
    json.dump(facts, open(sys.argv[1], "w"))
""")


@pytest.mark.slow  # a system test: a child interpreter on 8 devices
def test_buffers_are_sharded_like_their_parameters(tmp_path):
    script, out = tmp_path / "sharded.py", tmp_path / "facts.json"
    script.write_text(_SHARDED)
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(EXAMPLES, os.pardir),
                                         env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(script), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    facts = json.loads(out.read_text())
    for method in METHODS:
        assert facts[method] == {"buffers_like_params": True, "moments_like_params": True,
                                 "params_keep_sharding": True, "same_as_one_device": True}, method


class TestUpdateWithAndWithoutJit(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_kahan_update_gives_float32_updates_and_narrow_buffers(self):
        params, grads = _tiny_problem()
        tx = _optimizer("kahan", rounding=None)
        update = self.variant(tx.update)
        updates, state = update(grads(0), tx.init(params), params)
        chex.assert_trees_all_equal_dtypes(
            updates, {"w": jnp.zeros(1), "scale": jnp.zeros(1)})
        chex.assert_trees_all_equal_shapes(updates, params)
        chex.assert_trees_all_equal_dtypes(state.compensation["w"], params["w"])
        assert isinstance(state.compensation["scale"], optax.MaskedNode)
        new = optax.apply_updates(params, updates)
        chex.assert_trees_all_equal_dtypes(new, params)
        # The compensated weights move as float32 weights under AdamW would, to the
        # bfloat16 rounding of the compensation.
        wide = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        adamw = optax.adamw(1e-3)
        reference = optax.apply_updates(wide, adamw.update(grads(0), adamw.init(wide), wide)[0])
        chex.assert_trees_all_close(jmp_policy.master_params(new, state), reference, atol=1e-5)


# --------------------------------------------------------------------------- #
# Misuse: a transformation after low_precision_params, weights changed elsewhere.
# --------------------------------------------------------------------------- #

MISUSE = r"not the weights its last update produced.*low_precision_params\(optax\.chain\("
# Updates of 0.1 and more move the weights of _tiny_problem by several ulps: halved or
# clipped to 1e-3, every moved weight lands elsewhere.
AFTER = {"scale": optax.scale(0.5), "clip": optax.clip(1e-3)}


def _misused(method, after):
    return optax.chain(jmp_policy.low_precision_params(optax.sgd(0.1), method), after)


@pytest.mark.parametrize("after", list(AFTER), ids=list(AFTER))
@pytest.mark.parametrize("method", METHODS)
def test_a_transformation_after_it_warns_once_under_jit(method, after):
    params, grads = _tiny_problem()
    tx = _misused(method, AFTER[after])
    train = jax.jit(lambda params, state, k: step(tx, params, grads(k), state))
    state = tx.init(params)
    with pytest.warns(UserWarning, match=MISUSE) as record:
        for k in range(4):
            params, state = train(params, state, k)
        jax.effects_barrier()
    assert len([w for w in record if "last update produced" in str(w.message)]) == 1


@pytest.mark.parametrize("misuse", ["scale", "clip", "weights changed"])
@pytest.mark.parametrize("method", METHODS)
def test_a_transformation_after_it_is_an_error_eagerly(method, misuse):
    params, grads = _tiny_problem()
    tx = _misused(method, AFTER.get(misuse, optax.identity()))
    params, state = step(tx, params, grads(0), tx.init(params))
    if misuse == "weights changed":
        params = jax.tree.map(lambda p: p * 2, params)
    with pytest.raises(ValueError, match=MISUSE):
        step(tx, params, grads(1), state)


@pytest.mark.parametrize("method", METHODS)
def test_a_zero_update_between_steps_that_turns_minus_zero_to_zero_is_silent(method):
    # optax.MultiSteps' mini-steps add zero updates: -0.0 + 0.0 is +0.0, the same weight.
    params = {"w": jnp.full(4, -0.0, BF16)}
    tx = jmp_policy.low_precision_params(optax.sgd(1.0), method)
    params, state = step(tx, params, {"w": jnp.zeros(4)}, tx.init(params))  # lands on -0.0
    assert bits(params["w"]).tolist() == [0x8000] * 4
    params = optax.apply_updates(params, {"w": jnp.zeros(4)})
    assert bits(params["w"]).tolist() == [0] * 4
    step(tx, params, {"w": jnp.zeros(4)}, state)


def _nan_at_step_1(k, g):
    return jnp.where(k == 1, g.at[0].set(jnp.nan), g)


def _host_copy_at_step_2(params, state):
    return jax.device_get((params, state))


# name: (the optimizer around low_precision_params(inner), its inner, gradients at step k,
# what happens to (params, state) between steps)
DOCUMENTED_USE = {
    "loss_scaling, a skipped step": (
        lambda tx: jmp_policy.loss_scaling(tx, "dynamic"), optax.adam(1e-3), _nan_at_step_1, None),
    "MultiSteps": (lambda tx: optax.MultiSteps(tx, 2), optax.adam(1e-3), None, None),
    "clipping inside": (lambda tx: tx, optax.chain(optax.clip_by_global_norm(0.1),
                                                   optax.scale_by_adam(), optax.scale(-1e-3)),
                        None, None),
    "resumed from host copies": (lambda tx: tx, optax.adam(1e-3), None, _host_copy_at_step_2),
    "non-finite updates": (lambda tx: tx, optax.sgd(1e-3), _nan_at_step_1, None),
}


@pytest.mark.parametrize("use", list(DOCUMENTED_USE), ids=list(DOCUMENTED_USE))
@pytest.mark.parametrize("method", METHODS)
def test_documented_use_is_silent(method, use):
    wrap, inner, grads_at, between = DOCUMENTED_USE[use]
    params, grads = _tiny_problem()  # bfloat16 weights and a float32 leaf
    tx = wrap(jmp_policy.low_precision_params(inner, method))
    grads_at = grads_at or (lambda k, g: g)
    train = jax.jit(lambda params, state, k: step(
        tx, params, jax.tree.map(functools.partial(grads_at, k), grads(k)), state))
    # Weights loaded after init (fine-tuning): init saw others, and no update landed yet.
    state = tx.init(jax.tree.map(jnp.zeros_like, params))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(5):
            if k == 2 and between:
                params, state = between(params, state)
            params, state = train(params, state, k)
        jax.effects_barrier()
        step(tx, params, grads(5), state)  # eagerly: an error if they differed
    assert not np.array_equal(params["w"], _tiny_problem()[0]["w"])  # the weights moved


# --------------------------------------------------------------------------- #
# Bad input.
# --------------------------------------------------------------------------- #

def test_a_misspelt_method_names_the_choices():
    with pytest.raises(ValueError, match=r"'kahn'.*did you mean 'kahan'"):
        jmp_policy.low_precision_params(optax.sgd(1.0), "kahn")
    with pytest.raises(ValueError, match=r"rounding must be one of 'stochastic', 'nearest'"):
        jmp_policy.cast_state(optax.sgd(1.0), BF16, rounding="round")
    with pytest.raises(ValueError, match=r"bfloat16 or float16.*got float32"):
        jmp_policy.cast_state(optax.sgd(1.0), jnp.float32)
    with pytest.raises(TypeError, match=r"seed must be an int or a PRNG key"):
        jmp_policy.low_precision_params(optax.sgd(1.0), "stochastic", seed=0.5)


def test_update_needs_params_and_its_own_state():
    tx = jmp_policy.low_precision_params(optax.sgd(1.0), "kahan")
    params = {"w": jnp.ones(2, BF16)}
    with pytest.raises(ValueError, match=r"needs the parameters.*tx.update\(grads, opt_state, params\)"):
        tx.update(params, tx.init(params))
    other = jmp_policy.low_precision_params(optax.sgd(1.0), "split").init(params)
    with pytest.raises(TypeError, match=r"expected the KahanState.*got SplitState"):
        tx.update(params, other, params)


def test_parameters_must_be_floating_and_split_needs_bfloat16():
    tx = jmp_policy.low_precision_params(optax.sgd(1.0), "split")
    with pytest.raises(TypeError, match=r"at \['step'\] has dtype int32.*must be floating"):
        tx.init({"w": jnp.ones(2, BF16), "step": jnp.zeros((), jnp.int32)})
    with pytest.raises(TypeError, match=r"'split' needs bfloat16.*at \['w'\] is float16"):
        tx.init({"w": jnp.ones(2, jnp.float16)})


def test_float32_parameters_alone_warn_that_nothing_changes():
    tx = jmp_policy.low_precision_params(optax.sgd(1.0), "kahan")
    with pytest.warns(UserWarning, match=r"no parameter is bfloat16 or float16.*changes nothing"):
        tx.init({"w": jnp.ones(2)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tx.init({"w": jnp.ones(2), "v": jnp.ones(2, BF16)})  # a mixed tree is fine


def test_master_params_needs_exactly_one_state():
    params = {"w": jnp.ones(2, BF16)}
    with pytest.raises(ValueError, match=r"holds 0 states of low_precision_params"):
        jmp_policy.master_params(params, optax.adam(1.0).init(params))
    nested = jmp_policy.loss_scaling(_optimizer("split"))
    master = jmp_policy.master_params(params, nested.init(params))
    assert_bitwise_equal(master, {"w": jnp.ones(2, jnp.float32)})


@pytest.mark.parametrize("method", METHODS)
def test_updates_added_with_a_promoting_sum_are_an_error(method):
    # jax.tree.map(lambda p, u: p + u) turns a bfloat16 weight float32: its buffer (or
    # its rounding) would be dropped silently.
    params = {"w": jnp.ones(8, BF16), "s": jnp.ones(2)}
    tx = jmp_policy.low_precision_params(optax.sgd(1e-2), method)
    state = tx.init(params)
    grads = jax.tree.map(lambda p: jnp.ones(p.shape, jnp.float32), params)
    updates, state = tx.update(grads, state, params)
    promoted = jax.tree.map(lambda p, u: p + u, params, updates)
    assert promoted["w"].dtype == jnp.float32
    with pytest.raises(TypeError, match="optax.apply_updates, which keeps every parameter"):
        tx.update(grads, state, promoted)
    tx.update(grads, state, optax.apply_updates(params, updates))  # as documented: fine


@pytest.mark.parametrize("method", ["cast_state"] + METHODS)
def test_the_step_compiles_to_the_same_kernels_for_any_number_of_same_shaped_leaves(method):
    # A model's depth may add kernels that XLA compiles once (XLA:GPU) or cheaply, not
    # kernels specific to one leaf: a seed per leaf, sliced from an array of seeds,
    # made every leaf's kernels distinct (cast_state's step compiled ~10x Adam's).
    if method == "cast_state":
        tx, dtype = jmp_policy.cast_state(optax.adam(1e-3)), jnp.float32
    else:
        tx, dtype = jmp_policy.low_precision_params(optax.adam(1e-3), method), BF16
    kernels = [step_kernels(tx, {f"w{i}": jax.ShapeDtypeStruct((8, 256), dtype)
                                 for i in range(n)}) for n in (2, 24)]
    # A kernel per leaf would add 22. XLA's own heuristics add a few that do not grow with
    # the leaves: a reduction over all of them split into more levels (XLA:CPU, jax 0.11:
    # 3 more), a scalar of Adam's no longer copied into its consumers (XLA:GPU, jax 0.11,
    # plain Adam too).
    assert kernels[1] - kernels[0] <= 4, kernels
