"""The number-format core (jmp_policy.formats): rounding as a conversion rounds, on every backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_policy import formats
from support.excess_precision import with_excess_precision

NARROW = [jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float4_e2m1fn]
ids = [np.dtype(d).name for d in NARROW]


def same_bits(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))


def values(dtype, n=200_000, seed=0):
    """Float32 values across the whole float32 range, around ``dtype``'s range, its
    grid's midpoints (the ties) and its edges."""
    rng = np.random.default_rng(seed)
    fmt = formats.format_of(dtype)
    anything = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    e = rng.uniform(fmt.min_exponent - fmt.mantissa - 3, np.log2(fmt.max) + 1.5, size=n)
    near = (np.where(rng.random(n) < 0.5, -1, 1) * 2.0 ** e).astype(np.float32)
    grid = np.unique(np.abs(np.asarray(jnp.asarray(near).astype(dtype).astype(jnp.float32))))
    grid = grid[np.isfinite(grid)].astype(np.float64)
    ties = ((grid[1:] + grid[:-1]) / 2).astype(np.float32)
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, fmt.max, fmt.tiny, fmt.smallest,
                      fmt.smallest / 2, fmt.smallest * 1.5], np.float32)
    return np.concatenate([anything, near, ties, -ties, edges, -edges])


@pytest.mark.parametrize("dtype", NARROW, ids=ids)
def test_round_nearest_is_the_conversion_bit_for_bit(dtype):
    """Against ml_dtypes' conversion (the tests run XLA:CPU's older emitters, whose
    conversion to float4_e2m1fn rounds twice: 0.7499 becomes 1)."""
    x = values(dtype)
    with np.errstate(all="ignore"):
        want = x.astype(np.dtype(dtype)).astype(np.float32)
    got = np.asarray(jax.jit(lambda v: formats.round_nearest(v, dtype))(x))
    if formats.format_of(dtype).overflow == "saturate":  # no NaN: ml_dtypes gives +0, XLA -0
        nan = np.isnan(x)
        assert (got[nan] == 0).all()
        want, got = want[~nan], got[~nan]
    assert same_bits(want, got).all()


@pytest.mark.parametrize("dtype", NARROW, ids=ids)
def test_widen_keeps_the_rounding_when_the_compiler_removes_the_round_trip(dtype):
    """With the conversions moved across a reshape and removed (as XLA:GPU does), the
    plain round trip is no rounding at all; `widen` still gives the format's values."""
    x = values(dtype, n=20_000)[:40_000].reshape(200, -1)
    plain = lambda v: jnp.reshape(v.astype(dtype), (-1,)).astype(jnp.float32)  # noqa: E731
    robust = lambda v: formats.widen(jnp.reshape(v.astype(dtype), (-1,)))  # noqa: E731
    # ml_dtypes' conversion: XLA:CPU's to float4 rounds twice; NaN aside (float4 has
    # none: ml_dtypes makes it +0, XLA -0).
    with np.errstate(all="ignore"):
        want = x.astype(np.dtype(dtype)).astype(np.float32).reshape(-1)
    number = ~np.isnan(x.reshape(-1))
    gpu_like = np.asarray(jax.jit(with_excess_precision(robust))(x))
    assert same_bits(want[number], gpu_like[number]).all()
    # The emulation does remove the plain round trip: the test can tell.
    assert not same_bits(want, jax.jit(with_excess_precision(plain))(x)).all()


@pytest.mark.parametrize("dtype", NARROW, ids=ids)
def test_round_stochastic_is_unbiased_and_on_the_grid(dtype):
    fmt = formats.format_of(dtype)
    rng = np.random.default_rng(1)
    e = rng.uniform(fmt.min_exponent - fmt.mantissa - 2, np.log2(fmt.max), size=500)
    v = (np.where(rng.random(500) < 0.5, -1, 1) * 2.0 ** e).astype(np.float32)
    n = 2000
    draw = lambda s: formats.round_stochastic(  # noqa: E731
        v, dtype, formats.random_bits(jnp.stack([s, s ^ 0xABCD]), v.shape))
    draws = np.asarray(jax.jit(jax.vmap(draw))(jnp.arange(n, dtype=jnp.uint32)), np.float64)
    assert same_bits(formats.round_nearest(draws, dtype), draws).all()  # on the grid
    low, high = draws.min(0), draws.max(0)
    assert (high - low <= np.abs(np.asarray(formats.round_nearest(v, dtype)) - v) * 2
            + np.spacing(np.abs(v).astype(np.float32)) * 2 ** 30).all()  # two neighbours
    # The grid's spacing at v (not the draws' range: a value within 0.1% of a gap of its
    # upper neighbour may well never round down in 2000 draws).
    binade = np.maximum(np.floor(np.log2(np.abs(v).astype(np.float64))), fmt.min_exponent)
    gap = 2.0 ** (binade - fmt.mantissa)
    z = (draws.mean(0) - v) / gap * np.sqrt(n) / 0.5  # at most 0.5 gaps of deviation per draw
    assert np.abs(z).max() < 5 and abs(z.mean()) < 5 / np.sqrt(len(v))
    # Values beyond the largest, infs and NaNs round as to nearest.
    edge = jnp.array([fmt.max * 4, -np.inf, np.nan], jnp.float32)
    bits = formats.random_bits(jnp.array([3, 4], jnp.uint32), edge.shape)
    assert same_bits(formats.round_stochastic(edge, dtype, bits),
                     formats.round_nearest(edge, dtype)).all()


