"""Tests for jmp_policy.loss_scale: loss-scale objects, all_finite, select_tree."""

import random
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy
from jmp_policy import DynamicLossScale, NoOpLossScale, StaticLossScale

TINY = np.finfo(np.float32).tiny


# ---------------------------------------------------------------------------
# Pytree layout and static settings.


def test_dynamic_leaves_are_exactly_scale_and_counter():
    ls = DynamicLossScale(2.0**10, counter=3, period=7, factor=3, min_loss_scale=0.5,
                          max_loss_scale=2.0**20)
    leaves = jax.tree_util.tree_leaves(ls)
    assert len(leaves) == 2
    scale, counter = leaves
    assert scale.shape == () and scale.dtype == jnp.float32 and float(scale) == 1024.0
    assert counter.shape == () and counter.dtype == jnp.int32 and int(counter) == 3
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(ls)[0]]
    assert paths == [".loss_scale", ".counter"]


@pytest.mark.parametrize("ls", [NoOpLossScale(), StaticLossScale(8.0)])
def test_noop_and_static_have_no_leaves(ls):
    assert jax.tree_util.tree_leaves(ls) == []
    assert jax.tree_util.tree_map(lambda x: x, ls) == ls


def test_static_settings_survive_jit_and_tree_map():
    ls = DynamicLossScale(2.0**10, period=7, factor=3, min_loss_scale=0.5, max_loss_scale=2.0**20)
    settings = lambda s: (s.period, s.factor, s.min_loss_scale, s.max_loss_scale)
    jitted = jax.jit(lambda s: s.adjust(jnp.array(False)))(ls)
    mapped = jax.tree_util.tree_map(lambda x: x + 0, ls)
    assert settings(jitted) == settings(mapped) == settings(ls) == (7, 3, 0.5, 2.0**20)
    assert float(jitted.loss_scale) == np.float32(1024.0 / 3)


def test_unflatten_with_placeholders_and_construction_under_jit():
    ls = DynamicLossScale()
    treedef = jax.tree_util.tree_structure(ls)
    rebuilt = jax.tree_util.tree_unflatten(treedef, [object(), None])  # JAX does this internally
    assert rebuilt.period == 2000

    @jax.jit
    def build(scale, counter):
        return DynamicLossScale(scale, counter, period=5).adjust(jnp.array(True))

    out = build(jnp.float32(4.0), jnp.int32(4))
    assert float(out.loss_scale) == 8.0 and int(out.counter) == 0


def test_float16_initial_scale_is_stored_as_float32_and_can_grow():
    # jmp bug: a float16 2**15 overflowed to inf on its first growth.
    ls = DynamicLossScale(jnp.float16(2.0**15), period=1)
    assert ls.loss_scale.dtype == jnp.float32
    for _ in range(3):
        ls = ls.adjust(jnp.array(True))
    assert ls.loss_scale.dtype == jnp.float32 and float(ls.loss_scale) == 2.0**18


# ---------------------------------------------------------------------------
# scale / unscale.


@pytest.mark.parametrize("ls", [StaticLossScale(2.0**16), DynamicLossScale(2.0**16)])
def test_scale_and_unscale_keep_leaf_dtypes(ls):
    tree = {
        "f16": jnp.full((3,), 2.0**-10, jnp.float16),
        "bf16": jnp.full((3,), 0.5, jnp.bfloat16),
        "f32": jnp.full((3,), 3.0, jnp.float32),
        "i32": jnp.arange(3, dtype=jnp.int32),
        "none": None,
    }
    scaled = ls.scale(tree)
    for name in ("f16", "bf16", "f32", "i32"):
        assert scaled[name].dtype == tree[name].dtype, name
    # The product is taken in float32: float16(65536) would be inf.
    np.testing.assert_array_equal(scaled["f16"], np.full(3, 64.0, np.float16))
    np.testing.assert_array_equal(scaled["i32"], tree["i32"])  # integers are not gradients
    back = ls.unscale(scaled)
    for name in ("f16", "bf16", "f32"):
        np.testing.assert_array_equal(back[name], tree[name])


def test_unscale_float16_by_a_large_scale_keeps_precision():
    # 1/2**30 is 0 in float16; the division must happen in float32.
    ls = StaticLossScale(2.0**30)
    x = jnp.array([1024.0, 2048.0], jnp.float16)
    out = ls.unscale(x)
    assert out.dtype == jnp.float16
    np.testing.assert_array_equal(out, np.array([2.0**-20, 2.0**-19], np.float16))


def test_noop_is_identity():
    tree = {"a": jnp.ones(2, jnp.float16)}
    ls = NoOpLossScale()
    assert ls.scale(tree) is tree and ls.unscale(tree) is tree
    assert ls.adjust(jnp.array(False)) is ls
    assert ls.loss_scale == 1 and ls.loss_scale.dtype == np.float32


