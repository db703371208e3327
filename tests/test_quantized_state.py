"""quantize_state: optimizer states as block-scaled 8- and 4-bit codes with stochastic rounding."""

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
from jmp_policy import QuantizedArray, dequantize, quantize_state

RNG = np.random.RandomState(0)

# XLA:CPU keeps every rounding; XLA:GPU under jit drops narrowing round trips
# (tests/support/excess_precision.py). The codes must be right either way.
COMPILERS = {"jit": jax.jit, "jit, excess precision as on a GPU":
             lambda f: jax.jit(with_excess_precision(f))}
compilers = pytest.mark.parametrize("compile", list(COMPILERS.values()), ids=list(COMPILERS))


def _momentum(seed=None, block=256, **kwargs):
    """A quantized momentum whose state after a step is the step's gradient."""
    # optax.trace's state after one step with decay 0 is the gradient itself.
    return quantize_state(optax.trace(decay=0.0), min_size=0, block_size=block,
                          rounding="nearest" if seed is None else "stochastic",
                          seed=0 if seed is None else seed, **kwargs)


def _quantized(x, seed=None, block=256, compile=jax.jit, **kwargs):
    """``x`` through quantize_state's storage (momentum of one step)."""
    tx = _momentum(seed, block, **kwargs)
    _, state = compile(lambda g, s: tx.update(g, s))(jnp.asarray(x), tx.init(jnp.zeros_like(x)))
    return state.inner_state.trace


def _draws(x, n, compile, block=256, **kwargs):
    """``n`` stochastic roundings of ``x``: the dequantized momentum of ``n`` steps, each
    rounding with the next key, in one program."""
    tx = _momentum(0, block, **kwargs)

    def run(x, state):
        def body(state, _):
            _, state = tx.update(x, state)
            return state, dequantize(state.inner_state.trace)
        return jax.lax.scan(body, state, None, length=n)[1]

    return np.asarray(compile(run)(jnp.asarray(x), tx.init(jnp.zeros_like(x))))


def _scales(q):
    """Each block's scale, from its stored exponent."""
    return 2.0 ** (np.asarray(q.exponents, np.float64) - 127)


def _power_of_two_above(absmax, log2_range):
    """The scale quantize_state's docs give: the power of two just above a block's largest
    magnitude, over the code's range (2**8 for float8, 1 for 4 bits)."""
    return 2.0 ** (np.floor(np.log2(absmax)) + 1 - log2_range)


def _spacing(y):
    """float8_e4m3fn's spacing at magnitude ``y`` (in the scaled domain)."""
    e = np.floor(np.log2(np.maximum(np.abs(y), 1e-30)))
    return 2.0 ** (np.maximum(e, -6) - 3)


@compilers
@pytest.mark.parametrize("seed", [None, 7])
def test_quantization_error_is_within_a_float8_spacing_per_block(seed, compile):
    x = (RNG.randn(8, 512) * np.exp(RNG.randn(8, 512) * 2)).astype(np.float32)
    q = _quantized(x, seed, compile=compile)
    assert isinstance(q, QuantizedArray) and q.values.dtype == jnp.float8_e4m3fn
    assert q.exponents.shape == (8, 2) and q.exponents.dtype == jnp.uint8
    blocks = x.reshape(8, 2, 256)
    scale = _power_of_two_above(np.abs(blocks).max(-1, keepdims=True), 8)
    np.testing.assert_array_equal(_scales(q), scale[..., 0])
    y = blocks / scale
    assert np.abs(y).max() < 256
    err = np.abs(np.asarray(dequantize(q)).reshape(8, 2, 256) / scale - y)
    bound = _spacing(y) * (0.5 if seed is None else 1.0)
    # The smallest magnitudes round up to the smallest float8 value, not to zero.
    tiny = np.abs(y) < 2.0 ** -9
    assert (err[~tiny] <= bound[~tiny] * (1 + 1e-6)).all()
    assert (np.asarray(dequantize(q)) != 0).all()  # x has no zero: none stored as zero


