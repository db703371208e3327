"""Tests for float8 matmuls through autocast (``autocast(fn, policy, fp8=...)``): the
formats of every product in the jaxprs of the forward and backward passes, what stays
out of float8, scaling accuracy, non-finite values, composition with transformations,
Flax and loss scaling, and the example's float8 runs."""

import dataclasses
import importlib.util
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jmp_policy
from support.excess_precision import COMPILERS
from support.jaxpr_walk import eqns
from support.xla_gpu import compilation_cache_off
from jmp_policy import AutocastWarning, Float8Recipe, autocast

E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
SCALINGS = ("tensorwise", "rowwise")
# The numerics tests run as XLA:CPU compiles them and as XLA:GPU does
# (tests/support/excess_precision.py).
compilers = pytest.mark.parametrize("compile", list(COMPILERS.values()), ids=list(COMPILERS))


# --- jaxpr inspection -----------------------------------------------------------------

def dots(fn, *args):
    """``(lhs dtype, rhs dtype, accumulation dtype)`` of every dot_general of ``fn``'s jaxpr."""
    return [(np.dtype(e.invars[0].aval.dtype), np.dtype(e.invars[1].aval.dtype),
             np.dtype(e.params["preferred_element_type"] or e.outvars[0].aval.dtype))
            for e in eqns(jax.make_jaxpr(fn)(*args)) if e.primitive.name == "dot_general"]


def rng(*shape, seed=0, scale=1.0):
    return jax.random.normal(jax.random.key(seed), shape) * scale


def rel_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def mlp(p, x):
    h = jax.nn.gelu(x @ p["w1"])
    with jax.named_scope("attention"):
        s = jnp.einsum("bqd,bkd->bqk", h, h) / 8.0
        h = jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s), h)
    with jax.named_scope("logits"):
        return h @ p["w2"]


def mlp_params(d=32, hidden=64, out=48):
    return {"w1": rng(d, hidden, seed=1, scale=d ** -0.5),
            "w2": rng(hidden, out, seed=2, scale=hidden ** -0.5)}


def loss(fn):
    return lambda p, x: jnp.mean(fn(p, x).astype(jnp.float32) ** 2)


# --- Float8Recipe and the fp8= argument ---------------------------------------------------

