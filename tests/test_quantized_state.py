"""quantize_state: optimizer states as block-scaled float8 with stochastic rounding."""

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_policy
from jmp_policy import QuantizedArray, dequantize, quantize_state

RNG = np.random.RandomState(0)


def _quantized(x, seed=None, block=256):
    """``x`` through quantize_state's storage, as a float32 array (momentum of one step)."""
    # optax.trace's state after one step with decay 0 is the gradient itself.
    tx = quantize_state(optax.trace(decay=0.0), min_size=0, block_size=block,
                        rounding="nearest" if seed is None else "stochastic",
                        seed=0 if seed is None else seed)
    state = tx.init(jnp.zeros_like(x))
    _, state = tx.update(jnp.asarray(x), state)
    return state.inner_state.trace


def _spacing(y):
    """float8_e4m3fn's spacing at magnitude ``y`` (in the scaled domain)."""
    e = np.floor(np.log2(np.maximum(np.abs(y), 1e-30)))
    return 2.0 ** (np.maximum(e, -6) - 3)


@pytest.mark.parametrize("seed", [None, 7])
def test_quantization_error_is_within_a_float8_spacing_per_block(seed):
    x = (RNG.randn(8, 512) * np.exp(RNG.randn(8, 512) * 2)).astype(np.float32)
    q = _quantized(x, seed)
    assert isinstance(q, QuantizedArray) and q.values.dtype == jnp.float8_e4m3fn
    assert q.scales.shape == (8, 2)
    blocks = x.reshape(8, 2, 256)
    scale = np.abs(blocks).max(-1, keepdims=True) / 448
    np.testing.assert_allclose(np.asarray(q.scales), scale[..., 0], rtol=1e-6)
    y = blocks / scale
    err = np.abs(np.asarray(dequantize(q)).reshape(8, 2, 256) / scale - y)
    bound = _spacing(y) * (0.5 if seed is None else 1.0)
    # The smallest magnitudes round up to the smallest float8 value, not to zero.
    tiny = np.abs(y) < 2.0 ** -9
    assert (err[~tiny] <= bound[~tiny] * (1 + 1e-6)).all()
    assert (np.asarray(dequantize(q)) != 0).all()  # x has no zero: none stored as zero


def test_stochastic_rounding_is_unbiased():
    x = (RNG.rand(1, 256).astype(np.float32) + 0.01) * np.float32(3.3)
    draws = np.stack([np.asarray(dequantize(_quantized(x, seed))) for seed in range(400)])
    mean = draws.mean(0)
    assert (draws.min(0) < draws.max(0)).mean() > 0.9       # they are random
    # In units of each value's float8 spacing (after scaling): a draw is one of two
    # neighbours, so the mean of n draws is within 0.5 / sqrt(n) of x (one std), and
    # the errors of the 256 values average out.
    scale = np.abs(x).max() / 448
    err = (mean - x) / (_spacing(x / scale) * scale)
    assert np.abs(err).max() < 4 * 0.5 / np.sqrt(len(draws))
    assert abs(err.mean()) < 4 * 0.5 / np.sqrt(len(draws) * x.size)
    nearest = np.asarray(dequantize(_quantized(x)))
    assert np.abs(nearest - x).mean() > 2 * np.abs(mean - x).mean()


def test_zero_blocks_and_outliers_keep_to_their_block():
    x = np.full((3, 256), 1e-3, np.float32)
    x[0] = 0.0                                  # a zero block
    x[1, 5] = 1e6                               # an outlier in the second block
    q = _quantized(x)
    got = np.asarray(dequantize(q))
    assert (got[0] == 0).all() and float(q.scales[0, 0]) == 0.0
    assert got[1, 5] == pytest.approx(1e6, rel=1e-6)
    # The other values of the outlier's block are far below its range: kept nonzero, at
    # the smallest float8 value of that block (positive, never above their true value's
    # block range), while the third block keeps them to float8's precision.
    assert (got[1, np.arange(256) != 5] > 0).all()
    np.testing.assert_allclose(got[2], x[2], rtol=2.0 ** -4)