@compilers
def test_stochastic_rounding_is_unbiased(compile):
    x = (RNG.rand(1, 256).astype(np.float32) + 0.01) * np.float32(3.3)
    draws = _draws(x, 400, compile)
    mean = draws.mean(0)
    assert (draws.min(0) < draws.max(0)).mean() > 0.9       # they are random
    # In units of each value's float8 spacing (after scaling): a draw is one of two
    # neighbours, so the mean of n draws is within 0.5 / sqrt(n) of x (one std), and
    # the errors of the 256 values average out.
    scale = _power_of_two_above(np.abs(x).max(), 8)
    err = (mean - x) / (_spacing(x / scale) * scale)
    assert np.abs(err).max() < 4 * 0.5 / np.sqrt(len(draws))
    assert abs(err.mean()) < 4 * 0.5 / np.sqrt(len(draws) * x.size)
    nearest = np.asarray(dequantize(_quantized(x, compile=compile)))
    assert np.abs(nearest - x).mean() > 2 * np.abs(mean - x).mean()


def test_stochastic_rounding_is_unbiased_down_to_float8s_smallest_subnormal():
    """Scaled values in float8's subnormal range (2**-9 apart below 2**-6) round to their
    neighbours unbiased, as normal ones do; below 2**-9 every nonzero value is stored as
    2**-9 (nonzero stays nonzero), with its sign."""
    rng = np.random.default_rng(1)
    x = (rng.choice([-1, 1], 256) * 2.0 ** rng.uniform(-10, -5, 256)).astype(np.float32)
    x[0] = 255.0   # the block's scale is then 1: x is what float8 rounds
    draws = _draws(x[None], 2000, jax.jit)[:, 0]
    within = np.abs(x) >= 2.0 ** -9
    err = (draws.mean(0) - x) / _spacing(x)
    assert np.abs(err[within]).max() < 4 * 0.5 / np.sqrt(len(draws))
    assert (draws[:, ~within] == np.sign(x[~within]) * 2.0 ** -9).all()


def _signed4_grid():
    """The signed 4-bit code's magnitudes: zero and the powers of two 2**-6 ... 1."""
    return np.concatenate([[0.0], 2.0 ** np.arange(-6, 1)])


@compilers
@pytest.mark.parametrize("seed", [None, 3])
def test_4_bit_codes_are_the_documented_grids_within_one_step(seed, compile):
    x = (RNG.randn(4, 256) * np.exp(RNG.randn(4, 256))).astype(np.float32)
    x[0, :8] = 0.0
    momentum = _quantized(x, seed, block=128, compile=compile, bits=4)
    assert momentum.code == "signed4" and momentum.values.dtype == jnp.int4
    assert momentum.values.shape == (4, 256) and momentum.exponents.shape == (4, 2)
    blocks = x.reshape(4, 2, 128)
    scale = _power_of_two_above(np.abs(blocks).max(-1, keepdims=True), 0)
    np.testing.assert_array_equal(_scales(momentum), scale[..., 0])
    y = blocks / scale
    got = np.asarray(dequantize(momentum)).reshape(4, 2, 128) / scale
    assert (np.sign(got) * np.sign(y) >= 0).all()
    _assert_on_neighbours(np.abs(got), np.abs(y), _signed4_grid(), nearest=seed is None)
    assert (got.reshape(4, 256)[0, :8] == 0).all()

    # A second moment (optax's ``nu``): the non-negative grid 1.5, 2, 3, 4, 6 ... 192,
    # 256 (2**m and 1.5 * 2**m) below a scale 2**8 above the block's largest value.
    tx = quantize_state(optax.scale_by_rms(decay=0.0, eps=0.0), bits=4, min_size=0,
                        block_size=128,
                        rounding="nearest" if seed is None else "stochastic")
    _, state = compile(lambda g, s: tx.update(g, s))(jnp.asarray(x), tx.init(jnp.zeros_like(x)))
    nu = state.inner_state.nu
    assert nu.code == "nonnegative4" and nu.values.dtype == jnp.int4
    scale = _power_of_two_above((x ** 2).reshape(4, 2, 128).max(-1, keepdims=True), 8)
    np.testing.assert_array_equal(_scales(nu), scale[..., 0])
    got = np.asarray(dequantize(nu)).reshape(4, 2, 128) / scale
    y = (x ** 2).reshape(4, 2, 128) / scale
    grid = np.sort(np.concatenate([2.0 ** np.arange(1, 9), 1.5 * 2.0 ** np.arange(8)]))
    # Below the smallest code (zeros of x included): stored as it, never as zero.
    _assert_on_neighbours(got, np.maximum(y, grid[0]), grid, nearest=seed is None)