# ---------------------------------------------------------------------------
# The adjust schedule against PyTorch GradScaler / TF LossScaleOptimizer.


def reference_schedule(finite_steps, scale, period, factor, min_scale=1.0, max_scale=None):
    """PyTorch's GradScaler.update / TF's LossScaleOptimizer rule, in float32.

    Finite step: the growth tracker increments; when it reaches the growth
    interval the scale is multiplied by the growth factor if that stays finite
    (else kept), and the tracker resets. Non-finite step: the scale is
    multiplied by the backoff factor (PyTorch's ``backoff_factor`` = 1/factor;
    TF divides by 2, the same for factor 2), bounded below (TF: 1; here
    min_scale, never below the smallest normal float32), and the tracker resets.
    """
    scale, counter, out = np.float32(scale), 0, []
    for finite in finite_steps:
        if finite:
            counter += 1
            if counter == period:
                counter = 0
                with np.errstate(over="ignore"):
                    grown = np.float32(scale * np.float32(factor))
                if np.isfinite(grown):
                    scale = grown
                if max_scale is not None:
                    scale = min(scale, np.float32(max_scale))
        else:
            counter = 0
            scale = max(np.float32(scale * np.float32(1 / factor)), np.float32(max(min_scale, TINY)))
        out.append((float(scale), counter))
    return out


@pytest.mark.parametrize(
    "config, p_finite",
    [
        (dict(loss_scale=2.0**15, period=5, factor=2, min_loss_scale=1.0), 0.85),  # TF defaults-like
        (dict(loss_scale=2.0**16, period=3, factor=2, min_loss_scale=0.0), 0.6),  # PyTorch: no floor
        (dict(loss_scale=2.0**120, period=1, factor=2), 0.97),  # growth hits float32 overflow
        (dict(loss_scale=100.0, period=4, factor=3, min_loss_scale=1.0, max_loss_scale=1e5), 0.8),
        (dict(loss_scale=2.0**-120, period=2, factor=4, min_loss_scale=0.0), 0.3),  # floor at tiny
    ],
)
def test_adjust_matches_reference_over_random_500_steps(config, p_finite):
    rng = random.Random(hash(tuple(config.items())) % 2**32)
    steps = [rng.random() < p_finite for _ in range(500)]
    expected = reference_schedule(
        steps, config["loss_scale"], config["period"], config["factor"],
        config.get("min_loss_scale", 1.0), config.get("max_loss_scale"))

    def body(ls, finite):
        ls = ls.adjust(finite)
        return ls, (ls.loss_scale, ls.counter)

    _, (scales, counters) = jax.jit(lambda ls, s: jax.lax.scan(body, ls, s))(
        DynamicLossScale(**config), jnp.array(steps))
    assert [(float(s), int(c)) for s, c in zip(scales, counters)] == expected


def test_scale_never_zero_inf_or_nan():
    ls = DynamicLossScale(1.0, period=1, min_loss_scale=0.0)
    for _ in range(200):
        ls = ls.adjust(jnp.array(False))
    assert float(ls.loss_scale) == TINY
    ls = DynamicLossScale(2.0**126, period=1)
    for _ in range(5):
        ls = ls.adjust(jnp.array(True))
    assert float(ls.loss_scale) == 2.0**127


def test_max_loss_scale_caps_growth():
    ls = DynamicLossScale(2.0**15, period=1, max_loss_scale=3e4 * 2)
    ls = ls.adjust(jnp.array(True)).adjust(jnp.array(True))
    assert float(ls.loss_scale) == 6e4


def test_adjust_requires_a_bool_scalar():
    with pytest.raises(ValueError, match="expected boolean scalar"):
        DynamicLossScale().adjust(jnp.array([True, False]))


# ---------------------------------------------------------------------------
# Construction: validation and jmp's warnings.


@pytest.mark.parametrize(
    "kwargs, setting",
    [
        (dict(period=0), "period"),
        (dict(period=2.5), "period"),
        (dict(factor=1), "factor"),
        (dict(factor=0.5), "factor"),
        (dict(factor=float("inf")), "factor"),
        (dict(loss_scale=-1.0), "loss_scale"),
        (dict(loss_scale=float("inf")), "loss_scale"),
        (dict(loss_scale=float("nan")), "loss_scale"),
        (dict(loss_scale=0.0, min_loss_scale=0.0), "loss_scale"),
        (dict(min_loss_scale=-1.0), "min_loss_scale"),
        (dict(min_loss_scale=4.0, max_loss_scale=2.0, loss_scale=3.0), "max_loss_scale"),
        (dict(loss_scale=2.0**20, max_loss_scale=2.0**16), "max_loss_scale"),
        (dict(counter=5, period=5), "counter"),
    ],
)
def test_bad_dynamic_settings_raise_value_error_naming_the_setting(kwargs, setting):
    with pytest.raises(ValueError, match=setting):
        DynamicLossScale(**kwargs)


