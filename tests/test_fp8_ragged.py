"""Tests for float8 mixture-of-experts products through autocast: ``lax.ragged_dot``
(``ragged_dot_general``) under ``autocast(fn, policy, fp8=...)``, forward and backward,
with tensorwise and rowwise scaling. Operands and gradients differ in magnitude from
group to group, so that a scale applied to the wrong group, or one per tensor where
the recipe asks for one per group, shows in the per-group errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

from support.excess_precision import COMPILERS
from support.jaxpr_walk import eqns
from jmp_policy import AutocastWarning, Float8Recipe, autocast

E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
SCALINGS = ("tensorwise", "rowwise")
# The numerics tests run as XLA:CPU compiles them and as XLA:GPU does
# (tests/support/excess_precision.py).
compilers = pytest.mark.parametrize("compile", list(COMPILERS.values()), ids=list(COMPILERS))

M, K, N = 96, 64, 48
SIZES = (24, 0, 40, 32)  # an empty group; they sum to M
# Per group: the magnitude of lhs's rows, rhs's matrix and the incoming gradient's rows.
X_MAGNITUDE = np.array([1.0, 1.0, 0.125, 4.0])
W_MAGNITUDE = np.array([1.0, 100.0, 1 / 16, 8.0])
CT_MAGNITUDE = np.array([2.0, 1.0, 0.05, 1.0])


def rng(*shape, seed=0):
    return np.asarray(jax.random.normal(jax.random.key(seed), shape))


def rel_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def groups_of(sizes):
    """The slices of rows of each group."""
    ends = np.cumsum(sizes)
    return [slice(end - size, end) for size, end in zip(sizes, ends)]


def operands(sizes=SIZES, m=M):
    """``(x [m, K], w [G, K, N], ct [m, N], sizes)``, magnitudes varying by group."""
    rows = np.zeros(m, int)
    rows[:sum(sizes)] = np.repeat(np.arange(len(sizes)), sizes)
    x = rng(m, K) * X_MAGNITUDE[rows, None]
    w = rng(len(sizes), K, N, seed=1) * K ** -0.5 * W_MAGNITUDE[:, None, None]
    ct = rng(m, N, seed=2) * CT_MAGNITUDE[rows, None]
    return (jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32),
            jnp.asarray(ct, jnp.float32), jnp.asarray(sizes, jnp.int32))


def with_gradients(f, compile=jax.jit):
    """``f(x, w, sizes)``, and its gradients with respect to x and w for cotangent ct,
    compiled with ``compile``."""
    def run(x, w, ct, sizes):
        out, vjp = jax.vjp(lambda x, w: f(x, w, sizes), x, w)
        return (out, *vjp(ct.astype(out.dtype)))
    return compile(run)


def ragged_products(fn, *args):
    """``(lhs dtype, rhs dtype, accumulation dtype, ragged contracting)`` of every
    ragged_dot_general of ``fn``'s jaxpr under jit."""
    found = []
    for e in eqns(jax.make_jaxpr(jax.jit(fn))(*args)):
        if e.primitive.name == "ragged_dot_general":
            dims = e.params["ragged_dot_dimension_numbers"]
            found.append((np.dtype(e.invars[0].aval.dtype), np.dtype(e.invars[1].aval.dtype),
                          np.dtype(e.params["preferred_element_type"] or e.outvars[0].aval.dtype),
                          not dims.rhs_group_dimensions))
    return found


def moe_product(x, w, sizes):
    return lax.ragged_dot(x, w, sizes)


# --- which products run in float8, in which formats ----------------------------------------