def _assert_on_neighbours(got, y, grid, nearest):
    """Each value of ``got`` is one of the two points of ``grid`` around ``y`` (the
    nearer one when rounding to nearest)."""
    assert np.isin(got, grid).all()
    index = np.searchsorted(grid, y, side="right") - 1
    low, high = grid[index], grid[np.minimum(index + 1, len(grid) - 1)]
    assert ((got == low) | (got == high)).all()
    if nearest:
        np.testing.assert_array_equal(got, np.where(y - low > high - y, high, low))


@compilers
def test_4_bit_stochastic_rounding_is_unbiased(compile):
    x = ((RNG.rand(1, 128) - 0.5) * 2).astype(np.float32)
    x[0, 0] = 1.0   # the block's scale is then 2: every value within the grid's span
    draws = _draws(x, 400, compile, block=128, bits=4)
    grid = _signed4_grid() * 2
    index = np.searchsorted(grid, np.abs(x), side="right") - 1
    spacing = grid[np.minimum(index + 1, len(grid) - 1)] - grid[index]
    err = (draws.mean(0) - x) / np.where(spacing > 0, spacing, 1)
    assert np.abs(err).max() < 4 * 0.5 / np.sqrt(len(draws))
    assert abs(err.mean()) < 4 * 0.5 / np.sqrt(len(draws) * x.size)


@compilers
def test_zero_blocks_and_outliers_keep_to_their_block(compile):
    x = np.full((3, 256), 1e-3, np.float32)
    x[0] = 0.0                                  # a zero block
    x[1, 5] = 1e6                               # an outlier in the second block
    q = _quantized(x, compile=compile)
    got = np.asarray(dequantize(q))
    assert (got[0] == 0).all() and (np.asarray(q.values[0], np.float32) == 0).all()
    assert got[1, 5] == pytest.approx(1e6, rel=2.0 ** -4)  # float8 precision
    # The other values of the outlier's block are far below its range: kept nonzero, at
    # the smallest float8 value of that block (positive, never above their true value's
    # block range), while the third block keeps them to float8's precision.
    assert (got[1, np.arange(256) != 5] > 0).all()
    np.testing.assert_allclose(got[2], x[2], rtol=2.0 ** -4)


@pytest.mark.slow  # a system test: a training run (150 steps)
@compilers
def test_adam_trains_like_float32_on_a_regression(compile):
    w_true = RNG.randn(64, 256).astype(np.float32)
    xs = RNG.randn(512, 256).astype(np.float32)
    ys = xs @ w_true.T

    def loss(w):
        return jnp.mean((xs @ w.T - ys) ** 2)

    def train(tx, steps=150):
        w = jnp.zeros((64, 256))
        state = jax.jit(tx.init)(w)  # eagerly, quantizing compiles each operation apart

        @compile
        def step(w, state):
            updates, state = tx.update(jax.grad(loss)(w), state, w)
            return optax.apply_updates(w, updates), state

        for _ in range(steps):
            w, state = step(w, state)
        return float(jax.jit(loss)(w)), state

    float32, _ = train(optax.adam(3e-2))
    quantized, state = train(quantize_state(optax.adam(3e-2), min_size=0))
    assert isinstance(state.inner_state[0].nu, QuantizedArray)
    initial = float(jax.jit(loss)(jnp.zeros((64, 256))))
    assert float32 < 0.05 * initial
    assert quantized == pytest.approx(float32, rel=0.05)
    # 4 bits: coarser (Adam's noise floor is higher) but converging; with signed codes
    # for the second moment (no non-negative ones) it diverges.
    four, state = train(quantize_state(optax.adam(3e-2), bits=4, min_size=0))
    assert state.inner_state[0].nu.code == "nonnegative4"
    assert four < 1.5 * float32
    signed_nu, _ = train(quantize_state(optax.adam(3e-2), bits=4, min_size=0, nonnegative=()))
    assert not signed_nu < 10 * float32