def test_adam_trains_like_float32_on_a_regression():
    w_true = RNG.randn(64, 256).astype(np.float32)
    xs = RNG.randn(512, 256).astype(np.float32)
    ys = xs @ w_true.T

    def loss(w):
        return jnp.mean((xs @ w.T - ys) ** 2)

    def train(tx, steps=150):
        w = jnp.zeros((64, 256))
        state = tx.init(w)

        @jax.jit
        def step(w, state):
            updates, state = tx.update(jax.grad(loss)(w), state, w)
            return optax.apply_updates(w, updates), state

        for _ in range(steps):
            w, state = step(w, state)
        return float(loss(w)), state

    float32, _ = train(optax.adam(3e-2))
    quantized, state = train(quantize_state(optax.adam(3e-2), min_size=0))
    assert isinstance(state.inner_state[0].nu, QuantizedArray)
    initial = float(loss(jnp.zeros((64, 256))))
    assert float32 < 0.05 * initial
    assert quantized == pytest.approx(float32, rel=0.05)  # nearest rounding: 14% worse


def test_state_bytes_per_value():
    tx = quantize_state(optax.adam(1e-3))
    params = {"big": jnp.zeros((1024, 1024)), "small": jnp.zeros(100)}
    state = tx.init(params)
    leaves = jax.tree.leaves(state.inner_state)
    nbytes = sum(x.nbytes for x in leaves)
    # Two moments of 2**20 values at 1 + 4/256 bytes each, the small ones in float32.
    assert nbytes == pytest.approx(2 * (2 ** 20 * (1 + 4 / 256) + 400) + 4, rel=1e-3)
    assert state.inner_state[0].mu["small"].dtype == jnp.float32


def test_a_skipped_step_leaves_the_quantized_state_unchanged_bit_for_bit():
    tx = jmp_policy.loss_scaling(quantize_state(optax.adam(1e-2), min_size=0), 2.0 ** 8)
    params = {"w": jnp.ones((4, 256))}
    state = tx.init(params)
    _, state = tx.update({"w": jnp.full((4, 256), 3.0)}, state, params)
    bad = {"w": jnp.full((4, 256), jnp.inf)}
    updates, after = tx.update(bad, state, params)
    assert (np.asarray(updates["w"]) == 0).all()
    inner = lambda s: jax.tree.leaves(s.inner_state)  # noqa: E731
    assert [np.asarray(a).tobytes() for a in inner(state)] == [
        np.asarray(b).tobytes() for b in inner(after)]


def test_resuming_from_host_copies_gives_the_same_next_step():
    tx = quantize_state(optax.adam(1e-2), min_size=0)
    params = {"w": jnp.ones((2, 512))}
    state = tx.init(params)
    grads = {"w": jnp.asarray(RNG.randn(2, 512).astype(np.float32))}
    _, state = tx.update(grads, state, params)
    saved = jax.tree.map(np.asarray, state)              # what a checkpoint writes
    restored = jax.tree.map(jnp.asarray, saved)
    a, sa = tx.update(grads, state, params)
    b, sb = tx.update(grads, restored, params)
    chex.assert_trees_all_equal((a, sa), (b, sb))


def test_composes_with_multisteps_and_inject_hyperparams():
    inner = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    tx = optax.MultiSteps(quantize_state(inner, min_size=0), every_k_schedule=2)
    params = {"w": jnp.ones((2, 256))}
    state = tx.init(params)
    for _ in range(4):
        updates, state = tx.update({"w": jnp.ones((2, 256))}, state, params)
        params = optax.apply_updates(params, updates)
    inner_state = state.inner_opt_state.inner_state
    assert inner_state.hyperparams["learning_rate"].dtype == jnp.float32   # a scalar: kept
    assert isinstance(inner_state.inner_state[0].mu["w"], QuantizedArray)
    assert float(params["w"][0, 0]) < 1.0


def test_a_last_dimension_that_is_not_a_multiple_takes_a_smaller_block():
    tx = quantize_state(optax.adam(1e-3), min_size=0)
    mu = tx.init({"w": jnp.zeros((8, 192))}).inner_state[0].mu["w"]
    assert isinstance(mu, QuantizedArray) and mu.scales.shape == (8, 3)  # blocks of 64