def test_recipe_defaults_are_immutable_and_hashable():
    r = Float8Recipe()
    assert (r.scaling, r.fwd_dtype, r.bwd_dtype) == ("tensorwise", E4M3, E5M2)
    assert r == Float8Recipe("tensorwise", fwd_dtype="float8_e4m3fn", bwd_dtype=jnp.float8_e5m2)
    assert hash(r) == hash(Float8Recipe()) and len({r, Float8Recipe("rowwise")}) == 2
    assert Float8Recipe(exclude="router").exclude == ("router",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.scaling = "rowwise"


@pytest.mark.parametrize("kwargs,error,match", [
    ({"scaling": "columnwise"}, ValueError, "'tensorwise', 'rowwise'"),
    ({"fwd_dtype": jnp.bfloat16}, ValueError, "fwd_dtype must be a float8 dtype.*bfloat16"),
    ({"bwd_dtype": "int8"}, ValueError, "bwd_dtype must be a float8 dtype"),
    ({"fwd_dtype": jnp.float8_e8m0fnu}, ValueError, "with a mantissa"),
    ({"min_size": -1}, ValueError, "non-negative"),
    ({"min_size": 16.0}, TypeError, "min_size must be an int"),
    ({"exclude": ["logits", "(unclosed"]}, ValueError, "'\\(unclosed' is not a valid regular"),
    ({"exclude": [3]}, TypeError, "exclude entries must be strings"),
    ({"power_of_two_scales": 1}, TypeError, "True or False"),
    ({"batched": 1}, TypeError, "batched must be True or False"),
])
def test_recipe_rejects_bad_settings_naming_them(kwargs, error, match):
    with pytest.raises(error, match=match):
        Float8Recipe(**kwargs)


def test_autocast_rejects_a_bad_fp8_argument_when_built():
    with pytest.raises(ValueError, match="fp8 must be None, 'tensorwise', 'rowwise', 'delayed', 'mxfp8', 'nvfp4'"):
        autocast(jnp.dot, "mixed_bfloat16", fp8="rowwize")
    with pytest.raises(TypeError, match="Float8Recipe; got bool True"):
        autocast(jnp.dot, "mixed_bfloat16", fp8=True)


def test_fp8_none_changes_nothing():
    p, x = mlp_params(), rng(2, 16, 32)
    assert dots(autocast(mlp, "mixed_bfloat16", fp8=None), p, x) == \
        dots(autocast(mlp, "mixed_bfloat16"), p, x)


# --- which products run in float8, in which formats ----------------------------------------

@pytest.mark.parametrize("scaling", SCALINGS)
def test_every_eligible_product_forward_and_backward_is_float8(scaling):
    p, x = mlp_params(), rng(2, 16, 32)
    f = autocast(mlp, "mixed_bfloat16", fp8=scaling)
    formats = dots(jax.grad(loss(f)), p, x)
    head = [d for d in formats if BF16 in d[:2]]
    fp8 = [d for d in formats if d not in head]
    # Forward: x @ w1 and the two attention products; backward: two per product
    # (the grad with respect to x is computed, then unused).
    assert sorted(fp8).count((E4M3, E4M3, BF16)) == 3 and len(fp8) == 9
    assert all(set(d[:2]) == {E5M2, E4M3} and d[2] == BF16 for d in fp8[3:])
    # The logits head is excluded by default: the matmul class (bfloat16).
    assert head and all(d[0] in (BF16, F32) and d[1] == BF16 and d[2] in (BF16, F32)
                        for d in head)
    # The forward pass alone.
    assert dots(f, p, x).count((E4M3, E4M3, BF16)) == 3


def test_outputs_and_gradients_follow_the_policy():
    p, x = mlp_params(), rng(2, 16, 32)
    for policy, out in (("mixed_bfloat16", BF16), ("mixed_float16", F16), ("float32", F32)):
        f = autocast(mlp, policy, fp8="rowwise")
        assert jax.eval_shape(f, p, x).dtype == out
        grads = jax.eval_shape(jax.grad(loss(f)), p, x)
        assert all(g.dtype == F32 for g in jax.tree.leaves(grads))
    # A product's own result is in the compute dtype, as in the matmul class.
    f = autocast(lambda x, w: lax.reduce_precision(x @ w, 8, 23), "mixed_bfloat16", fp8="rowwise")
    (rp,) = [e for e in eqns(jax.make_jaxpr(f)(x[0], p["w1"])) if e.primitive.name ==
             "reduce_precision"]
    assert rp.invars[0].aval.dtype == BF16


def test_excluded_scopes_small_and_integer_products_stay_out_of_float8():
    p, x = mlp_params(), rng(2, 16, 32)
    # Custom exclusions replace the default: the head runs in float8, attention does not.
    f = autocast(mlp, "mixed_bfloat16", fp8=Float8Recipe(exclude=["(^|/)attention/"]))
    formats = dots(jax.grad(loss(f)), p, x)
    assert sum(BF16 in d[:2] for d in formats) == 6  # the two attention products, both ways
    assert sum(E4M3 in d[:2] for d in formats) == 6
    # Below min_size (the batched attention products contract 32 and have 16 rows).
    f = autocast(mlp, "mixed_bfloat16", fp8=Float8Recipe(min_size=17, exclude=()))
    assert [E4M3 in d[:2] for d in dots(f, p, x)] == [True, False, False, True]
    # Products with batch dimensions (here the attention ones) only if the recipe says so.
    f = autocast(mlp, "mixed_bfloat16", fp8=Float8Recipe(batched=False, exclude=()))
    assert [E4M3 in d[:2] for d in dots(f, p, x)] == [True, False, False, True]
    # Integer products are never touched.
    ints = autocast(lambda a, b: lax.dot(a, b, preferred_element_type=jnp.int32), "mixed_bfloat16",
                    fp8="tensorwise")
    a = jnp.ones((32, 32), jnp.int8)
    with pytest.warns(AutocastWarning, match="none of its matrix products is eligible"):
        assert dots(ints, a, a) == [(np.dtype(np.int8), np.dtype(np.int8), np.dtype(np.int32))]


# Output layers as models name them, and names the default must not take for one.
HEADS = ["head", "lm_head", "classifier_head", "cls_head", "ViT/head", "Bert/classifier_head",
         "logits"]
NOT_HEADS = ["heads_proj", "ahead", "heads", "head_proj", "attention_head", "block/attn_head",
             "multi_head"]


@pytest.mark.parametrize("scope", HEADS + NOT_HEADS)
def test_default_exclude_keeps_output_heads_out_of_float8(scope):
    x, w = rng(64, 64), rng(64, 64, seed=1)

    f = autocast(lambda x, w: _under(scope.split("/"), lambda: x @ w), "mixed_bfloat16",
                 fp8="tensorwise")
    formats = dots(jax.grad(lambda x, w: f(x, w).astype(F32).sum(), argnums=1), x, w)
    excluded = scope in HEADS
    assert len(formats) >= 2  # forward and backward
    assert all((BF16 in d[:2]) == excluded and (E4M3 in d[:2] or E5M2 in d[:2]) != excluded
               for d in formats), formats


def _under(scopes, product):
    if not scopes:
        return product()
    with jax.named_scope(scopes[0]):
        return _under(scopes[1:], product)


def test_float32_scopes_win_over_fp8():
    p, x = mlp_params(), rng(2, 16, 32)
    f = autocast(mlp, "mixed_bfloat16", fp8=Float8Recipe(exclude=()),
                 rules={"float32_scopes": ["attention"]})
    assert [d[0] for d in dots(f, p, x)] == [E4M3, F32, F32, E4M3]


def test_products_of_a_gradient_computed_inside_fn_take_e5m2_gradients():
    # autocast around jax.grad: JAX's transposed products carry the gradient on the left.
    p, x = mlp_params(), rng(2, 16, 32)
    f = autocast(jax.grad(loss(mlp)), "mixed_bfloat16", fp8=Float8Recipe(exclude=()))
    formats = dots(f, p, x)
    assert formats[:4] == [(E4M3, E4M3, BF16)] * 4
    assert formats[4:] and all(d == (E5M2, E4M3, BF16) for d in formats[4:])
    got, want = jax.jit(f)(p, x), jax.jit(jax.grad(loss(mlp)))(p, x)  # eagerly: ~200 compiles
    assert all(rel_error(got[k], want[k]) < 0.15 for k in p)


def test_weight_gradient_can_stay_in_the_compute_dtype():
    x, w = rng(64, 32), rng(32, 48, seed=1)
    f = autocast(lambda x, w: x @ w, "mixed_bfloat16",
                 fp8=Float8Recipe(float8_weight_gradient=False))
    grad = jax.grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) ** 2), (0, 1))
    assert dots(grad, x, w)[1:] == [(E5M2, E4M3, BF16), (BF16, BF16, BF16)]
    want = jax.grad(lambda x, w: jnp.sum((x @ w) ** 2), (0, 1))(x, w)
    for got, expected in zip(jax.jit(grad)(x, w), want):
        assert rel_error(got, expected) < 0.1