@pytest.mark.parametrize("bits", [8, 4])
def test_init_called_eagerly_compiles_one_program(bits):
    # optax users call init outside jit: op by op, the quantization of each leaf shape
    # would compile ~50 programs (106 for these 3 leaves before; seconds per shape).
    compiles = []

    def listen(name, secs, **kw):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(name)

    params = {"a": jnp.ones((64, 256)), "b": jnp.ones((256, 64)), "c": jnp.full((64, 256), 2.0)}
    inner = optax.adam(1e-3)
    jax.block_until_ready(inner.init(params))  # the inner optimizer's own, compiled first
    # and the stochastic rounding's key (the PRNG's programs, once per process)
    jax.block_until_ready(quantize_state(inner, bits=bits).init({"w": jnp.ones((8, 256))}))
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        state = quantize_state(inner, bits=bits, min_size=0).init(params)
        jax.block_until_ready(state)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert isinstance(state.inner_state[0].mu["b"], QuantizedArray)
    assert len(compiles) <= 1, len(compiles)


def test_state_bytes_per_value():
    tx = quantize_state(optax.adam(1e-3))
    params = {"big": jnp.zeros((1024, 1024)), "small": jnp.zeros(100)}
    # The state's shapes and dtypes are what is counted: traced, not computed (eagerly,
    # quantizing 2**20 zeros compiles each of ~100 operations apart).
    state = jax.eval_shape(tx.init, params)
    nbytes = _stored_bytes(state.inner_state)
    # Two moments of 2**20 values at 1 + 1/256 bytes each, the small ones in float32.
    assert nbytes == pytest.approx(2 * (2 ** 20 * (1 + 1 / 256) + 400) + 4, rel=1e-4)
    assert state.inner_state[0].mu["small"].dtype == jnp.float32
    four = jax.eval_shape(quantize_state(optax.adam(1e-3), bits=4).init, params).inner_state
    assert _stored_bytes(four) == pytest.approx(
        2 * (2 ** 20 * (0.5 + 1 / 32) + 400) + 4, rel=1e-4)


def _stored_bytes(tree):
    """Bytes of the arrays of ``tree`` as XLA stores them: int4 two per byte (an
    array's ``nbytes`` counts a byte per int4 value)."""
    return sum(x.size * jax.dtypes.itemsize_bits(x.dtype) / 8 for x in jax.tree.leaves(tree))


@compilers
@pytest.mark.parametrize("bits", [8, 4])
def test_a_skipped_step_leaves_the_quantized_state_unchanged_bit_for_bit(bits, compile):
    tx = jmp_policy.loss_scaling(quantize_state(optax.adam(1e-2), bits=bits, min_size=0),
                                 2.0 ** 8)
    update = compile(tx.update)
    params = {"w": jnp.ones((4, 256))}
    state = tx.init(params)
    _, state = update({"w": jnp.full((4, 256), 3.0)}, state, params)
    bad = {"w": jnp.full((4, 256), jnp.inf)}
    updates, after = update(bad, state, params)
    assert (np.asarray(updates["w"]) == 0).all()
    inner = lambda s: jax.tree.leaves(s.inner_state)  # noqa: E731
    assert [np.asarray(a).tobytes() for a in inner(state)] == [
        np.asarray(b).tobytes() for b in inner(after)]


@compilers
@pytest.mark.parametrize("bits", [8, 4])
def test_resuming_from_host_copies_gives_the_same_next_step(bits, compile):
    tx = quantize_state(optax.adam(1e-2), bits=bits, min_size=0)
    update = compile(tx.update)
    params = {"w": jnp.ones((2, 512))}
    state = tx.init(params)
    grads = {"w": jnp.asarray(RNG.randn(2, 512).astype(np.float32))}
    _, state = update(grads, state, params)
    saved = jax.tree.map(np.asarray, state)              # what a checkpoint writes
    restored = jax.tree.map(jnp.asarray, saved)
    a, sa = update(grads, state, params)
    b, sb = update(grads, restored, params)
    chex.assert_trees_all_equal((a, sa), (b, sb))