def test_leaves_kept_in_float32_and_rules_that_match_nothing():
    params = {"embed": jnp.zeros((64, 256)), "w": jnp.zeros((64, 256)),
              "odd": jnp.zeros((16, 100))}
    with pytest.warns(UserWarning, match="block_size=256 have no common divisor of at least 32"):
        state = quantize_state(optax.adam(1e-3), min_size=0, keep="embed").init(params)
    mu = state.inner_state[0].mu
    assert mu["embed"].dtype == jnp.float32 and mu["odd"].dtype == jnp.float32
    assert isinstance(mu["w"], QuantizedArray)
    with pytest.warns(UserWarning, match="keep rule 'embedding' matches no array"):
        quantize_state(optax.adam(1e-3), min_size=0, keep="embedding").init({"w": params["w"]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantize_state(optax.adam(1e-3)).init(params)   # small arrays: quietly float32


@pytest.mark.parametrize("kwargs,match", [
    ({"block_size": 0}, "block_size must be a positive int"),
    ({"rounding": "stochastik"}, "did you mean 'stochastic'"),
])
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        quantize_state(optax.adam(1e-3), **kwargs)


def test_loss_scaling_inside_is_refused():
    inner = jmp_policy.loss_scaling(optax.adam(1e-3), 2.0 ** 8)
    with pytest.raises(ValueError, match="loss_scaling outside"):
        quantize_state(inner).init({"w": jnp.zeros(3)})


_SHARDED = """
import json, sys
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import NamedSharding, PartitionSpec as P
import jmp_policy

mesh = jax.make_mesh((2, 4), ("data", "model"))
spec = {"w": P("data", "model"), "v": P(None, "model")}
params = {"w": jnp.ones((16, 4 * 512)), "v": jnp.ones((8, 4 * 256))}
grads = jax.tree.map(lambda p: jnp.linspace(-1, 1, p.size).reshape(p.shape), params)
tx = jmp_policy.quantize_state(optax.adam(1e-2), min_size=0)
put = lambda tree: jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, spec)

def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

single = jax.jit(step)(params, tx.init(params), grads)
with jax.set_mesh(mesh):
    state = jax.jit(tx.init)(put(params))
    compiled = jax.jit(step).lower(put(params), state, put(grads)).compile()
    sharded = compiled(put(params), state, put(grads))
text = compiled.as_text()
mu = sharded[1].inner_state[0].mu
facts = {
    "collectives": [op for op in ("all-gather", "all-to-all", "collective-permute")
                    if op in text],
    "values_like_params": all(mu[k].values.sharding.is_equivalent_to(
        NamedSharding(mesh, spec[k]), 2) for k in spec),
    "scales_like_params": all(mu[k].scales.sharding.is_equivalent_to(
        NamedSharding(mesh, spec[k]), 2) for k in spec),
    "same_as_one_device": all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
                              for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(single))),
}
json.dump(facts, open(sys.argv[1], "w"))
"""


def test_quantized_states_stay_sharded_like_their_parameters(tmp_path):
    import json
    import os
    import subprocess
    import sys

    script, out = tmp_path / "sharded.py", tmp_path / "facts.json"
    script.write_text(_SHARDED)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
               + " --xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, str(script), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(out.read_text()) == {
        "collectives": [], "values_like_params": True, "scales_like_params": True,
        "same_as_one_device": True}


def test_orbax_checkpoint_resumes_bit_identically(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    tx = jmp_policy.loss_scaling(quantize_state(optax.adam(1e-2), min_size=0), "mixed_float16")
    params = {"w": jnp.ones((2, 512))}
    grads = {"w": jnp.asarray(RNG.randn(2, 512).astype(np.float32))}
    step = jax.jit(lambda s: tx.update(grads, s, params))
    state = tx.init(params)
    for _ in range(2):
        _, state = step(state)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "ckpt", jax.eval_shape(lambda: state))
    assert restored.inner_state.inner_state[0].mu["w"].values.dtype == jnp.float8_e4m3fn
    chex.assert_trees_all_equal(step(restored), step(state))


@pytest.mark.parametrize("make", [
    lambda: optax.lion(1e-3), lambda: optax.sgd(1e-2, momentum=0.9),
    lambda: optax.adafactor(1e-2), lambda: optax.adamw(1e-3)])
def test_any_optimizer_steps_like_its_float32_self(make):
    params = {"w": jnp.asarray(RNG.randn(8, 256).astype(np.float32))}
    grads = [{"w": jnp.asarray(RNG.randn(8, 256).astype(np.float32))} for _ in range(3)]

    def run(tx):
        state, out = tx.init(params), []
        for g in grads:
            updates, state = tx.update(g, state, params)
            out.append(updates["w"])
        return np.stack(out), state

    want, _ = run(make())
    got, state = run(quantize_state(make(), min_size=64))  # adafactor: its row factors stay
    assert any(isinstance(x, QuantizedArray) for x in jax.tree.leaves(
        state.inner_state, is_leaf=lambda x: isinstance(x, QuantizedArray)))
    assert np.isfinite(got).all()
    # Float8 holds 3 mantissa bits: the moments, and so the steps, within ~6% (Lion's
    # steps are signs: equal but where a moment is near zero).
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 0.1, err
