"""Autocast behaves as a JAX transformation: one regression test per failure users met.

Each test is named after what a user could see go wrong with an autocast that reused
a jaxpr across calls: stale closures, traced Python values, lost NNX state, a float16
loss capping the loss scale, dropped casts, NaN float8 gradients on padded
batches, the smaller API gaps, module scopes outside linen, narrowed
auxiliary outputs.
"""

import dataclasses
import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_policy
from support.jaxpr_walk import eqns, scoped_eqns
from jmp_policy.paths import scope_names

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")
rm = pytest.importorskip("support.real_models")

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
E4M3 = np.dtype(jnp.float8_e4m3fn)


def products(fn, *args):
    """``(scope, lhs dtype)`` of every dot_general in ``fn``'s jaxpr (forward and backward)."""
    jaxpr = eqx.filter_make_jaxpr(fn)(*args)[0]
    return [(scope, np.dtype(e.invars[0].aval.dtype)) for scope, e in scoped_eqns(jaxpr)
            if e.primitive.name == "dot_general"]


# 1. Stale closures -------------------------------------------------------------------

def test_a_closure_is_read_at_call_time():
    params = {"w": jnp.ones((3, 3))}
    f = jmp_policy.autocast(lambda x: x @ params["w"], "mixed_bfloat16")
    x = jnp.ones((2, 3))
    assert float(f(x)[0, 0]) == 3.0
    params["w"] = 2 * jnp.ones((3, 3))
    assert float(f(x)[0, 0]) == 6.0  # an evaluation loop sees the new weights


def test_an_nnx_module_is_read_at_call_time():
    layer = nnx.Linear(3, 3, use_bias=False, rngs=nnx.Rngs(0))
    f = jmp_policy.autocast(layer, "mixed_bfloat16")
    x = jnp.ones((2, 3))
    before = f(x)
    layer.kernel[...] = 2 * layer.kernel[...]
    np.testing.assert_allclose(np.asarray(f(x), np.float32), 2 * np.asarray(before, np.float32))


# 2. Python values are not traced ----------------------------------------------------------

def test_python_numbers_reach_fn_as_they_are():
    def fn(x, n, *, repeat):
        for _ in range(repeat):  # a loop bound
            x = jnp.tanh(x @ x)
        return jnp.reshape(x, (n, -1))  # a shape

    out = jmp_policy.autocast(fn, "mixed_float16")(jnp.ones((4, 4)) * 0.1, 2, repeat=3)
    assert out.shape == (2, 8)
    jitted = jax.jit(jmp_policy.autocast(fn, "mixed_float16"), static_argnums=1,
                     static_argnames="repeat")
    assert jitted(jnp.ones((4, 4)), 8, repeat=1).shape == (8, 2)


class _Dropped(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dropout(0.5, deterministic=not train)(nn.Dense(4)(x))  # `not train`: a bool
        return nn.Dense(2)(x)


def test_a_linen_apply_with_a_python_flag():
    x = jnp.ones((3, 4))
    variables = _Dropped().init(jax.random.key(0), x, train=False)
    f = jmp_policy.autocast(_Dropped().apply, "mixed_float16")
    np.testing.assert_allclose(f(variables, x, train=False),
                               _Dropped().apply(variables, x, train=False), rtol=1e-2, atol=1e-2)
    dropped = f(variables, x, train=True, rngs={"dropout": jax.random.key(1)})
    assert dropped.dtype == F16 and dropped.shape == (3, 2)


@pytest.mark.slow  # a system test: the real-model zoo
def test_an_equinox_module_with_int_fields_under_filter_grad():
    model = rm.MODELS["eqx_vit"]
    vit, batch = model.init(jax.random.key(0)), model.batch(jax.random.key(1))
    loss = jmp_policy.autocast(model.loss, "mixed_bfloat16")
    # Traced, not run (test_real_models_autocast runs it): the int fields are shapes there.
    (value, _), grads = eqx.filter_eval_shape(eqx.filter_jit(model.value_and_grad(loss)),
                                              vit, batch, jax.random.key(2), True)
    assert isinstance(vit.patch_size, int) and grads.patch_size is None
    assert value.dtype == F32 and grads.head.weight.dtype == F32


# 3. NNX state is written back -------------------------------------------------------------

def _bn_model():
    return nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.BatchNorm(4, rngs=nnx.Rngs(1)))


