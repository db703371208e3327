"""autocast(..., residuals="float8"): the activations a backward pass keeps, in float8.

Each test reads what the backward pass keeps through ``jmp_policy.saved_residuals``
(the rows' dtypes say stored or not) and what the gradient becomes: near the one
with residuals as computed, never equal to it (something was quantized), and far
from it when a scale is lost.
"""

import os
import subprocess
import sys
import textwrap

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.checkpointed_stack import SAVED_PRODUCTS_BYTES, checkpointed_stack
from support.jaxpr_walk import TANH_DERIVATIVE, checkpointed_backward, is_product, products_before

import jmp_policy
from jmp_policy.residuals import load, store

B, D = 32, 64
F8, SCALES = "float8_e4m3fn", "float8_e8m0fnu"


def rng(*shape, seed=0, scale=1.0):
    return jnp.asarray(np.random.RandomState(seed).randn(*shape) * scale, jnp.float32)


W1, W2, X = rng(D, D, scale=0.2), rng(D, D, seed=1, scale=0.2), rng(B, D, seed=2)


def mlp(w1, w2, x):
    with jax.named_scope("hidden"):
        h = jnp.tanh(x @ w1)
    with jax.named_scope("out"):
        return jnp.sum((h @ w2) ** 2)


def activations(report):
    return [r for r in report if r.kind == "activation"]


def rel(a, b):
    a, b = jax.tree.leaves(a), jax.tree.leaves(b)
    return max(float(jnp.linalg.norm(x - y) / jnp.linalg.norm(y)) for x, y in zip(a, b))


def grads(f, *args, argnums=0):
    return jax.jit(jax.grad(lambda *a: f(*a).astype(jnp.float32), argnums=argnums))(*args)


# --- What is stored ---------------------------------------------------------------------

