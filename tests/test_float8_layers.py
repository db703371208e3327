"""Keeping the first and last layers of a stack in the compute dtype
(``Float8Recipe.high_precision_layers``), the rules that match nothing, and changing the
recipe for the last steps of training.

Which products ran in float8 is read from the jaxpr autocast writes: a product in
float8 (or NVFP4) has casts to a format of eight bits or fewer in its scope, forward and
backward; a kept layer has none, and its products take the compute dtype.
"""

import collections
import contextlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_policy
from jmp_policy import Float8Recipe, UnmatchedRuleWarning
from jmp_policy.jaxprs import scoped_eqns
from jmp_policy.paths import display_scope, is_backward

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

BF16 = np.dtype(jnp.bfloat16)


def narrow_casts(fn, *args, stem):
    """``(casts, dots)`` of ``fn``'s jaxpr by ``(layer number, phase)``, for the layers
    ``<stem><n>``: how many casts to a format of eight bits or fewer, and the operand
    dtypes of its ``dot_general`` equations."""
    casts, dots = collections.Counter(), collections.defaultdict(set)
    for path, eqn in scoped_eqns(jax.make_jaxpr(fn)(*args)):
        found = re.search(rf"(^|/){re.escape(stem)}(\d+)(/|$)", display_scope(path))
        if found is None:
            continue
        key = (int(found[2]), "backward" if is_backward(path) else "forward")
        if eqn.primitive.name == "convert_element_type":
            new = np.dtype(eqn.params["new_dtype"])
            casts[key] += jnp.issubdtype(new, jnp.floating) and jnp.finfo(new).bits <= 8
        elif eqn.primitive.name == "dot_general":
            dots[key] |= {np.dtype(v.aval.dtype) for v in eqn.invars}
    return casts, dots


def assert_kept(casts, dots, kept, quantized):
    """The layers ``kept`` run every product in bfloat16, forward and backward; the layers
    ``quantized`` quantize their operands in both passes."""
    for layer in kept:
        for phase in ("forward", "backward"):
            assert casts[layer, phase] == 0, (layer, phase)
            assert dots[layer, phase] == {BF16}, (layer, phase)
    for layer in quantized:
        for phase in ("forward", "backward"):
            assert casts[layer, phase] > 0, (layer, phase)


@contextlib.contextmanager
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# --- Models ----------------------------------------------------------------------------

class Block(nn.Module):
    @nn.compact
    def __call__(self, x):  # two numbered Dense layers: a stack inside each block
        return x + nn.Dense(32)(jax.nn.relu(nn.Dense(64)(x)))


class ScanBlock(nn.Module):  # Block as nn.scan's body: (carry, x) -> (carry, y)
    @nn.compact
    def __call__(self, x, _):
        return x + nn.Dense(32)(jax.nn.relu(nn.Dense(64)(x))), None