@pytest.mark.parametrize("how", ["argument", "module as fn", "under nnx.jit"])
def test_nnx_batch_statistics_are_written_back(how):
    model, x = _bn_model(), jax.random.normal(jax.random.key(0), (8, 3)) + 2.0
    if how == "argument":
        jmp_policy.autocast(lambda m, x: m(x), "mixed_bfloat16")(model, x)
    elif how == "module as fn":
        jmp_policy.autocast(model, "mixed_bfloat16")(x)
    else:
        nnx.jit(jmp_policy.autocast(lambda m, x: m(x), "mixed_bfloat16"))(model, x)
    mean = model.layers[1].mean[...]
    want = 0.01 * model.layers[0](x).mean(0)  # momentum 0.99: one update from zero
    assert mean.dtype == F32
    np.testing.assert_allclose(mean, want, rtol=2e-2, atol=1e-4)


@pytest.mark.slow  # a system test: the real-model zoo
def test_nnx_rng_counters_advance_and_grads_flow():
    model = rm.MODELS["nnx_bn_mlp"]
    decoder, batch = model.init(jax.random.key(0)), model.batch(jax.random.key(1))
    loss = jmp_policy.autocast(model.loss, "mixed_bfloat16")
    jitted = nnx.jit(loss, static_argnums=2)
    first, second = jitted(decoder, batch, True)[0], jitted(decoder, batch, True)[0]
    assert float(first) != float(second)  # the dropout stream moved on between calls
    (_, _), grads = nnx.jit(model.value_and_grad(loss), static_argnums=2)(decoder, batch, True)
    assert isinstance(grads, nnx.State) and all(
        np.isfinite(g).all() for g in jax.tree.leaves(grads))


# 4. The loss is float32: loss scales grow past float16's range ------------------------------

@pytest.mark.slow  # a system test: the real-model zoo
def test_a_float32_class_loss_comes_back_float32_and_scales_freely():
    model = rm.MODELS["linen_lm"]
    variables, batch = model.init(jax.random.key(0)), model.batch(jax.random.key(1))
    loss = jmp_policy.autocast(model.loss, "mixed_float16")
    (value, _), grads = jax.jit(jmp_policy.scaled_value_and_grad(loss, has_aux=True),
                                static_argnums=5)(2.0 ** 17, variables["params"], {}, batch,
                                                   jax.random.key(2), False)
    assert value.dtype == F32
    # A scale beyond float16's maximum (a float16 loss's cotangent would be inf) that
    # the backward pass's float16 cotangents still fit in.
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


def test_the_dynamic_scale_grows_past_2_to_the_15():
    w = jnp.full((8, 8), 0.01)
    loss = jmp_policy.autocast(lambda w, x: jnp.mean((x @ w) ** 2), "mixed_float16")
    tx = jmp_policy.loss_scaling(optax.sgd(0.0), jmp_policy.DynamicLossScale(2.0 ** 15, period=1))

    @jax.jit
    def step(w, state, x):
        scale = jmp_policy.get_loss_scale(state)
        _, grads = jmp_policy.scaled_value_and_grad(loss)(scale, w, x)
        updates, state = tx.update(grads, state, w)
        return optax.apply_updates(w, updates), state

    state = tx.init(w)
    for _ in range(4):
        w, state = step(w, state, jnp.ones((4, 8)))
    assert int(state.skipped_steps) == 0
    assert float(jmp_policy.get_loss_scale(state).loss_scale) == 2.0 ** 19


# 5. float32 is the identity ----------------------------------------------------------------