@pytest.mark.parametrize("bits", [8, 4])
def test_composes_with_multisteps_and_inject_hyperparams(bits):
    inner = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    tx = optax.MultiSteps(quantize_state(inner, bits=bits, min_size=0), every_k_schedule=2)
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
    mu = jax.eval_shape(tx.init, {"w": jnp.zeros((8, 192))}).inner_state[0].mu["w"]
    assert isinstance(mu, QuantizedArray) and mu.exponents.shape == (8, 3)  # blocks of 64
    # 4 bits, odd blocks: int4 codes need no pairs within a block.
    tx = quantize_state(optax.trace(decay=0.0), bits=4, block_size=33, min_size=0)
    x = jnp.asarray(2.0 ** RNG.randint(-5, 1, (2, 66)), jnp.float32)   # on the grid
    _, state = jax.jit(tx.update)(x, jax.jit(tx.init)(x))
    assert state.inner_state.trace.exponents.shape == (2, 2)
    np.testing.assert_array_equal(dequantize(state.inner_state.trace), x)


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
    with pytest.warns(UserWarning, match=r"nonnegative rule 'nu_hat' matches no array"):
        quantize_state(optax.adam(1e-3), bits=4, min_size=0,
                       nonnegative="nu_hat").init({"w": params["w"]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantize_state(optax.adam(1e-3)).init(params)   # small arrays: quietly float32


@pytest.mark.parametrize("kwargs,match", [
    ({"block_size": 0}, "block_size must be a positive int"),
    ({"rounding": "stochastik"}, "did you mean 'stochastic'"),
    ({"bits": 2}, "bits must be 8 or 4"),
    ({"nonnegative": "nu"}, "nonnegative applies to 4-bit states"),
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
put = lambda tree: jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, spec)
facts = {}
for bits in (8, 4):
    tx = jmp_policy.quantize_state(optax.adam(1e-2), bits=bits, min_size=0)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    single = jax.jit(step)(params, tx.init(params), grads)
    with jax.set_mesh(mesh):
        state = jax.jit(tx.init)(put(params))
        text = jax.jit(step).lower(put(params), state, put(grads)).compile().as_text()
        # Through jit, not the compiled object: JAX (0.10) reports int4 arrays
        # sharded by a NamedSharding with an unpacked layout, which an ahead-of-time
        # executable refuses.
        sharded = jax.jit(step)(put(params), state, put(grads))
    moments = [sharded[1].inner_state[0].mu, sharded[1].inner_state[0].nu]
    facts[bits] = {
        "collectives": [op for op in ("all-gather", "all-to-all", "collective-permute")
                        if op in text],
        "values_like_params": all(m[k].values.sharding.is_equivalent_to(
            NamedSharding(mesh, spec[k]), 2) for m in moments for k in spec),
        "scales_like_params": all(m[k].exponents.sharding.is_equivalent_to(
            NamedSharding(mesh, spec[k]), 2) for m in moments for k in spec),
        "same_as_one_device": all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
                                  for a, b in zip(jax.tree.leaves(sharded),
                                                  jax.tree.leaves(single))),
    }
json.dump(facts, open(sys.argv[1], "w"))
"""


@pytest.mark.slow  # a system test: a child interpreter on 8 devices
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
    facts = {"collectives": [], "values_like_params": True, "scales_like_params": True,
             "same_as_one_device": True}
    assert json.loads(out.read_text()) == {"8": facts, "4": facts}


def test_codes_of_another_layout_are_refused():
    old = QuantizedArray(jnp.zeros((4, 128), jnp.uint8), jnp.zeros((4, 8), jnp.uint8), "signed4")
    with pytest.raises(ValueError, match=r"'signed4' codes are int4 .* got uint8\[4, 128\]"):
        dequantize(old)


@pytest.mark.parametrize("bits", [8, 4])
def test_orbax_checkpoint_resumes_bit_identically(tmp_path, bits):
    ocp = pytest.importorskip("orbax.checkpoint")
    tx = jmp_policy.loss_scaling(quantize_state(optax.adam(1e-2), bits=bits, min_size=0),
                                 "mixed_float16")
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
    mu = restored.inner_state.inner_state[0].mu["w"]
    assert mu.values.dtype == (jnp.float8_e4m3fn if bits == 8 else jnp.int4)
    chex.assert_trees_all_equal(step(restored), step(state))


@pytest.mark.parametrize("make", [
    lambda: optax.lion(1e-3), lambda: optax.sgd(1e-2, momentum=0.9),
    lambda: optax.adafactor(1e-2), lambda: optax.adamw(1e-3)])
@pytest.mark.parametrize("bits", [8, 4])
def test_any_optimizer_steps_like_its_float32_self(make, bits):
    params = {"w": jnp.asarray(RNG.randn(8, 256).astype(np.float32))}
    grads = [{"w": jnp.asarray(RNG.randn(8, 256).astype(np.float32))} for _ in range(3)]

    def run(tx):
        state, out = tx.init(params), []
        update = jax.jit(tx.update)  # one program: eagerly, each step's operations compile apart
        for g in grads:
            updates, state = update(g, state, params)
            out.append(updates["w"])
        return np.stack(out), state

    want, _ = run(make())
    got, state = run(quantize_state(make(), bits=bits, min_size=64))  # adafactor: rows stay
    assert any(isinstance(x, QuantizedArray) for x in jax.tree.leaves(
        state.inner_state, is_leaf=lambda x: isinstance(x, QuantizedArray)))
    assert np.isfinite(got).all()
    # Float8 holds 3 mantissa bits: the moments, and so the steps, within ~6% (Lion's
    # steps are signs: equal but where a moment is near zero).
    # 4 bits: powers of two apart, steps within 5-21% here.
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < (0.1 if bits == 8 else 0.3), err


@pytest.mark.parametrize("bits,rounding", [(8, "stochastic"), (8, "nearest"), (4, "stochastic")])
def test_the_step_keeps_no_float32_copy_of_the_state(bits, rounding):
    tx = quantize_state(optax.adam(1e-3), bits=bits, rounding=rounding)
    params = {f"w{i}": jnp.zeros((256, 1024)) for i in range(4)}
    state = jax.eval_shape(tx.init, params)  # compiled, not run: its shapes suffice

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def temp(donate):
        compiled = jax.jit(step, donate_argnums=donate).lower(params, state, params).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    leaf = 4 * 256 * 1024          # one float32 copy of the largest leaf
    quantized = _stored_bytes(state.inner_state)
    assert temp(()) < 0.1 * leaf
    # Donated, XLA:CPU copies the old quantized state first (apply_updates reads it
    # after the new state may be written in place), but still stores no float32 state.
    assert temp((0, 1)) <= quantized + 0.1 * leaf


@pytest.mark.slow  # a system test: a training run (30 steps)
@pytest.mark.parametrize("bits", [8, 4])
def test_nnx_optimizer_keeps_the_quantized_state_across_steps(bits):
    nnx = pytest.importorskip("flax.nnx")
    x = jnp.asarray(RNG.randn(16, 256).astype(np.float32))

    def train(tx):
        model = nnx.Linear(256, 256, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer):
            loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(model)
            optimizer.update(model, grads)
            return loss

        return [float(step(model, optimizer)) for _ in range(30)], optimizer

    want, _ = train(optax.adam(1e-2))
    got, optimizer = train(quantize_state(optax.adam(1e-2), bits=bits, min_size=0))
    # nnx.Optimizer keeps a Variable per array: each field of the QuantizedArray.
    mu = nnx.as_pure(optimizer.opt_state).inner_state[0].mu["kernel"]
    assert isinstance(mu, QuantizedArray)
    assert mu.values.dtype == (jnp.float8_e4m3fn if bits == 8 else jnp.int4)
    assert got[-1] < 0.3 * got[0] and abs(got[-1] - want[-1]) < 0.1 * want[0], (got, want)


@pytest.mark.parametrize("bits,rounding", [(8, "stochastic"), (4, "stochastic"), (8, "nearest")])
def test_the_step_compiles_to_the_same_kernels_for_any_number_of_same_shaped_leaves(bits,
                                                                                     rounding):
    # What a model's depth adds to the step is more of the same kernels, which XLA
    # compiles once (XLA:GPU) or cheaply: no kernel may be specific to one leaf (a
    # seed per leaf, sliced from an array of seeds, made every leaf's kernels distinct
    # and the compile ~10x Adam's at 96 leaves).
    tx = quantize_state(optax.adam(1e-3), bits=bits, min_size=0, rounding=rounding)
    kernels = [step_kernels(tx, {f"w{i}": jax.ShapeDtypeStruct((8, 256), jnp.float32)
                                 for i in range(n)}) for n in (2, 6)]
    assert kernels[0] == kernels[1]


# --- what is quantized: the moments, not parameter copies or gradients ------------------

def _kinds(state):
    """Key path -> "quantized" or the dtype, for every large array of ``state``."""
    leaves = jax.tree_util.tree_leaves_with_path(
        state, is_leaf=lambda x: isinstance(x, QuantizedArray))
    return {jax.tree_util.keystr(p): "quantized" if isinstance(x, QuantizedArray) else str(x.dtype)
            for p, x in leaves if isinstance(x, QuantizedArray) or np.size(x) >= 4096}


def test_parameter_iterates_and_accumulated_gradients_stay_float32():
    params = {"w": jnp.ones((64, 128))}
    schedule_free = _kinds(quantize_state(optax.contrib.schedule_free_adamw(1e-3)).init(params))
    assert schedule_free[".inner_state.z['w']"] == "float32", schedule_free  # the iterate
    assert schedule_free[".inner_state.base_optimizer_state[0].nu['w']"] == "quantized"
    accumulated = _kinds(quantize_state(optax.MultiSteps(optax.adam(1e-3), 4)).init(params))
    assert accumulated[".inner_state.acc_grads['w']"] == "float32", accumulated
    assert accumulated[".inner_state.inner_opt_state[0].mu['w']"] == "quantized"


@pytest.mark.slow  # a system test: a training run (300 steps)
def test_schedule_free_trains_as_in_float32_with_its_iterate_kept():
    # The iterate z is the parameters' own history: quantized, this problem's loss ends
    # over 2x float32's; with the moments alone quantized (the default) it matches.
    target = jnp.asarray(np.random.default_rng(0).normal(size=(64, 128)), jnp.float32)
    loss = lambda p: jnp.mean((p["w"] - target) ** 2)

    def final_loss(tx):
        def step(carry, _):
            params, state = carry
            updates, state = tx.update(jax.grad(loss)(params), state, params)
            return (optax.apply_updates(params, updates), state), None

        params = {"w": jnp.zeros((64, 128))}
        (params, _), _ = jax.jit(lambda c: jax.lax.scan(step, c, None, 300))(
            (params, tx.init(params)))
        return float(loss(params))

    base = optax.contrib.schedule_free_adamw(1e-1)
    float32 = final_loss(base)
    assert final_loss(quantize_state(base)) <= 1.2 * float32
    assert final_loss(quantize_state(base, moments=(r"\.nu\b", r"\.z\b"))) > 2 * float32


def test_a_state_with_no_moment_named_warns_and_moments_names_it():
    def init(params):
        return {"buf": jax.tree.map(jnp.zeros_like, params)}

    def update(updates, state, params=None):
        return updates, {"buf": jax.tree.map(lambda b, g: 0.9 * b + g, state["buf"], updates)}

    params = {"w": jnp.ones((64, 128))}
    with pytest.warns(UserWarning, match="no state array is quantized.*moments="):
        quantize_state(optax.GradientTransformation(init, update)).init(params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = quantize_state(optax.GradientTransformation(init, update),
                               moments=r"\['buf'\]").init(params)
    assert isinstance(state.inner_state["buf"]["w"], QuantizedArray)