# --- scaling ----------------------------------------------------------------------------

@compilers
@pytest.mark.parametrize("scaling", SCALINGS)
def test_scaling_keeps_products_far_outside_e4m3s_range_accurate(scaling, compile):
    def with_grads(f):
        return compile(lambda x, w, ct: (lambda out, vjp: (out, *vjp(ct)))(*jax.vjp(f, x, w)))

    f = with_grads(autocast(jnp.matmul, "float32", fp8=scaling))
    for magnitude in (1e-4, 1e4):  # float8_e4m3fn holds 2e-3 (subnormal) to 448
        x, w = rng(64, 128, scale=magnitude), rng(128, 32, seed=1, scale=magnitude)
        ct = rng(64, 32, seed=2, scale=magnitude)
        for got, want in zip(f(x, w, ct), with_grads(jnp.matmul)(x, w, ct)):
            assert rel_error(got, want) < 0.1


@compilers
def test_an_outlier_row_spoils_tensorwise_not_rowwise(compile):
    x, w = rng(64, 128), rng(128, 32, seed=1)
    x = x.at[0].set(rng(128, seed=3, scale=1e4))
    want = (x @ w)[1:]
    errors = {s: rel_error(compile(autocast(jnp.matmul, "float32", fp8=s))(x, w)[1:], want)
              for s in SCALINGS}
    # The outlier's scale pushes the other rows down to float8_e4m3fn's subnormals, where
    # they keep fewer bits; a scale per row leaves them their own range.
    assert errors["rowwise"] < 0.04
    assert errors["tensorwise"] > 1.25 * errors["rowwise"]


# --- non-finite values --------------------------------------------------------------------