@pytest.mark.slow  # a system test: the real-model zoo
def test_float32_autocast_of_a_real_model_is_bit_identical():
    model = rm.MODELS["linen_lm"]
    variables, batch = model.init(jax.random.key(0)), model.batch(jax.random.key(1))
    args = (variables["params"], {}, batch, jax.random.key(2), True)
    plain = jax.jit(model.value_and_grad(model.loss), static_argnums=4)
    cast = jax.jit(model.value_and_grad(jmp_policy.autocast(model.loss, "float32")),
                   static_argnums=4)
    assert cast.lower(*args).as_text() == plain.lower(*args).as_text()  # the same program
    if jax.default_backend() == "cpu":  # XLA:GPU's GEMM autotuning may differ per compile
        for a, b in zip(jax.tree.leaves(cast(*args)), jax.tree.leaves(plain(*args))):
            np.testing.assert_array_equal(a, b)


# 6. float8 with zero operands under jit ---------------------------------------------------

@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_float8_gradients_of_zero_rows_and_tensors_are_finite_under_jit(scaling):
    def loss(w, x, keep):
        h = jnp.where(keep, x / 0.9, 0.0)  # dropout's rescaling, then padding rows of zeros
        return jnp.sum(jnp.tanh(h @ w) ** 2)

    f = jmp_policy.autocast(loss, "mixed_bfloat16", fp8=scaling)
    w = jax.random.normal(jax.random.key(0), (32, 32)) * 0.2
    x = jax.random.normal(jax.random.key(1), (32, 32))
    for keep in (jnp.arange(32)[:, None] < 20, jnp.zeros((32, 1), bool)):  # rows, everything
        value, grads = jax.jit(jax.value_and_grad(f, (0, 1)))(w, x, keep)
        assert np.isfinite(float(value)) and all(np.isfinite(g).all() for g in grads)
        np.testing.assert_array_equal(grads[1][20:], 0.0)  # dropped rows get no gradient
    assert any(dtype == E4M3 for _, dtype in products(f, w, x, keep))


# 7. The smaller gaps ----------------------------------------------------------------------

def test_ragged_dot_accumulates_in_float32_like_dot_general():
    # 10,000 products of 1 and 0.1: a float16 accumulator stalls at 256.
    x, w = jnp.ones((8, 10_000)), jnp.ones((2, 10_000, 4)) * 0.1
    f = jmp_policy.autocast(
        lambda x, w: jax.lax.ragged_dot(x, w, jnp.array([5, 3], jnp.int32)), "mixed_float16")
    (ragged,) = [e for e in eqns(jax.make_jaxpr(f)(x, w)) if e.primitive.name == "ragged_dot_general"]
    assert [v.aval.dtype for v in ragged.invars[:2]] == [F16, F16]
    assert ragged.outvars[0].aval.dtype == F16  # the compute dtype, as dot_general's
    np.testing.assert_allclose(np.asarray(jax.jit(f)(x, w), np.float32), 1000.0, rtol=2e-3)


def test_policy_api_gaps_are_closed():
    policy = jmp_policy.Policy("mixed_float16", loss_scale=2.0 ** 10)
    # jmp's Policy is a dataclass: code written for it replaces fields.
    assert dataclasses.replace(policy, output_dtype=jnp.float32) == jmp_policy.Policy(
        "params=float32,compute=float16,output=float32", loss_scale=2.0 ** 10)
    scale = jmp_policy.DynamicLossScale(jnp.asarray(5.0, jnp.bfloat16))  # array scales, as jmp
    assert float(scale.loss_scale) == 5.0
    tx = jmp_policy.loss_scaling(optax.sgd(0.1), "mixed_float16")  # a name, like a Policy
    assert isinstance(jmp_policy.get_loss_scale(tx.init(jnp.ones(2))), jmp_policy.DynamicLossScale)