def test_random_bits_are_uniform_and_differ_by_seed():
    a = np.asarray(formats.random_bits(jnp.array([0, 0], jnp.uint32), (64, 1024)))
    b = np.asarray(formats.random_bits(jnp.array([1, 0], jnp.uint32), (64, 1024)))
    assert a.shape == (64, 1024) and (a != b).mean() > 0.99
    for bit in (0, 15, 31):
        assert abs(((a >> bit) & 1).mean() - 0.5) < 0.01


def test_format_of_refuses_what_is_not_a_narrow_float():
    with pytest.raises(ValueError, match="narrower than float32"):
        formats.format_of(jnp.float32)
    with pytest.raises(ValueError, match="narrower than float32"):
        formats.format_of(jnp.int8)
    with pytest.raises(ValueError, match="no mantissa"):
        formats.format_of(jnp.float8_e8m0fnu)


def test_a_grid_without_a_dtype_rounds_as_the_format_it_describes():
    """float4_e2m1fn is the grid of one mantissa bit from 1 (subnormal 0.5) up to 6:
    `grid` describes it without its dtype, and both roundings give the same values."""
    e2m1, g = jnp.float4_e2m1fn, formats.grid(1, 0, 6.0)
    x = values(e2m1, n=20_000)
    x = x[~np.isnan(x)]
    assert same_bits(formats.round_nearest(x, g), formats.round_nearest(x, e2m1)).all()
    bits = formats.random_bits(jnp.array([5, 6], jnp.uint32), x.shape)
    assert same_bits(formats.round_stochastic(x, g, bits),
                     formats.round_stochastic(x, e2m1, bits)).all()
    # No mantissa bits: the powers of two from 2**-6 to 1, and zero below.
    powers = formats.round_nearest(jnp.array([0.7, 0.74, 0.76, 3.0, 0.004, 0.01]),
                                   formats.grid(0, -6, 1.0))
    assert powers.tolist() == [0.5, 0.5, 1.0, 1.0, 0.0, 2.0 ** -6]


@pytest.mark.parametrize("bound", [448.0, 57344.0, 256.0, 1.0])
@pytest.mark.parametrize("strict", [False, True])
def test_scale_exponent_is_the_smallest_power_of_two_that_brings_the_maximum_within_bound(
        bound, strict):
    # The one block-scale rule of MXFP8 (amax / s <= max) and quantize_state
    # (amax / s < 2**R): checked against the powers of two around it.
    rng = np.random.default_rng(0)
    amax = np.concatenate([2.0 ** rng.uniform(-60, 60, 2000),
                           2.0 ** rng.integers(-60, 60, 200).astype(np.float64),
                           bound * 2.0 ** rng.integers(-20, 20, 200).astype(np.float64)])
    amax = amax.astype(np.float32)
    e = np.asarray(formats.scale_exponent(jnp.asarray(amax), bound, strict=strict))
    s, below = 2.0 ** (e.astype(np.float64) - 127), 2.0 ** (e.astype(np.float64) - 128)
    ratio = (amax / np.float32(bound)).astype(np.float32).astype(np.float64)  # float32's quotient
    within = (lambda r: r < 1) if strict else (lambda r: r <= 1)
    assert within(ratio / s).all() and not within(ratio / below).any()


def test_saturate_clamps_finite_values_and_keeps_inf_and_nan():
    x = jnp.array([0.0, -0.0, 1e-40, 447.9, 448.0, 449.0, -3e38, jnp.inf, -jnp.inf, jnp.nan])
    got = np.asarray(formats.saturate(x, 448.0))
    want = np.clip(np.asarray(x), -448.0, 448.0)
    want[7:9] = [np.inf, -np.inf]
    np.testing.assert_array_equal(got[:9], want[:9])
    assert np.isnan(got[9]) and np.signbit(got[1])  # NaN stays NaN, -0 stays -0
    compiled = jax.jit(lambda x: formats.saturate(x, 448.0)).lower(x).as_text()
    assert "compare" not in compiled and "select" not in compiled  # no pred array


def test_a_value_repeated_at_the_same_position_rounds_the_same_way():
    # An element's random bits are a hash of the seed, its position in the whole array and
    # its value: the same value at the same position rounds the same way with one seed;
    # elsewhere, or with another value, it draws again.
    rng = np.random.default_rng(0)
    x = rng.uniform(-6, 6, 4096).astype(np.float32)
    y = x.copy()
    y[::2] = rng.uniform(-6, 6, 2048).astype(np.float32)
    seed, e2m1 = jnp.array([3, 9], jnp.uint32), jnp.float4_e2m1fn
    ex, ey = (np.asarray(formats.encode(v, e2m1, seed), np.float32) for v in (x, y))
    np.testing.assert_array_equal(ex[1::2], ey[1::2])
    assert same_bits(ex, formats.round_stochastic(x, e2m1, formats.salted_bits(seed, x))).all()
    again = np.asarray(formats.encode(np.full(4096, 4.5, np.float32), e2m1, seed), np.float32)
    assert set(again.tolist()) == {4.0, 6.0}  # one value, many positions: both neighbours
    # One bit more: other draws for the values between two neighbours.
    nudged = np.asarray(formats.encode(np.nextafter(x, np.inf), e2m1, seed), np.float32)
    assert (nudged != ex).mean() > 0.1


def test_seed_streams_are_distinct_and_fixed_seeds_are_two_words():
    streams = formats.SEED_STREAMS
    assert len(set(streams)) == len(streams)
    seed = formats.fixed_seed(streams.lhs_gradient)
    assert seed.dtype == jnp.uint32 and seed.shape == (2,)
    assert not (seed == formats.fixed_seed(streams.rhs_gradient)).all()