def test_period_and_factor_may_be_integral_floats_like_jmp():
    # jmp's own tests pass period=5.0.
    ls = DynamicLossScale(2.0**10, period=5.0, factor=2.0)
    assert ls.period == 5 and isinstance(ls.period, int) and ls.factor == 2
    assert DynamicLossScale(period=np.float32(3.0)).period == 3
    for _ in range(5):
        ls = ls.adjust(jnp.array(True))
    assert float(ls.loss_scale) == 2.0**11


@pytest.mark.parametrize("build", [
    lambda: StaticLossScale("1024"),
    lambda: DynamicLossScale("big"),
    lambda: DynamicLossScale(period="5"),
    lambda: DynamicLossScale(factor="2"),
    lambda: DynamicLossScale(min_loss_scale="1"),
    lambda: DynamicLossScale(max_loss_scale="1e5"),
    lambda: DynamicLossScale(counter="0"),
    lambda: DynamicLossScale(period=True),
], ids=["static", "dynamic", "period", "factor", "min", "max", "counter", "bool-period"])
def test_strings_and_bools_are_type_errors(build):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no "Expected floating type" warning first
        with pytest.raises(TypeError, match="must be a real number"):
            build()


@pytest.mark.parametrize("value", [-1.0, float("inf"), float("nan")])
def test_bad_static_scale_raises(value):
    with pytest.raises(ValueError, match="loss_scale"):
        StaticLossScale(value)


def test_zero_scales_are_accepted_like_jmp():
    assert float(StaticLossScale(0.0).loss_scale) == 0.0
    assert DynamicLossScale(min_loss_scale=0.0).min_loss_scale == 0.0


def test_integer_scales_warn_with_jmps_message_and_become_float32():
    with pytest.warns(UserWarning, match="Expected floating type for loss_scale"):
        ls = DynamicLossScale(2**15)
    assert ls.loss_scale.dtype == jnp.float32
    with pytest.warns(UserWarning, match="Expected floating type for min_loss_scale"):
        DynamicLossScale(2.0**15, min_loss_scale=1)
    with pytest.warns(UserWarning, match="Expected floating type for loss_scale"):
        assert StaticLossScale(4).loss_scale.dtype == np.float32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DynamicLossScale(jnp.float32(2.0**15))  # floating: no warning


# ---------------------------------------------------------------------------
# all_finite and select_tree.


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_all_finite_detects_each_kind_of_non_finite(dtype, bad):
    good = {"a": jnp.ones((4, 3), dtype), "b": [jnp.zeros(5, dtype)]}
    assert bool(jmp_policy.all_finite(good))
    broken = {"a": good["a"].at[2, 1].set(bad), "b": good["b"]}
    assert not bool(jmp_policy.all_finite(broken))
    assert not bool(jax.jit(jmp_policy.all_finite)(broken))