@pytest.mark.slow  # a system test: a child interpreter on 4 devices
def test_cast_to_compute_of_leaves_on_different_devices():
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp, jmp_policy
        tree = [jax.device_put(jnp.ones(2), d) for d in jax.devices()]
        out = jmp_policy.Policy("mixed_float16").cast_to_compute(tree)
        assert [x.dtype for x in out] == [jnp.float16] * 4
        assert [x.devices() for x in out] == [x.devices() for x in tree]
        print("ok")
    """)
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
               + " --xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_set_nnx_policy_rules_alone_leave_other_layers_as_built():
    import jmp_policy.flax

    model = nnx.Sequential(nnx.Linear(2, 4, rngs=nnx.Rngs(0)), nnx.LayerNorm(4, rngs=nnx.Rngs(0)))
    with jmp_policy.policy_scope("mixed_bfloat16"):
        jmp_policy.flax.set_nnx_policy(model, rules={nnx.LayerNorm: "float32"})
    assert model.layers[0].dtype is None and model.layers[1].dtype == F32


# 8. Scopes are module paths in every framework --------------------------------------------

@pytest.mark.slow  # a system test: the real-model zoo
def test_nnx_and_equinox_operations_are_named_by_module_path():
    decoder = rm.MODELS["nnx_decoder"]
    module, batch = decoder.init(jax.random.key(0)), decoder.batch(jax.random.key(1))
    f = jmp_policy.autocast(lambda m, b: decoder.loss(m, b, False)[0], "mixed_bfloat16")
    scopes = {scope for scope, _ in products(f, module, batch)}
    assert "NNXDecoder/blocks/0/attn/q_proj" in scopes
    assert "NNXDecoder/embedder.attend" in scopes
    vit = rm.MODELS["eqx_vit"]
    # Two blocks (the zoo's ViT has one): a scope pins one block's layer, not the other's.
    # Shapes only: products() traces, and compiling the initializers would take longer.
    module = eqx.filter_eval_shape(lambda key: rm.ViT(key=key, depth=2), jax.random.key(0))
    batch = vit.batch(jax.random.key(1))
    g = jmp_policy.autocast(lambda m, b: vit.loss(m, b, jax.random.key(2), False)[0],
                            "mixed_bfloat16")
    # Equinox names its own scope inside each layer: ViT/head/eqx.nn.Linear (JAX's
    # vmap(...) around the model, called under jax.vmap, left out).
    scopes = {"/".join(scope_names(scope)) for scope, _ in products(g, module, batch)}
    assert {"ViT/blocks/1/fc2/eqx.nn.Linear", "ViT/head/eqx.nn.Linear"} <= scopes
    pinned = jmp_policy.autocast(lambda m, b: vit.loss(m, b, jax.random.key(2), False)[0],
                                 "mixed_bfloat16", rules={"float32_scopes": ["blocks/1/fc2"]})
    dtypes = {"/".join(scope_names(s)): d for s, d in products(pinned, module, batch)}
    assert dtypes["ViT/blocks/1/fc2/eqx.nn.Linear"] == F32
    assert dtypes["ViT/blocks/0/fc2/eqx.nn.Linear"] == BF16  # the same layer, one block up
    assert dtypes["ViT/blocks/1/fc1/eqx.nn.Linear"] == BF16


@pytest.mark.slow  # a system test: the real-model zoo
@pytest.mark.parametrize("name,head", [("linen_lm", "Embed_0.attend"),
                                       ("nnx_decoder", "embedder.attend"),
                                       ("eqx_vit", "ViT/head")])
def test_the_output_layer_stays_out_of_float8_by_default(name, head):
    model = rm.MODELS[name]
    state, batch = model.init(jax.random.key(0)), model.batch(jax.random.key(1))
    loss = jmp_policy.autocast(model.loss, "mixed_bfloat16", fp8="rowwise")
    key = jax.random.key(2)
    if model.framework == "linen":
        fn, args = (lambda p, b: loss(p, {}, b, key, False)[0]), (state["params"], batch)
    elif model.framework == "nnx":
        fn, args = (lambda m, b: loss(m, b, False)[0]), (state, batch)
    else:
        fn, args = (lambda m, b: loss(m, b, key, False)[0]), (state, batch)
    found = [("/".join(scope_names(scope)), dtype)
             for scope, dtype in products(eqx.filter_grad(fn), *args)]
    assert {dtype for scope, dtype in found if head in scope} == {BF16}  # forward and backward
    assert E4M3 in {dtype for scope, dtype in found if head not in scope}


@pytest.mark.slow  # a system test: the real-model zoo
def test_fp8_on_a_convolutional_network_warns():
    model = rm.MODELS["linen_resnet"]
    variables, batch = model.init(jax.random.key(0)), model.batch(jax.random.key(1))
    rest = {"batch_stats": variables["batch_stats"]}
    f = jmp_policy.autocast(model.loss, "mixed_bfloat16", fp8="tensorwise")
    with pytest.warns(jmp_policy.AutocastWarning, match="convolutions stay in the compute dtype"):
        jax.make_jaxpr(f, static_argnums=4)(variables["params"], rest, batch,
                                            jax.random.key(2), False)


# 9. Auxiliary outputs keep their precision ------------------------------------------------

@pytest.mark.slow  # a system test: the real-model zoo
def test_batch_stats_stay_float32_and_the_train_step_traces_once():
    model = rm.MODELS["linen_resnet"]
    variables, batch = model.init(jax.random.key(0)), model.batch(jax.random.key(1))
    loss = jmp_policy.autocast(model.loss, "mixed_float16")
    tx = optax.sgd(0.01)

    @jax.jit
    def step(params, rest, opt_state):
        (_, aux), grads = jax.value_and_grad(loss, has_aux=True)(params, rest, batch, None, True)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), {"batch_stats": aux["batch_stats"]}, opt_state

    params, rest = variables["params"], {"batch_stats": variables["batch_stats"]}
    opt_state = tx.init(params)
    for _ in range(3):
        params, rest, opt_state = step(params, rest, opt_state)
    assert {x.dtype for x in jax.tree.leaves(rest)} == {F32}
    assert step._cache_size() == 1  # the state came back with the types it went in with


def test_autocast_functions_made_over_and_over_keep_no_growing_cache():
    from jmp_policy.autocast import interpreter as _interpreter

    x = jnp.ones((4, 4))
    for i in range(40):  # a fresh autocast each time, as inside a function traced repeatedly
        jmp_policy.autocast(lambda x: jnp.where(x > 0, x @ x, 0.0), "mixed_bfloat16")(x)
    sizes = [len(variants) for _, variants in _interpreter._REWRITES._entries.values()]
    assert sizes and max(sizes) <= _interpreter._VARIANTS_PER_JAXPR


def test_a_pass_through_branch_keeps_float32_as_jnp_where_does():
    # A float32 value stays float32 unless matrix work produced it. A choice
    # between a product and an input passed through (lax.cond, jnp.where) is not a product.
    from jax import lax

    w, x = jnp.eye(2), jnp.full((2, 2), 1.001, F32)
    policy = jmp_policy.Policy("mixed_bfloat16")
    out_dtype = np.dtype(policy.output_dtype)
    assert out_dtype == BF16
    chosen = {
        "cond": jax.jit(jmp_policy.autocast(
            lambda p, x: lax.cond(p, lambda v: v @ w, lambda v: v, x), policy)),
        "where": jax.jit(jmp_policy.autocast(lambda p, x: jnp.where(p, x @ w, x), policy)),
    }
    for name, f in chosen.items():
        passed, product = f(False, x), f(True, x)
        assert passed.dtype == product.dtype == F32, name
        np.testing.assert_array_equal(passed, x, err_msg=name)  # 1.001, not bfloat16's 1.0
        np.testing.assert_allclose(product, x @ w, rtol=1e-2, err_msg=name)
    # A product in every branch, or a product and a literal fill (masked logits), is still
    # matrix work: returned in the output dtype.
    both = jax.jit(jmp_policy.autocast(
        lambda p, x: lax.cond(p, lambda v: v @ w, lambda v: (2 * v) @ w, x), policy))
    masked = jax.jit(jmp_policy.autocast(lambda x: jnp.where(x > 1, x @ w, -jnp.inf), policy))
    assert both(False, x).dtype == masked(x).dtype == out_dtype


# 10. Models rebuilt inside the traced function ----------------------------------------------
# A loss that rebuilds its model (nnx.merge, nnx.update, eqx.combine) or applies a linen
# module gets the same module-path scopes, rules and float8 exclusions as one that receives
# the module as an argument.

V, D = 64, 32


class NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.Linear(D, D, rngs=rngs)
        self.mlp = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        return x + self.mlp(jax.nn.gelu(self.attn(x)))


class NNXLM(nnx.Module):
    def __init__(self, rngs):
        self.embedder = nnx.Embed(V, D, rngs=rngs)
        self.layers = nnx.List([NNXBlock(rngs) for _ in range(2)])

    def __call__(self, tokens):
        x = self.embedder(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.embedder.attend(x)  # the tied head


class EqxBlock(eqx.Module):
    attn: eqx.nn.Linear
    mlp: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.attn, self.mlp = eqx.nn.Linear(D, D, key=k1), eqx.nn.Linear(D, D, key=k2)

    def __call__(self, x):
        return x + self.mlp(jax.nn.gelu(self.attn(x)))


class EqxLM(eqx.Module):
    embedder: eqx.nn.Embedding
    layers: list
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.embedder = eqx.nn.Embedding(V, D, key=k1)
        self.layers = [EqxBlock(k2), EqxBlock(k3)]
        self.head = eqx.nn.Linear(D, V, key=k4)

    def __call__(self, token):
        x = self.embedder(token)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(D)(jax.nn.gelu(nn.Dense(D)(x)))


class LinenLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(V, D)
        x = embed(tokens)
        for _ in range(2):
            x = LinenBlock()(x)
        return embed.attend(x)


def _xent(logits, tokens):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], -1))


# Built once, when a test first needs them (not while collecting): the models are only read.
@functools.cache
def _idioms():
    """``name -> (fn, args, reference fn, reference args)``: each rebuilding idiom, and the
    module-as-argument form it must match (``None`` for linen, which has no other form)."""
    tokens = jnp.arange(16).reshape(2, 8) % V
    nnx_model = NNXLM(nnx.Rngs(0))
    graphdef, params, rest = nnx.split(nnx_model, nnx.Param, ...)
    nnx_loss = (lambda m, t: _xent(m(t), t))

    def merged(p, t):  # flax's examples/gemma train step
        return _xent(nnx.merge(graphdef, p, rest)(t), t)

    def updated(p, t):  # an abstract model filled with nnx.update, the new state split off
        m = nnx.eval_shape(lambda: NNXLM(nnx.Rngs(0)))
        nnx.update(m, p, rest)
        loss = _xent(m(t), t)
        _, state = nnx.split(m)
        return loss

    eqx_model = EqxLM(jax.random.key(0))
    eqx_params, eqx_static = eqx.partition(eqx_model, eqx.is_array)
    eqx_loss = (lambda m, t: _xent(jax.vmap(jax.vmap(m))(t), t))
    linen = LinenLM()
    variables = linen.init(jax.random.key(0), tokens)
    return {
        "nnx.merge": (merged, (params, tokens), nnx_loss, (nnx_model, tokens)),
        "nnx.update": (updated, (params, tokens), nnx_loss, (nnx_model, tokens)),
        "eqx.combine": (lambda p, t: eqx_loss(eqx.combine(p, eqx_static), t),
                        (eqx_params, tokens), eqx_loss, (eqx_model, tokens)),
        "eqx.combine, static argument": (lambda p, s, t: eqx_loss(eqx.combine(p, s), t),
                                         (eqx_params, eqx_static, tokens), eqx_loss,
                                         (eqx_model, tokens)),
        "linen apply": (lambda v, t: _xent(linen.apply(v, t), t), (variables, tokens),
                        None, None),
    }


IDIOMS = ["nnx.merge", "nnx.update", "eqx.combine", "eqx.combine, static argument", "linen apply"]
HEADS = {"nnx": "NNXLM/embedder.attend", "eqx": "EqxLM/head", "linen": "LinenLM/Embed_0.attend"}


def _head(idiom):
    return HEADS[idiom.split(".")[0].split(" ")[0]]


def _dot_dtypes(fn, args, **kwargs):
    """``(scope, lhs dtype)`` of each product of jit(grad(autocast(fn))), forward and backward,
    scopes without JAX's transformation names."""
    f = jmp_policy.autocast(fn, "mixed_bfloat16", **kwargs)
    return [("/".join(scope_names(scope)), dtype)
            for scope, dtype in products(jax.jit(jax.grad(f)), *args)]