def test_the_roots_are_stored_as_float8_values_and_a_scale_per_32():
    plain = jmp_policy.saved_residuals(jmp_policy.autocast(mlp, "mixed_bfloat16"), W1, W2, X)
    f8 = jmp_policy.saved_residuals(
        jmp_policy.autocast(mlp, "mixed_bfloat16", residuals="float8"), W1, W2, X)
    # JAX keeps x's and w2's bfloat16 copies, what tanh's derivative and w2's gradient
    # read (tanh and 1 - tanh; one array fewer from JAX 0.11) and the output's double.
    assert len(activations(plain)) == (5 if TANH_DERIVATIVE == "sub" else 4) and {r.dtype for r in activations(plain)} == {"bfloat16"}
    # Stored: the two products' outputs, each in float8 with a scale per 32 values; the
    # rest is recomputed from them and the arguments.
    values = [r for r in activations(f8) if r.dtype == F8]
    scales = [r for r in activations(f8) if r.dtype == SCALES]
    assert sorted((r.scope, r.shape) for r in values) == [("hidden", (B, D)), ("out", (B, D))]
    assert sorted((r.scope, r.shape) for r in scales) == [
        ("hidden", (B, D // 32)), ("out", (B, D // 32))]
    assert len(activations(f8)) == 4
    assert f8.total_bytes == 2 * B * D * (1 + 1 / 32)


def test_the_gradient_is_near_the_unquantized_one_and_not_equal():
    f = jmp_policy.autocast(mlp, "mixed_bfloat16")
    f8 = jmp_policy.autocast(mlp, "mixed_bfloat16", residuals="float8")
    want, got = grads(f, W1, W2, X, argnums=(0, 1)), grads(f8, W1, W2, X, argnums=(0, 1))
    assert 0 < rel(got, want) < 0.08
    # Without differentiation, nothing changes.
    assert float(f8(W1, W2, X)) == float(f(W1, W2, X))


@pytest.mark.parametrize("magnitude", [1e-6, 1e4])
def test_each_block_keeps_its_scale(magnitude):
    # Activations far outside e4m3's range (448 down to 2**-9) are stored exactly as
    # well as near 1: the scale brings each block into range.
    def loss(w, x):
        return jnp.sum(jnp.sin(x @ w) * (x @ w))

    x = X * magnitude
    want = grads(jmp_policy.autocast(loss, "float32"), W1, x)
    got = grads(jmp_policy.autocast(loss, "float32", residuals="float8"), W1, x)
    assert 0 < rel(got, want) < 0.1


def test_a_masks_residuals_are_recomputed_from_what_they_read():
    # jnp.where and jnp.tril are jit calls: what the backward pass keeps of them (the
    # broadcast mask, a zero fill) is recomputed from their operands that it reads, the
    # mask alone, not from the scores, which are neither kept nor stored.
    def attention(q, k):
        with jax.named_scope("scores"):
            s = jnp.einsum("bqd,bkd->bqk", q, k)
        s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, jnp.finfo(s.dtype).min)
        with jax.named_scope("softmax"):
            return jnp.sum(jax.nn.softmax(s) ** 2)

    S = 32
    q, k = rng(2, S, 8), rng(2, S, 8) * 0.5
    plain = jmp_policy.autocast(attention, "float32")
    f8 = jmp_policy.autocast(attention, "float32", residuals="float8")
    report = jmp_policy.saved_residuals(f8, q, k)
    wide = [(r.scope, r.dtype) for r in activations(report) if r.shape == (2, S, S)]
    assert wide == [("softmax", F8)]  # the exponentials, stored (their scales beside)
    want, got = grads(plain, q, k, argnums=(0, 1)), grads(f8, q, k, argnums=(0, 1))
    assert 0 < rel(got, want) < 0.08


def test_relu_is_recomputed_from_the_product_it_reads():
    # jax.nn.relu is a custom_jvp call: its output, which w2's gradient reads, is
    # recomputed from x @ w1 (stored once) rather than stored beside it.
    def loss(w1, w2, x):
        with jax.named_scope("hidden"):
            h = jax.nn.relu(x @ w1)
        return jnp.sum((h @ w2) ** 2)

    w1, w2, x = rng(D, 128), rng(128, D), X
    f8 = jmp_policy.autocast(loss, "mixed_bfloat16", residuals="float8")
    report = jmp_policy.saved_residuals(f8, w1, w2, x, argnums=(0, 1))
    assert [(r.scope, r.dtype) for r in activations(report) if r.shape == (B, 128)] == [
        ("hidden", F8)]
    want = grads(jmp_policy.autocast(loss, "mixed_bfloat16"), w1, w2, x, argnums=(0, 1))
    assert 0 < rel(grads(f8, w1, w2, x, argnums=(0, 1)), want) < 0.08


def test_a_jitted_block_stores_what_the_same_block_stores_unjitted():
    # A call is read as if written in place: the block's GELU is recomputed from its
    # product whether or not the block is jitted (a call's outputs were roots).
    def block(w1, w2, x):
        with jax.named_scope("hidden"):
            h = jax.nn.gelu(x @ w1)
        return h @ w2

    def stored(b):
        f8 = jmp_policy.autocast(lambda w1, w2, x: jnp.sum(b(w1, w2, x) ** 2),
                                 "mixed_bfloat16", residuals="float8")
        report = jmp_policy.saved_residuals(f8, W1, W2, X, argnums=(0, 1))
        return [(r.scope, r.shape, r.dtype) for r in activations(report)]

    assert stored(jax.jit(block)) == stored(block)
    assert [s for s in stored(block) if s[0] == "hidden" and s[2] == F8] == [
        ("hidden", (B, D), F8)]


def test_a_dropout_mask_is_kept_not_recomputed_from_stored_uniforms():
    # The mask compares uniform random numbers with the keep rate; recomputed from their
    # float8 copy, some elements would flip. It is kept as it is (a boolean).
    def loss(x, key):
        keep = jax.random.bernoulli(key, 0.5, x.shape)
        return jnp.sum(jnp.where(keep, x, 0.0) ** 2)

    key = jax.random.key(3)
    plain = grads(jmp_policy.autocast(loss, "float32"), X, key)
    got = grads(jmp_policy.autocast(loss, "float32", residuals="float8"), X, key)
    np.testing.assert_array_equal(got, plain)


def test_the_format_round_trips_with_its_scales():
    x = jnp.concatenate([rng(4, 32) * 1e-30, rng(4, 32) * 3e4, jnp.zeros((4, 32))], axis=1)
    stored = store(x)
    assert stored.values.dtype == jnp.float8_e4m3fn and stored.scales.shape == (4, 3)
    back = load(stored, x.shape, x.dtype)
    for k in range(2):
        block = slice(32 * k, 32 * (k + 1))
        np.testing.assert_allclose(back[:, block], x[:, block], rtol=2 ** -4)
    assert np.all(back[:, 64:] == 0)
    # e4m3 values times the scales: exact for values the format holds.
    exact = jnp.array([[1.0, -0.75, 416.0, 2.0 ** -6] * 8])
    assert np.array_equal(load(store(exact), exact.shape, exact.dtype), exact)


@pytest.mark.parametrize("width", [63, 16])
def test_a_last_axis_off_the_block_size_is_padded_or_one_block(width):
    x = rng(3, width)
    stored = store(x)
    assert stored.scales.shape == (3, -(-width // 32) if width > 32 else 1)
    np.testing.assert_allclose(load(stored, x.shape, x.dtype), x, rtol=2 ** -4, atol=1e-30)


def test_a_block_holding_inf_or_nan_loads_as_nan():
    # A step that overflowed stays non-finite, so that loss scaling skips it.
    x = jnp.ones((2, 32)).at[0, 3].set(jnp.inf)
    back = load(store(x), x.shape, x.dtype)
    assert np.all(np.isnan(back[0])) and np.all(back[1] == 1)


# --- What stays ---------------------------------------------------------------------------

def layer_norm(x):
    centered = x - jnp.mean(x, axis=-1, keepdims=True)
    return centered * jax.lax.rsqrt(jnp.mean(centered ** 2, axis=-1, keepdims=True) + 1e-6)


def test_a_norms_statistics_stay_in_their_dtype():
    def loss(w, x):
        with jax.named_scope("norm"):
            h = layer_norm(x @ w)
        return jnp.sum(h * h * h)

    report = jmp_policy.saved_residuals(
        jmp_policy.autocast(loss, "mixed_bfloat16", residuals="float8"), W1, X)
    kept = {(r.primitive, r.shape, r.dtype) for r in activations(report)
            if r.dtype not in (F8, SCALES)}
    # The mean and the mean square, in float32; the centered, normalized values are
    # recomputed from the stored product and them.
    assert kept == {("reduce_sum", (B,), "float32")}
    assert [r.shape for r in activations(report) if r.dtype == F8] == [(B, D)]


def test_max_subtracted_logits_stay_in_their_dtype():
    def loss(x):
        with jax.named_scope("shifted"):
            s = x - jnp.max(x, axis=-1, keepdims=True)
        return jnp.sum(s * s)

    report = jmp_policy.saved_residuals(jmp_policy.autocast(loss, "float32", residuals="float8"), X)
    # The shifted logits in float32, and the maxima and how many each row has (max's
    # derivative splits among ties), from which the mask of where they are is recomputed.
    assert [(r.primitive, r.shape, r.dtype) for r in activations(report)] == [
        ("reduce_max", (B,), "float32"), ("reduce_sum", (B,), "float32"),
        ("sub", (B, D), "float32")]


def test_an_excluded_scope_stays_and_an_unmatched_entry_warns():
    residuals = jmp_policy.Float8Residuals(exclude=("hidden",))
    report = jmp_policy.saved_residuals(
        jmp_policy.autocast(mlp, "mixed_bfloat16", residuals=residuals), W1, W2, X)
    assert {r.dtype for r in activations(report) if r.scope == "hidden"} == {"bfloat16"}
    assert {r.dtype for r in activations(report) if r.scope == "out"} == {F8, SCALES}
    with pytest.warns(jmp_policy.UnmatchedRuleWarning, match="'hiden'"):
        jax.grad(jmp_policy.autocast(mlp, "mixed_bfloat16",
                                     residuals=jmp_policy.Float8Residuals(exclude="hiden")))(
            W1, W2, X)


def test_arguments_stay_and_small_arrays_stay():
    def loss(w, x, b):
        return jnp.sum(jnp.tanh(x @ w + b))

    report = jmp_policy.saved_residuals(
        jmp_policy.autocast(loss, "float32", residuals="float8"), W1, X, jnp.ones(D),
        argnums=(0, 1, 2))
    assert {r.kind for r in report if r.dtype == "float32"} == {"argument"}

    report = jmp_policy.saved_residuals(
        jmp_policy.autocast(loss, "float32", residuals="float8"), W1[:, :4], X[:2], jnp.ones(4))
    assert {r.dtype for r in activations(report)} == {"float32"}  # 2 x 4 values: small


def test_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match="residuals must be None .*'float8' or a jmp_policy.Float8Residuals; got 'bfloat16'"):
        jmp_policy.autocast(mlp, "mixed_bfloat16", residuals="bfloat16")
    with pytest.raises(TypeError, match="Float8Residuals exclude entries must be strings"):
        jmp_policy.Float8Residuals(exclude=[3])
    with pytest.raises(ValueError, match="not a valid regular expression"):
        jmp_policy.Float8Residuals(exclude="(")


# --- Transformations ------------------------------------------------------------------------

def test_vmap_of_the_gradient():
    f = jmp_policy.autocast(mlp, "mixed_bfloat16")
    f8 = jmp_policy.autocast(mlp, "mixed_bfloat16", residuals="float8")
    xs = jnp.stack([X, X * 2])
    per = jax.jit(jax.vmap(jax.grad(lambda w, x: f8(w, W2, x).astype(jnp.float32)), (None, 0)))
    want = jax.vmap(jax.grad(lambda w, x: f(w, W2, x).astype(jnp.float32)), (None, 0))(W1, xs)
    assert 0 < rel(per(W1, xs), want) < 0.08


def scanned(ws, x):
    def layer(h, w):
        with jax.named_scope("layer"):
            return jnp.tanh(h @ w), None
    return jnp.sum(jax.lax.scan(layer, x, ws)[0] ** 2)


def test_a_scanned_stack_stores_each_iterations_residuals():
    ws = jnp.stack([W1, W2, W1])
    f8 = jmp_policy.autocast(scanned, "mixed_bfloat16", residuals="float8")
    report = jmp_policy.saved_residuals(f8, ws, X)
    stacked = [r for r in activations(report) if r.loop is not None]
    assert stacked and {r.dtype for r in stacked} == {F8, SCALES}
    assert all(r.shape[0] == 3 for r in stacked)
    # The carry each iteration starts from is stored too (the loop stacks it).
    assert {r.dtype for r in activations(report)} == {F8, SCALES}
    # Quantized in the body, as each iteration runs: the loop's outputs are float8.
    loop = [e for e in jax.make_jaxpr(jax.grad(f8))(ws, X).jaxpr.eqns if e.primitive.name == "scan"]
    assert any(v.aval.dtype == jnp.float8_e4m3fn for v in loop[0].outvars)
    want = grads(jmp_policy.autocast(scanned, "mixed_bfloat16"), ws, X)
    assert 0 < rel(grads(f8, ws, X), want) < 0.1


@pytest.mark.parametrize("policy, kept", [
    (jax.checkpoint_policies.nothing_saveable, set()),
    (jax.checkpoint_policies.dots_saveable, {"dot_general"}),
])
def test_what_a_checkpoint_policy_saves_is_what_is_stored(policy, kept):
    def loss(w1, w2, x):
        return jax.checkpoint(mlp, policy=policy)(w1, w2, x)

    f8 = jmp_policy.autocast(loss, "mixed_bfloat16", residuals="float8")
    report = jmp_policy.saved_residuals(f8, W1, W2, X)
    plain = jmp_policy.saved_residuals(jmp_policy.autocast(loss, "mixed_bfloat16"), W1, W2, X)
    # The policy's choice (bfloat16 copies of the inputs, and the products it saves), stored.
    assert kept <= {r.primitive for r in activations(plain)} <= kept | {"convert_element_type"}
    assert sorted(r.shape for r in activations(report) if r.dtype == F8) == \
        sorted(r.shape for r in activations(plain))
    assert {r.dtype for r in activations(report)} <= {F8, SCALES}
    want = grads(jmp_policy.autocast(loss, "mixed_bfloat16"), W1, W2, X)
    assert rel(grads(f8, W1, W2, X), want) < 0.08


def test_each_checkpointed_layers_residuals_load_where_the_backward_pass_reaches_it():
    """Loaded all at once, every layer's residuals would be wide again while the last
    layer is differentiated; each layer's loads must wait for the gradient of the
    layers after it (a data dependency, which no compiler schedules around)."""
    def loss(ws, x):
        for w1, w2 in ws:
            x = x + jax.checkpoint(mlp, policy=jax.checkpoint_policies.dots_saveable)(w1, w2, x)
        return jnp.sum(x ** 2)

    f8 = jmp_policy.autocast(loss, "mixed_bfloat16", residuals="float8")
    jaxpr = jax.make_jaxpr(jax.grad(f8))([(W1, W2)] * 4, X).jaxpr
    eqns = jaxpr.eqns
    made_by = {v: i for i, eqn in enumerate(eqns) for v in eqn.outvars}

    def from_float8(v):  # made from a stored float8 array, not through a layer's pass
        seen, stack = set(), [v]
        while stack:
            v = stack.pop()
            if v.aval.dtype == F8:
                return True
            i = made_by.get(v)
            if i is not None and i not in seen and eqns[i].primitive.name != "remat2":
                seen.add(i)
                stack += [u for u in eqns[i].invars if not isinstance(u, jax.extend.core.Literal)]
        return False

    after: dict = {}  # var -> the layers' backward passes (equation indices) it waits for
    waits = []
    for i, eqn in enumerate(eqns):
        reads = [v for v in eqn.invars if not isinstance(v, jax.extend.core.Literal)]
        deps = set().union(*(after.get(v, set()) for v in reads))
        loads = [v for v in reads if from_float8(v)] if eqn.primitive.name == "remat2" else []
        if loads:  # a layer's backward pass, reading its residuals
            waits.append(min(len(after.get(v, ())) for v in loads))
            deps = deps | {i}
        after.update((v, deps) for v in eqn.outvars)
    # The last layer's residuals wait for nothing, the first layer's for the three after it.
    assert sorted(waits) == [0, 1, 2, 3], waits


def test_a_checkpointed_layer_recomputes_its_attention_after_its_mlps_backward_pass():
    """A layer recomputing its attention at the start of its backward pass would hold
    the attention's arrays beside the MLP's: the recomputation (from float8 residuals)
    must wait for a product of the layer's backward pass, its MLP's."""
    def layer(w2, x, wo):
        h = x @ wo
        o = jnp.einsum("bqk,bkd->bqd", jnp.einsum("bqd,bkd->bqk", h, h), h)
        return jnp.sum(jnp.tanh(jnp.tanh(x + o @ wo) @ w2))

    f = jmp_policy.autocast(
        jax.checkpoint(layer, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
        "mixed_bfloat16", fp8="tensorwise", residuals="float8")
    x, w2, wo = rng(4, 16, 32), rng(32, 24, seed=1, scale=0.2), rng(32, 32, seed=2, scale=0.2)
    body = checkpointed_backward(jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(w2, x, wo))
    recomputed = [e for e in body.eqns if is_product(e, batched=True)][:2]
    assert [products_before(body, e, batched=False) for e in recomputed] == [1, 1]


@pytest.mark.slow  # two compiles of a four-layer step
def test_float8_residuals_of_checkpointed_layers_shrink_the_step_on_xla_cpu():
    """XLA:CPU removes optimization barriers: the loads must be ordered another way, or it
    fuses each into the forward pass's store and keeps the wide result. As
    test_xla_gpu's test for an H100."""
    temp = {}
    for residuals in (None, "float8"):
        fn, args = checkpointed_stack(residuals)
        temp[residuals] = jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert temp[None] - temp["float8"] >= 0.75 * SAVED_PRODUCTS_BYTES, temp


@pytest.mark.slow  # integration with the recipes, modules and meshes
@pytest.mark.parametrize("fp8", ["tensorwise", "rowwise", "mxfp8", "nvfp4"])
def test_every_float8_recipe_composes(fp8):
    f = jmp_policy.autocast(mlp, "mixed_bfloat16", fp8=fp8)
    f8 = jmp_policy.autocast(mlp, "mixed_bfloat16", fp8=fp8, residuals="float8")
    report = jmp_policy.saved_residuals(f8, W1, W2, X)
    # Stored, but the recipe's own scales (a statistic: per tensor, or per column).
    kept = [r for r in activations(report) if r.dtype not in (F8, SCALES)]
    assert all(r.dtype == "float32" and int(np.prod(r.shape)) <= D for r in kept), kept
    assert sum(r.bytes for r in activations(report) if r.dtype == F8) >= 3 * B * D
    got = grads(f8, W1, W2, X, argnums=(0, 1))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in got)
    assert rel(got, grads(f, W1, W2, X, argnums=(0, 1))) < (0.5 if fp8 == "nvfp4" else 0.15)


@pytest.mark.slow  # integration with the recipes, modules and meshes
def test_delayed_scaling_records_its_maxima():
    recipe = jmp_policy.Float8Recipe("delayed", amax_history_length=4)
    f8 = jmp_policy.autocast(mlp, "mixed_bfloat16", fp8=recipe, residuals="float8")
    state = jmp_policy.float8_state(f8, W1, W2, X)
    (g, observed) = jax.jit(jax.grad(lambda s, w: f8(s, w, W2, X).astype(jnp.float32),
                                     argnums=(1, 0)))(state, W1)
    assert bool(jnp.all(jnp.isfinite(g)))
    assert float(observed.histories[0].lhs[0]) == pytest.approx(float(jnp.max(jnp.abs(X))))


def test_loss_scaling_skips_a_step_that_overflowed():
    tx = jmp_policy.loss_scaling(optax.sgd(0.1), "mixed_float16")
    f8 = jmp_policy.autocast(mlp, "mixed_float16", residuals="float8")
    params = (W1, W2)
    state = tx.init(params)

    @jax.jit
    def step(params, state, x):
        scale = jmp_policy.get_loss_scale(state)
        _, g = jmp_policy.scaled_value_and_grad(
            lambda p: f8(*p, x).astype(jnp.float32) / (B * D))(scale, params)
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    params, state = step(params, state, X)
    assert int(optax.tree_utils.tree_get(state, "skipped_steps")) == 0
    after, state = step(params, state, X.at[0, 0].set(jnp.inf))
    assert int(optax.tree_utils.tree_get(state, "skipped_steps")) == 1
    assert all(np.array_equal(a, b) for a, b in zip(after, params))


# --- Modules ----------------------------------------------------------------------------------

class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x + nn.Dense(D)(nn.gelu(nn.Dense(D)(nn.LayerNorm()(x))))
        return nn.Dense(D, name="head")(x)


def test_a_linen_model():
    model = Block()
    params = model.init(jax.random.key(0), X)

    def loss(apply):
        return lambda p, x: jnp.sum(apply(p, x).astype(jnp.float32) ** 2)

    f8 = loss(jmp_policy.autocast(model.apply, "mixed_bfloat16", residuals="float8"))
    report = jmp_policy.saved_residuals(f8, params, X)
    scopes = {r.scope for r in activations(report) if r.dtype == F8}
    # The products' outputs and the residual connection; the norm's output, GELU's and
    # the bfloat16 copies are recomputed from them.
    assert scopes == {"Block/Dense_0", "Block/Dense_1"}
    want = grads(loss(jmp_policy.autocast(model.apply, "mixed_bfloat16")), params, X)
    assert 0 < rel(grads(f8, params, X), want) < 0.1


@pytest.mark.slow  # integration with the recipes, modules and meshes
def test_an_nnx_model_and_an_equinox_model():
    class Mlp(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b = nnx.Linear(D, D, rngs=rngs), nnx.Linear(D, D, rngs=rngs)

        def __call__(self, x):
            return self.b(jnp.tanh(self.a(x)))

    def nnx_loss(m):
        return jnp.sum(jmp_policy.autocast(m, "mixed_bfloat16", residuals="float8")(X) ** 2)

    model = Mlp(nnx.Rngs(0))
    report = jmp_policy.saved_residuals(nnx_loss, model)
    assert {r.scope for r in activations(report) if r.dtype == F8} == {"Mlp/a"}
    g = nnx.grad(nnx_loss)(model)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(g))

    mlp_eqx = eqx.nn.MLP(D, D, D, depth=2, key=jax.random.key(0))
    report = jmp_policy.saved_residuals(lambda m: jnp.sum(jax.vmap(jmp_policy.autocast(
        m, "mixed_bfloat16", residuals="float8"))(X) ** 2), mlp_eqx)
    model_rows = [r for r in activations(report) if r.scope.startswith("MLP")]
    # The two hidden products' outputs; the ReLUs' (calls of element-wise work) are
    # recomputed from them.
    assert sorted(r.dtype for r in model_rows) == [F8] * 2 + [SCALES] * 2
    assert {r.scope for r in model_rows} >= {"MLP/eqx.nn.MLP/layers/0/eqx.nn.Linear",
                                              "MLP/eqx.nn.MLP/layers/1/eqx.nn.Linear"}
    g = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(jmp_policy.autocast(
        m, "mixed_bfloat16", residuals="float8"))(X).astype(jnp.float32) ** 2))(mlp_eqx)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(eqx.filter(g, eqx.is_array)))