def test_all_finite_catches_a_single_nan_in_large_leaves():
    # Large arrays take XLA CPU's vectorised reduction path, whose max drops NaNs:
    # a max-based check misses some of these; the sum of x * 0 cannot.
    tree = {"a": jnp.ones((3, 256, 128)), "b": [jnp.ones((256, 128)) for _ in range(3)],
            "c": jnp.ones((1000, 64), jnp.bfloat16)}
    check = jax.jit(jmp_policy.all_finite)
    assert bool(check(tree))
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    for i, leaf in enumerate(leaves):
        for bad in (np.nan, np.inf, -np.inf):
            for index in ((0,) * leaf.ndim, tuple(d - 1 for d in leaf.shape), tuple(d // 2 for d in leaf.shape)):
                broken = list(leaves)
                broken[i] = leaf.at[index].set(bad)
                assert not bool(check(jax.tree_util.tree_unflatten(treedef, broken))), (i, bad, index)


def test_all_finite_is_exact_at_the_extremes_of_every_dtype():
    # The largest finite values, signed zeros and subnormals are finite (a plain
    # sum of the values would overflow); each kind of non-finite value is not.
    for dtype in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.complex64):
        info = jnp.finfo(dtype)
        special = jnp.array([0.0, -0.0, info.tiny / 4, -info.tiny, info.max, -info.max], dtype)
        tree = [jnp.resize(special, (600, 128)), jnp.resize(special, (600, 128)), special]
        check = jax.jit(jmp_policy.all_finite)
        assert bool(check(tree)), dtype
        for i in range(len(tree)):
            for bad in (np.nan, np.inf, -np.inf):
                broken = list(tree)
                broken[i] = tree[i].reshape(-1).at[-5].set(bad).reshape(tree[i].shape)
                assert not bool(check(broken)), (dtype, i, bad)


def test_all_finite_reads_each_leaf_once_in_one_reduction_per_shape(xla_cpu):
    # Leaves of one shape and dtype (the same weight in every block) are
    # added elementwise and reduced once: each leaf is read once, and no
    # leaf-sized array is written.
    tree = [jnp.ones((128, 128))] * 12 + [jnp.ones((4096,))] * 5 + [jnp.ones((512,), jnp.bfloat16)]
    compiled = jax.jit(jmp_policy.all_finite).lower(tree).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    leaf_bytes = sum(x.nbytes for x in tree)
    assert leaf_bytes <= cost["bytes accessed"] <= 1.02 * leaf_bytes
    reductions = [e for e in jax.make_jaxpr(jmp_policy.all_finite)(tree).eqns
                  if e.primitive.name.startswith("reduce")]
    assert len(reductions) == 3


def test_all_finite_under_vmap_answers_per_example(xla_cpu):
    # Under vmap the product form becomes a batched product: one answer per
    # example, for large (product) and small (grouped) leaves alike.
    tree = {"w": jnp.ones((4, 512, 256)), "b": jnp.ones((4, 256))}
    tree["w"] = tree["w"].at[2, 100, 7].set(np.inf)
    tree["b"] = tree["b"].at[0, 3].set(np.nan)
    for check in (jax.vmap(jmp_policy.all_finite), jax.jit(jax.vmap(jmp_policy.all_finite))):
        np.testing.assert_array_equal(check(tree), [False, True, False, True])


def test_all_finite_edge_cases():
    assert bool(jmp_policy.all_finite(None)) and bool(jmp_policy.all_finite({}))
    assert bool(jmp_policy.all_finite({"step": jnp.int32(3), "mask": jnp.array([True])}))
    out = jmp_policy.all_finite([jnp.zeros((0,)), jnp.ones(2)])
    assert out.shape == () and out.dtype == jnp.bool_ and bool(out)
    # Largest finite values must not be mistaken for overflow (a sum would overflow).
    big = {"f32": jnp.full((1000,), np.finfo(np.float32).max), "f16": jnp.full((10,), 65504.0, jnp.float16)}
    assert bool(jmp_policy.all_finite(big))


def test_all_finite_is_one_pass_without_boolean_masks(xla_cpu):
    tree = {f"w{i}": jnp.ones((64, 32)) for i in range(20)}
    jaxpr = jax.make_jaxpr(jmp_policy.all_finite)(tree)
    is_finite_inputs = [e.invars[0].aval for e in jaxpr.eqns if e.primitive.name == "is_finite"]
    assert len(is_finite_inputs) == 1 and is_finite_inputs[0].shape == ()
    hlo = jax.jit(jmp_policy.all_finite).lower(tree).compile().as_text()
    assert "pred[64,32]" not in hlo  # no per-element boolean mask is built


def test_select_tree():
    a = {"x": jnp.ones(3), "n": jnp.int32(1)}
    b = {"x": jnp.zeros(3), "n": jnp.int32(2)}
    out = jmp_policy.select_tree(jnp.array(False), a, b)
    np.testing.assert_array_equal(out["x"], b["x"])
    assert int(out["n"]) == 2
    out = jax.jit(jmp_policy.select_tree)(jnp.array(True), a, b)
    np.testing.assert_array_equal(out["x"], a["x"])


@pytest.mark.parametrize("pred", [jnp.array([True]), jnp.array(1), jnp.array(1.0)])
def test_select_tree_rejects_non_bool_scalars(pred):
    with pytest.raises(ValueError, match="expected boolean scalar"):
        jmp_policy.select_tree(pred, jnp.ones(2), jnp.zeros(2))


def test_runs_code_written_for_jmp():
    # The idiom from jmp's README, unchanged apart from the import.
    jmp = jmp_policy
    loss_scale = jmp.DynamicLossScale(jnp.asarray(2.0**15, jnp.float16), period=2)
    grads = {"w": jnp.ones(3)}
    for finite_grads in (grads, {"w": jnp.array([1.0, np.inf, 0.0])}):
        grads_out = loss_scale.unscale(loss_scale.scale(finite_grads))
        grads_finite = jmp.all_finite(grads_out)
        loss_scale = loss_scale.adjust(grads_finite)
        new = jmp.select_tree(grads_finite, grads_out, jax.tree_util.tree_map(jnp.zeros_like, grads_out))
        assert bool(jmp.all_finite(new))
    assert float(loss_scale.loss_scale) == 2.0**14