@pytest.mark.parametrize("idiom", IDIOMS)
def test_a_rebuilt_model_has_the_scopes_of_the_module_argument_form(idiom):
    fn, args, ref, ref_args = _idioms()[idiom]
    scopes = {row.scope for row in jmp_policy.inspect_numerics(fn, "mixed_bfloat16")(*args).rows}
    assert "" not in scopes
    if ref is None:  # linen names its modules itself
        assert scopes == {"LinenLM/Embed_0.attend", *(f"LinenLM/LinenBlock_{i}/Dense_{j}"
                                                      for i in range(2) for j in range(2))}
    else:
        report = jmp_policy.inspect_numerics(ref, "mixed_bfloat16")(*ref_args)
        assert scopes == {row.scope for row in report.rows}
        assert any(scope.startswith(_head(idiom)) for scope in scopes)
        assert any("/layers/1/mlp" in scope for scope in scopes)


@pytest.mark.parametrize("idiom", IDIOMS)
def test_rules_scoped_to_a_submodule_of_a_rebuilt_model_apply(idiom):
    fn, args, _, _ = _idioms()[idiom]
    layer = "LinenBlock_1/Dense_1" if idiom.startswith("linen") else "layers/1/mlp"
    dtypes = _dot_dtypes(fn, args, rules={"float32_scopes": [layer]})
    pinned = {dtype for scope, dtype in dtypes if layer in scope}
    assert pinned == {F32}  # forward and backward
    assert {dtype for scope, dtype in dtypes if layer not in scope} == {BF16}