@pytest.mark.parametrize("scaling", SCALINGS)
def test_ragged_products_are_float8_forward_and_backward(scaling):
    x, w, ct, sizes = operands()
    f = autocast(moe_product, "mixed_bfloat16", fp8=scaling)
    assert ragged_products(f, x, w, sizes) == [(E4M3, E4M3, F32, False)]
    # Backward: lhs's gradient (gradient x rhs, per group) and rhs's (lhs x gradient,
    # summed over each group's rows: ragged contracting), e5m2 gradients.
    assert ragged_products(with_gradients(f), x, w, ct, sizes) == [
        (E4M3, E4M3, F32, False), (E5M2, E4M3, F32, False), (E4M3, E5M2, F32, True)]
    # Weight gradient out of float8: the compute dtype, as the matmul class runs it.
    f = autocast(moe_product, "mixed_bfloat16",
                 fp8=Float8Recipe(scaling, float8_weight_gradient=False))
    assert ragged_products(with_gradients(f), x, w, ct, sizes)[1:] == [
        (E5M2, E4M3, F32, False), (BF16, BF16, BF16, True)]


def test_small_excluded_and_other_layouts_stay_in_the_compute_dtype():
    x, w, ct, sizes = operands()
    bf16 = [(BF16, BF16, BF16, False), (BF16, BF16, BF16, False), (BF16, BF16, BF16, True)]

    def scoped(x, w, sizes):
        with jax.named_scope("experts"):
            return lax.ragged_dot(x, w, sizes)

    for fn, recipe in ((moe_product, Float8Recipe(min_size=K + 1)),  # k below min_size
                       (moe_product, Float8Recipe(min_size=M + 1)),  # m below min_size
                       (scoped, Float8Recipe(exclude="experts"))):
        f = autocast(fn, "mixed_bfloat16", fp8=recipe)
        with pytest.warns(AutocastWarning, match="none of its matrix products is eligible"):
            assert sorted(ragged_products(with_gradients(f), x, w, ct, sizes)) == sorted(bf16)
    # n (the output columns, the groups aside) counts too: 48 columns, 4 groups.
    f = autocast(moe_product, "mixed_bfloat16", fp8=Float8Recipe(min_size=N + 1))
    with pytest.warns(AutocastWarning):
        assert ragged_products(f, x, w, sizes) == bf16[:1]
    # A ragged product contracting its ragged dimension (per-group sums) is another layout.
    dims = lax.RaggedDotDimensionNumbers((([0], [0]), ([], [])), [0], [])
    f = autocast(lambda x, ct, sizes: lax.ragged_dot_general(x, ct, sizes, dims),
                 "mixed_bfloat16", fp8="rowwise")
    with pytest.warns(AutocastWarning):
        assert ragged_products(f, x, ct, sizes) == [(BF16, BF16, BF16, True)]


# --- accuracy ---------------------------------------------------------------------------

@compilers
@pytest.mark.parametrize("scaling", SCALINGS)
def test_values_and_gradients_are_close_to_float32_in_every_group(scaling, compile):
    x, w, ct, sizes = operands()
    f = autocast(moe_product, "mixed_bfloat16", fp8=scaling)
    got = with_gradients(f, compile)(x, w, ct, sizes)
    want = with_gradients(moe_product)(x, w, ct, sizes)
    errors = {"out": [], "grad_x": [], "grad_w": []}
    for group, rows in enumerate(groups_of(SIZES)):
        if rows.start == rows.stop:  # the empty group: no rows, a zero weight gradient
            assert not np.asarray(got[2][group]).any()
            continue
        errors["out"].append(rel_error(got[0][rows], want[0][rows]))
        errors["grad_x"].append(rel_error(got[1][rows], want[1][rows]))
        errors["grad_w"].append(rel_error(got[2][group], want[2][group]))
    # Forward, e4m3 operands; backward, an e5m2 gradient, with fewer mantissa bits.
    assert max(errors["out"]) < 0.05, errors
    assert max(errors["grad_x"] + errors["grad_w"]) < 0.08, errors