@compilers
@pytest.mark.parametrize("scaling", SCALINGS)
def test_non_finite_operands_give_non_finite_products(scaling, compile):
    x, w = rng(32, 64), rng(64, 16, seed=1)
    f = autocast(jnp.matmul, "mixed_bfloat16", fp8=scaling)
    grads = compile(lambda x, w, ct: jax.vjp(f, x, w)[1](ct))
    f = compile(f)
    for bad in (np.inf, -np.inf, np.nan):
        out = f(x.at[3, 5].set(bad), w)
        assert not np.isfinite(out[3]).any()  # never finite garbage where float32 has none
        if scaling == "rowwise":
            assert np.isfinite(np.delete(out, 3, axis=0)).all()  # other rows are unharmed
        assert not np.isfinite(f(x, w.at[7, 2].set(bad))[:, 2]).any()
        # A non-finite gradient reaching the backward products.
        gx, gw = grads(x, w, jnp.ones((32, 16), BF16).at[0, 0].set(bad))
        assert not np.isfinite(gx[0]).any() and not np.isfinite(gw[:, 0]).any()


def test_loss_scaling_skips_a_step_whose_float8_products_overflow():
    params = mlp_params()
    x = rng(2, 16, 32)
    loss_fn = loss(autocast(mlp, "mixed_float16", fp8="rowwise"))
    tx = jmp_policy.loss_scaling(optax.adam(1e-3), "dynamic")

    @jax.jit
    def step(params, opt_state, x):
        scale = jmp_policy.get_loss_scale(opt_state)
        _, grads = jmp_policy.scaled_value_and_grad(loss_fn)(scale, params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    state = tx.init(params)
    new, state = step(params, state, x.at[0, 3, 4].set(np.inf))
    assert int(state.skipped_steps) == 1
    jax.tree.map(np.testing.assert_array_equal, new, params)
    new, state = step(new, state, x)
    assert int(state.skipped_steps) == 1 and all(np.isfinite(l).all() for l in jax.tree.leaves(new))


# --- transformations, Flax ---------------------------------------------------------------

def test_jit_grad_vmap_agree_with_eager():
    p, x = mlp_params(), rng(3, 16, 32)
    f = autocast(mlp, "float32", fp8="rowwise")
    out = f(p, x)
    assert rel_error(out, jax.jit(mlp)(p, x)) < 0.1
    # vmap: each example's scales are its own, as called one by one: the same numbers
    # on XLA:CPU. On a GPU the two programs may differ in a few values by a float8 step:
    # XLA:GPU fuses their scaling differently, and a value on the edge between two
    # float8 neighbours may round the other way.
    batched = jax.jit(jax.vmap(f, in_axes=(None, 0)))(p, x[:, None])
    one = jax.jit(f)  # one example at a time, traced and compiled once
    one_by_one = jnp.stack([one(p, xi[None])[0] for xi in x])
    if jax.default_backend() == "cpu":
        np.testing.assert_allclose(batched[:, 0], one_by_one, rtol=1e-6, atol=1e-6)
    else:
        assert rel_error(batched[:, 0], one_by_one) < 1e-2
    g = jax.jit(jax.grad(loss(f)))(p, x)
    want = jax.jit(jax.grad(loss(mlp)))(p, x)
    assert all(rel_error(g[k], want[k]) < 0.15 for k in p)


def test_scan_remat_and_shard_map_bodies_run_float8_products():
    ws = rng(3, 32, 32, scale=32 ** -0.5)

    def stack(ws, x):
        @jax.checkpoint
        def layer(h, w):
            return jnp.tanh(h @ w), None
        return lax.scan(layer, x, ws)[0]

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    spec = jax.sharding.PartitionSpec("d")
    sharded = jax.shard_map(stack, mesh=mesh, in_specs=(None, spec), out_specs=spec)
    x = rng(32, 32, seed=1)
    for fn in (stack, sharded):
        f = autocast(fn, "mixed_bfloat16", fp8="rowwise")
        grad = jax.grad(lambda ws, x: jnp.sum(f(ws, x).astype(jnp.float32) ** 2))
        formats = dots(grad, ws, x)
        assert formats and all(E4M3 in d[:2] and d[2] == BF16 for d in formats)
        assert rel_error(f(ws, x), jax.jit(fn)(ws, x)) < 0.1
        want = jax.jit(jax.grad(lambda ws, x: jnp.sum(fn(ws, x) ** 2)))(ws, x)
        assert rel_error(jax.jit(grad)(ws, x), want) < 0.1


@pytest.mark.slow  # a system test: linen and NNX models
def test_flax_linen_scan_stack_and_nnx_modules():
    nn = pytest.importorskip("flax.linen")
    nnx = pytest.importorskip("flax.nnx")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return x + nn.Dense(32)(jax.nn.gelu(nn.Dense(64)(x))), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=2)()(x, None)[0]
            return nn.Dense(8, name="head")(x)

    model, x = Model(), rng(16, 32)
    variables = model.init(jax.random.key(0), x)
    f = autocast(model.apply, "mixed_bfloat16", fp8="tensorwise")
    formats = dots(jax.grad(lambda v: jnp.sum(f(v, x).astype(jnp.float32))), variables)
    assert sum(E4M3 in d[:2] for d in formats) == 6  # two Dense layers in the scan, both ways
    assert sum(BF16 in d[:2] for d in formats) >= 2  # the head (excluded), both ways
    assert rel_error(f(variables, x), jax.jit(model.apply)(variables, x)) < 0.05

    layer = nnx.Linear(32, 16, rngs=nnx.Rngs(0))
    g = autocast(lambda m, x: m(x), "mixed_bfloat16", fp8="rowwise")
    assert dots(g, layer, x) == [(E4M3, E4M3, BF16)]
    out = g(layer, x)
    assert out.dtype == BF16 and rel_error(out, x @ layer.kernel[...] + layer.bias[...]) < 0.05