class LinenLM(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(4):
            x = Block()(x)
        return nn.Dense(16, name="logits")(x)


class NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.mlp = nnx.Linear(32, 32, rngs=rngs)

    def __call__(self, x):
        return x + jax.nn.relu(self.mlp(x))


class NNXModel(nnx.Module):
    def __init__(self, rngs, n=5):
        self.layers = nnx.List([NNXBlock(rngs) for _ in range(n)])
        self.head = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def plain_stack(ws, x):
    for i, w in enumerate(ws):
        with jax.named_scope(f"layer_{i}"):
            x = jnp.tanh(x @ w)
    return jnp.mean(x.astype(jnp.float32) ** 2)


WS = [jax.random.normal(jax.random.key(i), (32, 32)) / 6 for i in range(4)]
X = jax.random.normal(jax.random.key(9), (32, 32))


# --- The rule --------------------------------------------------------------------------

def test_linen_stack_keeps_its_first_and_last_blocks_in_bfloat16():
    model = LinenLM()
    params = model.init(jax.random.key(0), X)

    def loss(params, x):
        return jnp.mean(model.apply(params, x).astype(jnp.float32) ** 2)

    recipe = Float8Recipe("nvfp4", high_precision_layers=(1, 1))
    f = jmp_policy.autocast(loss, "mixed_bfloat16", fp8=recipe)
    with no_warnings():
        casts, dots = narrow_casts(jax.grad(f), params, X, stem="Block_")
    # Blocks 1 and 2 run in NVFP4; each block's own Dense_0, Dense_1 is no stack of its own.
    assert_kept(casts, dots, kept=(0, 3), quantized=(1, 2))
    # The same blocks with no rule: all four quantized.
    f = jmp_policy.autocast(loss, "mixed_bfloat16", fp8="nvfp4")
    casts, dots = narrow_casts(jax.grad(f), params, X, stem="Block_")
    assert_kept(casts, dots, kept=(), quantized=(0, 1, 2, 3))


def test_nnx_layers_in_a_list_keep_the_last_two():
    model = NNXModel(nnx.Rngs(0))
    recipe = Float8Recipe(high_precision_layers=(0, 2))
    f = jmp_policy.autocast(lambda m, x: jnp.mean(m(x).astype(jnp.float32) ** 2),
                            "mixed_bfloat16", fp8=recipe)
    # NNX names the list's modules by their attribute path: NNXModel/layers/0 ... /4.
    with no_warnings():
        casts, dots = narrow_casts(jax.grad(f), model, X, stem="layers/")
    assert_kept(casts, dots, kept=(3, 4), quantized=(0, 1, 2))


def test_named_scope_stack_and_the_reason_given():
    recipe = Float8Recipe(high_precision_layers=(1, 2))
    f = jmp_policy.autocast(plain_stack, "mixed_bfloat16", fp8=recipe)
    with no_warnings():
        casts, dots = narrow_casts(jax.grad(f), WS, X, stem="layer_")
    assert_kept(casts, dots, kept=(0, 2, 3), quantized=(1,))
    # why_not_float8 names the layer, the stack and the rule.
    stacks = jmp_policy.float8.find_stacks([f"layer_{i}" for i in range(4)])
    kept = jmp_policy.float8.KeptLayers.of((1, 2), [f"layer_{i}" for i in range(4)])
    assert [s.name for s in stacks] == [s.name for s in kept.stacks] == ["layer_*"]
    eqn = jax.make_jaxpr(jnp.matmul)(X, WS[0]).eqns[0]
    assert jmp_policy.float8.why_not_float8(recipe, eqn, "transpose(jvp(layer_3))", kept) == (
        "its scope is in layer 3 of the stack 'layer_*', kept in the compute dtype by "
        "high_precision_layers=(1, 2)")
    assert jmp_policy.float8.why_not_float8(recipe, eqn, "layer_1", kept) is None


def test_a_jitted_block_called_in_every_layer_is_decided_per_layer():
    block = jax.jit(lambda x, w: jnp.tanh(x @ w))  # one jaxpr, rewritten at each call site

    def stack(ws, x):
        for i, w in enumerate(ws):
            with jax.named_scope(f"layer_{i}"):
                x = block(x, w)
        return jnp.mean(x.astype(jnp.float32) ** 2)

    f = jmp_policy.autocast(stack, "mixed_bfloat16",
                            fp8=Float8Recipe(high_precision_layers=(1, 1)))
    casts, dots = narrow_casts(jax.grad(f), WS, X, stem="layer_")
    assert_kept(casts, dots, kept=(0, 3), quantized=(1, 2))


def test_one_jitted_product_under_an_excluded_scope_and_another():
    dense = jax.jit(jnp.matmul)

    def f(x, w):
        with jax.named_scope("mlp"):
            a = dense(x, w)
        with jax.named_scope("logits"):
            b = dense(x, w)
        return a, b

    jaxpr = jax.make_jaxpr(jmp_policy.autocast(f, "mixed_bfloat16", fp8="tensorwise"))(X, X)
    dtypes = {display_scope(path): {np.dtype(v.aval.dtype) for v in e.invars}
              for path, e in scoped_eqns(jaxpr) if e.primitive.name == "dot_general"}
    assert dtypes == {"mlp": {np.dtype(jnp.float8_e4m3fn)}, "logits": {BF16}}


@pytest.mark.parametrize("scopes,stacks", [
    ([f"LM/Block_{i}/Dense_{j}" for i in range(3) for j in range(2)], ["LM/Block_*"]),
    (["LM/Block_0/Dense_0", "LM/Block_0/Dense_1"], []),  # one block's own parts
    ([f"T/{part}_0/Layer_{i}/attn" for part in ("Encoder", "Decoder") for i in range(2)],
     ["T/Decoder_0/Layer_*", "T/Encoder_0/Layer_*"]),
    (["M/layers/0/mlp", "M/layers/1.decode/mlp", "M/head"], ["M/layers/*"]),
    (["transpose(jvp(layer_0))", "jvp(layer_1)", "layer_2"], ["layer_*"]),
    # Linen numbers unnamed layers beside the blocks too: they are a stack of their own.
    (["LM/Dense_0", "LM/Block_0/Dense_0", "LM/Block_1/Dense_0", "LM/Dense_1"],
     ["LM/Block_*", "LM/Dense_*"]),
])
def test_stacks_are_the_outermost_numbered_siblings(scopes, stacks):
    assert [s.name for s in jmp_policy.float8.find_stacks(scopes)] == stacks


# --- Rules that match nothing ----------------------------------------------------------

def test_a_rule_that_finds_no_stack_warns_once_naming_what_it_saw():
    def scanned(ws, x):  # a scanned stack: one body, no layer numbers
        def body(x, w):
            with jax.named_scope("block"):
                return jnp.tanh(x @ w), None
        return jnp.sum(jax.lax.scan(body, x, jnp.stack(ws))[0])

    f = jmp_policy.autocast(scanned, "mixed_bfloat16",
                            fp8=Float8Recipe(high_precision_layers=(0, 1)))
    with pytest.warns(UnmatchedRuleWarning) as record:
        jax.make_jaxpr(jax.grad(f))(WS, X)
    (warning,) = [w for w in record if w.category is UnmatchedRuleWarning]
    message = str(warning.message)
    assert "high_precision_layers=(0, 1) matched no stack" in message
    assert "scanned" in message and "'block'" in message and "split the scan" in message
    # Linen's scanned blocks: the body's Dense_0 and Dense_1 run in every layer.
    class Scanned(nn.Module):
        @nn.compact
        def __call__(self, x):
            body = nn.scan(ScanBlock, variable_axes={"params": 0},
                           split_rngs={"params": True}, length=4)
            return body(name="blocks")(x, None)[0]

    model = Scanned()
    params = model.init(jax.random.key(0), X)
    f = jmp_policy.autocast(lambda p, x: jnp.sum(model.apply(p, x)), "mixed_bfloat16",
                            fp8=Float8Recipe(high_precision_layers=(0, 1)))
    with pytest.warns(UnmatchedRuleWarning, match="'Scanned/blocks/Dense_0'"):
        jax.make_jaxpr(f)(params, X)
    # A single numbered scope is no stack either.
    one = jmp_policy.autocast(plain_stack, "mixed_bfloat16",
                              fp8=Float8Recipe(high_precision_layers=(1, 0)))
    with pytest.warns(UnmatchedRuleWarning, match="'layer_0'"):
        jax.make_jaxpr(one)(WS[:1], X)


def test_an_exclude_entry_that_matches_no_product_warns_once():
    recipe = Float8Recipe(exclude=(*Float8Recipe.DEFAULT_EXCLUDE, "layer_9", "layer_1"))
    f = jmp_policy.autocast(plain_stack, "mixed_bfloat16", fp8=recipe)
    with pytest.warns(UnmatchedRuleWarning) as record:
        jax.make_jaxpr(jax.grad(f))(WS, X)
    messages = [str(w.message) for w in record if w.category is UnmatchedRuleWarning]
    assert len(messages) == 1  # "layer_1" matches; the default entries are not the user's
    assert "exclude entry 'layer_9' matched no matrix product of plain_stack" in messages[0]
    assert "'layer_0', 'layer_1', 'layer_2', 'layer_3'" in messages[0]


def test_the_default_recipe_and_matching_rules_warn_nothing():
    with no_warnings():
        for recipe in (Float8Recipe(), Float8Recipe("nvfp4"),
                       Float8Recipe(exclude="layer_2", high_precision_layers=(1, 0))):
            f = jmp_policy.autocast(plain_stack, "mixed_bfloat16", fp8=recipe)
            jax.make_jaxpr(jax.grad(f))(WS, X)


@pytest.mark.parametrize("value,error,match", [
    ((1,), TypeError, r"high_precision_layers must be a pair of ints \(first, last\)"),
    (2, TypeError, "got 2"),
    ((1.0, 1), TypeError, "pair of ints"),
    ((True, 0), TypeError, "pair of ints"),
    ((0, -1), ValueError, "must be two non-negative ints"),
])
def test_bad_high_precision_layers_raise_naming_the_field(value, error, match):
    with pytest.raises(error, match=match):
        Float8Recipe(high_precision_layers=value)


def test_layer_counts_are_a_hashable_tuple():
    recipe = Float8Recipe(high_precision_layers=[0, 2])
    assert recipe.high_precision_layers == (0, 2)
    assert hash(recipe) == hash(Float8Recipe(high_precision_layers=(0, 2)))
    assert Float8Recipe().high_precision_layers == (0, 0)


def test_single_product_apis_refuse_the_rule():
    recipe = Float8Recipe(high_precision_layers=(0, 1))
    with pytest.raises(ValueError, match="each call sees one product"):
        jmp_policy.dot_general("mixed_bfloat16", fp8=recipe)
    jf = pytest.importorskip("jmp_policy.flax")
    with pytest.raises(ValueError, match="traced without the model's scopes"):
        jf.NNXFloat8DotGeneral(fp8=Float8Recipe("delayed", high_precision_layers=(0, 1)))
    with pytest.raises(ValueError, match=r"exclude entries \['router'\]"):
        jf.NNXFloat8DotGeneral(fp8=Float8Recipe("delayed", exclude="router"))


def test_the_inspector_says_why_a_layer_stayed_in_bfloat16():
    recipe = Float8Recipe(high_precision_layers=(0, 1))
    report = jmp_policy.inspect_numerics(plain_stack, "mixed_bfloat16", fp8=recipe,
                                         argnums=0)(WS, X)
    products = [r for r in report if r.primitive == "dot_general"]
    last = [r for r in products if r.scope == "layer_3"]
    assert {r.phase for r in last} == {"forward", "backward"}
    assert all(r.dtype == "bfloat16" and r.why_not_fp8 == (
        "its scope is in layer 3 of the stack 'layer_*', kept in the compute dtype by "
        "high_precision_layers=(0, 1)") for r in last)
    assert all(r.why_not_fp8 is None for r in products if r.scope != "layer_3")
    # Every reason why_not_float8 gives is told so: here an excluded output layer.
    k1, k2 = jax.random.split(jax.random.key(1))
    params = {"w1": jax.random.normal(k1, (32, 64)) / 6, "w2": jax.random.normal(k2, (64, 16))}
    report = jmp_policy.inspect_numerics(mlp_loss, "mixed_bfloat16", fp8="tensorwise")(
        params, X, jnp.arange(32) % 16)
    reasons = {r.scope: r.why_not_fp8 for r in report if r.primitive == "dot_general"}
    assert reasons[""] is None and "matches the recipe's exclude" in reasons["logits"]


# --- Another recipe for the last steps ------------------------------------------------

def mlp_loss(params, x, y):
    h = jax.nn.gelu(x @ params["w1"])
    with jax.named_scope("logits"):
        logits = h @ params["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def test_switching_from_nvfp4_to_bfloat16_keeps_params_and_optimizer_state():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k1, (64, 128)) / 8,
              "w2": jax.random.normal(k2, (128, 16)) / 11}
    x, y = jax.random.normal(k3, (64, 64)), jnp.arange(64) % 16
    tx = optax.adam(3e-3)

    def make_step(fp8):
        loss_fn = jmp_policy.autocast(mlp_loss, "mixed_bfloat16", fp8=fp8)

        @jax.jit
        def step(params, opt_state, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss
        return step

    opt_state = tx.init(params)
    structure = jax.tree.structure(opt_state)
    losses = []
    for step, n in ((make_step("nvfp4"), 20), (make_step(None), 10)):
        for _ in range(n):
            params, opt_state, loss = step(params, opt_state, x, y)
            losses.append(float(loss))
        assert type(opt_state) is type(tx.init(params))
        assert jax.tree.structure(opt_state) == structure
        assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))
    assert np.all(np.isfinite(losses))
    assert losses[19] < losses[0] and losses[-1] < losses[19]
    assert losses[20] < losses[19] * 1.05  # no jump at the switch
    assert int(opt_state[0].count) == 30  # one Adam state through both recipes