@compilers
def test_rowwise_scales_each_group_apart(compile):
    # One expert's weights are 1e4 times smaller than the others': a scale for the whole
    # tensor puts them below float8_e4m3fn's range; one per group and column does not.
    x, w, ct, sizes = operands()
    w = w.at[0].multiply(1e-4)
    want = with_gradients(moe_product)(x, w, ct, sizes)
    rows = groups_of(SIZES)[0]
    errors = {}
    for scaling in SCALINGS:
        f = autocast(moe_product, "float32", fp8=scaling)
        got = with_gradients(f, compile)(x, w, ct, sizes)
        errors[scaling] = (rel_error(got[0][rows], want[0][rows]),
                           rel_error(got[1][rows], want[1][rows]))
    assert max(errors["rowwise"]) < 0.08 and min(errors["tensorwise"]) > 0.5, errors


def test_rhs_laid_out_groups_by_columns_by_contracting():
    # lax.ragged_dot_general with rhs [g, n, k] (a weight stored transposed).
    x, w, ct, sizes = operands()
    dims = lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), [0], [0])
    product = lambda x, w, sizes: lax.ragged_dot_general(x, w, sizes, dims)  # noqa: E731
    f = autocast(product, "mixed_bfloat16", fp8="rowwise")
    wt = jnp.swapaxes(w, 1, 2)
    assert [d[:2] for d in ragged_products(with_gradients(f), x, wt, ct, sizes)] == [
        (E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]
    got, want = with_gradients(f)(x, wt, ct, sizes), with_gradients(product)(x, wt, ct, sizes)
    assert got[2].shape == wt.shape
    for g, expected in zip(got, want):
        assert rel_error(g, expected) < 0.08


# --- rows in no group, zeros, non-finite values -----------------------------------------

@pytest.mark.parametrize("scaling", SCALINGS)
def test_rows_past_the_groups_give_zeros_and_count_in_no_scale(scaling):
    sizes = (24, 0, 40, 12)  # 76 of 96 rows; the 20 others belong to no group
    x, w, ct, sizes = operands(sizes)
    # Garbage in the rows past the groups, as a capacity-padded dispatch may leave.
    x = x.at[80:].set(1e30).at[90, 3].set(np.inf)
    f = with_gradients(autocast(moe_product, "mixed_bfloat16", fp8=scaling))
    out, grad_x, grad_w = f(x, w, ct, sizes)
    assert not np.asarray(out[76:]).any() and not np.asarray(grad_x[76:]).any()
    assert all(np.isfinite(g).all() for g in (out, grad_x, grad_w))
    want = with_gradients(moe_product)(x, w, ct, sizes)
    for got, expected in zip((out[:76], grad_x[:76], grad_w), (want[0][:76], want[1][:76],
                                                             want[2])):
        assert rel_error(got, expected) < 0.08


@pytest.mark.parametrize("scaling", SCALINGS)
def test_all_zero_groups_and_rows_give_finite_gradients(scaling):
    x, w, ct, sizes = operands()
    groups = groups_of(SIZES)
    x = x.at[groups[2]].set(0.0).at[5:9].set(0.0)  # a group's rows, and rows of another
    w = w.at[3].set(0.0)  # an expert's weights
    ct = ct.at[groups[0]].set(0.0)  # no gradient reaches a group
    out, grad_x, grad_w = with_gradients(
        autocast(moe_product, "mixed_bfloat16", fp8=scaling))(x, w, ct, sizes)
    assert all(np.isfinite(g).all() for g in (out, grad_x, grad_w))
    assert not np.asarray(out[groups[2]]).any() and not np.asarray(out[groups[3]]).any()
    assert not np.asarray(grad_w[2]).any() and not np.asarray(grad_w[0]).any()
    assert not np.asarray(grad_x[groups[0]]).any() and not np.asarray(grad_x[groups[3]]).any()
    want = with_gradients(moe_product)(x, w, ct, sizes)
    assert rel_error(out, want[0]) < 0.05
    assert rel_error(grad_x, want[1]) < 0.08 and rel_error(grad_w, want[2]) < 0.08


@compilers
@pytest.mark.parametrize("scaling", SCALINGS)
def test_non_finite_values_give_non_finite_products(scaling, compile):
    x, w, ct, sizes = operands()
    f = with_gradients(autocast(moe_product, "mixed_bfloat16", fp8=scaling), compile)
    groups = groups_of(SIZES)
    for bad in (np.inf, -np.inf, np.nan):
        # In lhs row 30 (group 2): its output row and its group's weight gradient.
        out, _, grad_w = f(x.at[30, 5].set(bad), w, ct, sizes)
        assert not np.isfinite(out[30]).any() and not np.isfinite(grad_w[2]).all()
        if scaling == "rowwise":  # the other rows and groups are unharmed
            assert np.isfinite(np.delete(np.asarray(out), 30, axis=0)).all()
            assert np.isfinite(grad_w[0]).all() and np.isfinite(grad_w[3]).all()
        # In the incoming gradient of row 70 (group 3): its row of lhs's gradient, and
        # its group's weight gradient (a per-group maximum must not drop NaN).
        _, grad_x, grad_w = f(x, w, ct.at[70, 1].set(bad), sizes)
        assert not np.isfinite(grad_x[70]).any() and not np.isfinite(grad_w[3]).all()
        if scaling == "rowwise":
            assert np.isfinite(grad_w[:3]).all()
            assert np.isfinite(grad_x[groups[3].start:70]).all()


# --- a mixture-of-experts layer, trained --------------------------------------------------

EXPERTS, D, HIDDEN, TOKENS = 4, 32, 64, 128


def moe_layer(params, x):
    """Top-1 routing as users write it: sort tokens by expert, a ragged_dot per expert
    layer, unsort, scale by the router's probability."""
    probs = jax.nn.softmax(x @ params["router"])
    expert = jnp.argmax(probs, axis=-1)
    gate = jnp.max(probs, axis=-1)
    order = jnp.argsort(expert)
    sizes = jnp.bincount(expert, length=EXPERTS).astype(jnp.int32)
    h = jax.nn.gelu(lax.ragged_dot(x[order], params["w1"], sizes))
    y = lax.ragged_dot(h, params["w2"], sizes)
    y = y[jnp.argsort(order)]
    return x + y * gate[:, None]


@pytest.mark.slow  # a system test: a training run
@pytest.mark.parametrize("scaling", SCALINGS)
def test_a_mixture_of_experts_layer_trains(scaling):
    keys = jax.random.split(jax.random.key(3), 5)
    params = {"router": jax.random.normal(keys[0], (D, EXPERTS)),
              "w1": jax.random.normal(keys[1], (EXPERTS, D, HIDDEN)) * D ** -0.5,
              "w2": jax.random.normal(keys[2], (EXPERTS, HIDDEN, D)) * HIDDEN ** -0.5}
    x = jax.random.normal(keys[3], (TOKENS, D))
    target = jnp.tanh(x @ jax.random.normal(keys[4], (D, D)) * D ** -0.5)
    layer = autocast(moe_layer, "mixed_bfloat16", fp8=scaling)

    def loss(params):
        return jnp.mean((layer(params, x).astype(jnp.float32) - target) ** 2)

    tx = optax.adam(1e-2)

    @jax.jit
    def step(params, opt_state):
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, grads

    # Two expert layers, three float8 products each (the router, 4 experts wide, is
    # below min_size and stays in bfloat16).
    formats = [d[:2] for d in ragged_products(step, params, tx.init(params))]
    assert sorted(formats) == sorted([(E4M3, E4M3)] * 2 + [(E5M2, E4M3), (E4M3, E5M2)] * 2)
    opt_state, losses = tx.init(params), []
    want = jax.jit(jax.grad(lambda p: jnp.mean((moe_layer(p, x) - target) ** 2)))(params)
    for i in range(5):
        params, opt_state, value, grads = step(params, opt_state)
        if i == 0:  # the float8 gradients are those of the float32 layer
            assert all(rel_error(grads[k], want[k]) < 0.1 for k in ("w1", "w2"))
        losses.append(float(value))
    assert np.isfinite(losses).all() and losses[-1] < 0.9 * losses[0], losses