@pytest.mark.parametrize("idiom", IDIOMS)
def test_the_head_of_a_rebuilt_model_stays_out_of_float8(idiom):
    fn, args, ref, ref_args = _idioms()[idiom]
    found = _dot_dtypes(fn, args, fp8="rowwise")
    head = _head(idiom)
    assert {dtype for scope, dtype in found if scope.startswith(head)} == {BF16}
    float8 = [scope for scope, dtype in found if dtype in (E4M3, np.dtype(jnp.float8_e5m2))]
    assert len(float8) == 3 * 4  # 4 block products, forward and two backward products each
    if ref is not None:
        assert sorted(found) == sorted(_dot_dtypes(ref, ref_args, fp8="rowwise"))


@pytest.mark.slow  # a system test: a child interpreter on 2 devices
def test_importing_under_a_mesh_works():
    """jmp_policy reads shard_map's primitive off a trace when imported: under
    jax.set_mesh that trace must use the mesh in force."""
    script = ("import jax\n"
              "mesh = jax.make_mesh((2,), ('data',), axis_types=(jax.sharding.AxisType.Explicit,))\n"
              "with jax.set_mesh(mesh):\n"
              "    import jmp_policy\n"
              "print(jmp_policy.autocast.__name__)\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0 and "autocast" in result.stdout, result.stderr[-2000:]