# --- the example -------------------------------------------------------------------------

@pytest.mark.slow  # a system test: examples/transformer_lm.py
def test_transformer_lm_example_runs_float8_products_and_takes_its_flags(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("transformer_lm_fp8",
                                                  "examples/transformer_lm.py")
    lm = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, lm)
    spec.loader.exec_module(lm)
    config = lm.Config(d_model=16, heads=1, layers=1, seq_len=16, batch_size=2)
    tokens = jax.ShapeDtypeStruct((2, 17), jnp.int32)
    for fp8, head in (("rowwise", BF16), (Float8Recipe("rowwise", exclude=()), E4M3)):
        init, train_step, _ = lm.make_train_step("mixed_bfloat16", config, fp8=fp8)
        params, opt_state = jax.eval_shape(init, 0)
        formats = dots(train_step, params, opt_state, tokens)
        # Forward: qkv, scores, weights x values, proj, two MLP layers, then the head.
        assert formats[:6] == [(E4M3, E4M3, BF16)] * 6 and formats[6][1] == head
        assert all(E5M2 in d[:2] for d in formats[7:] if head not in d[:2])

    # The command line: a run per --fp8 scaling of the first policy, and --fp8-head.
    def fake_train(policy, *, fp8=None, steps, **kwargs):
        return dict(policy=policy, run=lm.run_name(policy, fp8), test_bits_per_byte=2.0,
                    steps_per_s=1.0, skipped_steps=0, final_loss_scale=1.0,
                    step_memory_bytes=None, losses=[2.0] * steps, loss_scales=[1.0] * steps)

    monkeypatch.setattr(lm, "train", fake_train)
    lm.main(["--steps", "2", "--out", str(tmp_path), "--policies", "mixed_bfloat16", "float32",
             "--fp8", "tensorwise", "rowwise", "--fp8-head"])
    out = capsys.readouterr().out
    assert "| mixed_bfloat16 fp8 rowwise " in out and "| float32 " in out
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [r["run"] for r in results] == [
        "mixed_bfloat16", "float32", "mixed_bfloat16 fp8 tensorwise", "mixed_bfloat16 fp8 rowwise",
        "mixed_bfloat16 fp8 tensorwise, head fp8"]
    with pytest.raises(SystemExit):
        lm.main(["--fp8-head"])  # needs --fp8


@pytest.mark.parametrize("scaling", ["rowwise", "mxfp8"])
def test_a_constant_cotangent_compiles_as_fast_as_tensorwise(scaling):
    """A loss linear in a product (``sum(x @ w)``) gives it a constant cotangent, whose row
    (block) maxima XLA would evaluate at compile time, element by element: 16 s (rowwise)
    and 11 s (mxfp8) on XLA:CPU at this size, where tensorwise takes 0.1 s. The scales'
    maxima are computed when the program runs."""
    def compile_seconds(fp8):
        f = autocast(lambda x, w: x @ w, "mixed_bfloat16", fp8=fp8)
        grad = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32)), (0, 1)))
        lowered = grad.lower(jax.ShapeDtypeStruct((8192, 256), jnp.bfloat16),
                             jax.ShapeDtypeStruct((256, 256), jnp.float32))
        start = time.perf_counter()
        lowered.compile()
        return time.perf_counter() - start

    with compilation_cache_off():  # a compile read from the cache measures nothing
        base = compile_seconds("tensorwise")
        assert compile_seconds(scaling) < 5 * base + 2.0