# --- Sharding ------------------------------------------------------------------------------------

@pytest.mark.slow  # integration with the recipes, modules and meshes
def test_sharded_jit_and_shard_map_add_no_collective():
    script = textwrap.dedent("""
        import re, jax, jax.numpy as jnp, numpy as np, jmp_policy
        from jax.sharding import NamedSharding, PartitionSpec as P
        mesh = jax.make_mesh((4, 2), ("data", "model"))
        w = jax.device_put(jnp.ones((64, 256)) * 0.1, NamedSharding(mesh, P(None, "model")))
        x = jax.device_put(jnp.ones((32, 64)), NamedSharding(mesh, P("data")))
        def loss(w, x):
            return jnp.sum(jnp.tanh(x @ w) ** 2)
        def mapped(w, x):
            f = jax.shard_map(lambda w, x: jax.lax.psum(jnp.sum(jnp.tanh(x @ w) ** 2), ("data", "model")),
                              mesh=mesh, in_specs=(P(None, "model"), P("data")), out_specs=P())
            return f(w, x)
        def collectives(f):
            text = jax.jit(jax.grad(f)).lower(w, x).compile().as_text()
            return sorted(re.findall(r"= \\S+ (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)\\(", text))
        for fn in (loss, mapped):
            plain = collectives(jmp_policy.autocast(fn, "mixed_bfloat16"))
            f8 = collectives(jmp_policy.autocast(fn, "mixed_bfloat16", residuals="float8"))
            assert plain == f8, (fn.__name__, plain, f8)
            g = jax.jit(jax.grad(jmp_policy.autocast(fn, "mixed_bfloat16", residuals="float8")))(w, x)
            assert bool(jnp.all(jnp.isfinite(g)))
        print("ok")
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


class ScannedBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.gelu(nn.Dense(2 * D)(nn.LayerNorm()(x)))
        return x + nn.Dense(D)(h), None


class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
        layers = nn.scan(nn.remat(ScannedBlock, policy=jax.checkpoint_policies.dots_saveable),
                         variable_axes={"params": 0}, split_rngs={"params": True}, length=4)
        return layers()(x, None)[0]


@pytest.mark.slow  # integration with the recipes, modules and meshes
def test_a_linen_scan_of_checkpointed_blocks_stores_what_the_policy_saves():
    model = Stack()
    params = model.init(jax.random.key(0), X)

    def loss(apply):
        return lambda p, x: jnp.mean(apply(p, x).astype(jnp.float32) ** 2)

    plain = loss(jmp_policy.autocast(model.apply, "mixed_bfloat16"))
    f8 = loss(jmp_policy.autocast(model.apply, "mixed_bfloat16", residuals="float8"))
    before = [r for r in activations(jmp_policy.saved_residuals(plain, params, X)) if r.loop]
    after = [r for r in activations(jmp_policy.saved_residuals(f8, params, X)) if r.loop]
    # Each layer's input (the carry) and the product the policy saves, per iteration.
    assert sorted(r.shape for r in before) == [(4, B, D), (4, B, 2 * D)]
    assert sorted(r.shape for r in after if r.dtype == F8) == [(4, B, D), (4, B, 2 * D)]
    assert {r.dtype for r in after} == {F8, SCALES}
    assert 0 < rel(grads(f8, params, X), grads(plain, params, X)) < 0.1
