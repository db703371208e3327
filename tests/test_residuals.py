"""jmp_policy.saved_residuals: the arrays a backward pass keeps, by scope, dtype and bytes.

The MLP ``tanh(x @ w1) @ w2``, differentiated with respect to ``w1`` and
``w2``, keeps what JAX's rules need: ``tanh``'s output (for ``w2``'s
gradient), tanh's derivative (``TANH_DERIVATIVE``), ``x`` (for ``w1``'s
gradient) and ``w2`` (for the hidden cotangent); not ``w1``, whose value the
backward pass never reads. Every test asserts those arrays, or what a
transformation (autocast, checkpoint, scan, jit) makes of them.
"""

import importlib.util
import json
import pathlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.jaxpr_walk import TANH_DERIVATIVE

import jmp_policy

B, D, H, O = 5, 3, 4, 2  # batch, inputs, hidden, outputs: every shape tells its array
W1, W2, X = jnp.ones((D, H)), jnp.ones((H, O)), jnp.ones((B, D))
F32, BF16 = 4, 2


def mlp(w1, w2, x):
    with jax.named_scope("mlp"):
        with jax.named_scope("hidden"):
            h = jnp.tanh(x @ w1)
        with jax.named_scope("out"):
            return jnp.sum(h @ w2)


def summary(report):
    return [(r.scope, r.primitive, r.shape, r.dtype, r.kind, r.argument) for r in report]


def activations(report):
    return [(r.scope, r.primitive, r.shape, r.dtype) for r in report if r.kind == "activation"]


def test_the_mlp_keeps_tanh_its_derivative_and_two_arguments():
    report = jmp_policy.saved_residuals(mlp, W1, W2, X, argnums=(0, 1))
    assert summary(report) == [
        ("mlp/hidden", "tanh", (B, H), "float32", "activation", ""),
        ("mlp/hidden", TANH_DERIVATIVE, (B, H), "float32", "activation", ""),
        ("argument", "", (H, O), "float32", "argument", "w2"),
        ("argument", "", (B, D), "float32", "argument", "x"),
    ]
    assert report.total_bytes == 2 * B * H * F32
    assert report.argument_bytes == (H * O + B * D) * F32
    assert report.by_scope() == {"mlp": 2 * B * H * F32}
    assert report.by_scope(depth=None) == {"mlp/hidden": 2 * B * H * F32}


def test_differentiating_the_input_keeps_the_weights_instead():
    report = jmp_policy.saved_residuals(mlp, W1, W2, X, argnums=2)
    assert [(r.argument, r.shape) for r in report if r.kind == "argument"] == [
        ("w1", (D, H)), ("w2", (H, O))]


def test_autocast_keeps_bfloat16_residuals_at_half_the_bytes():
    full = jmp_policy.saved_residuals(mlp, W1, W2, X, argnums=(0, 1))
    half = jmp_policy.saved_residuals(jmp_policy.autocast(mlp, "mixed_bfloat16"),
                                      W1, W2, X, argnums=(0, 1))
    # The products' bfloat16 operands replace the float32 arguments: copies kept.
    assert activations(half) == [
        ("mlp/hidden", "convert_element_type", (B, D), "bfloat16"),
        ("mlp/hidden", "tanh", (B, H), "bfloat16"),
        ("mlp/hidden", TANH_DERIVATIVE, (B, H), "bfloat16"),
        ("mlp/out", "convert_element_type", (H, O), "bfloat16"),
    ]
    assert half.argument_bytes == 0

    def hidden(report):
        return sum(r.bytes for r in report if r.primitive in ("tanh", TANH_DERIVATIVE))

    assert hidden(half) * 2 == hidden(full) == 2 * B * H * F32


def test_a_checkpoint_that_saves_nothing_keeps_only_arguments():
    remat = jax.checkpoint(mlp, policy=jax.checkpoint_policies.nothing_saveable)
    report = jmp_policy.saved_residuals(remat, W1, W2, X, argnums=(0, 1))
    assert activations(report) == [] and report.total_bytes == 0
    assert [r.argument for r in report] == ["w1", "w2", "x"]


def test_a_checkpoint_that_saves_dots_keeps_only_the_product():
    remat = jax.checkpoint(mlp, policy=jax.checkpoint_policies.dots_saveable)
    report = jmp_policy.saved_residuals(remat, W1, W2, X, argnums=(0, 1))
    # tanh and 1 - tanh are recomputed from the saved x @ w1; h @ w2's result is not needed.
    assert activations(report) == [("mlp/hidden", "dot_general", (B, H), "float32")]


def test_linen_blocks_are_the_scopes():
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(H, name="up")(x)
            return nn.Dense(D, name="down")(jnp.tanh(h))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = Block(name="Block_0")(x)
            return Block(name="Block_1")(x)

    model = Model()
    params = model.init(jax.random.key(0), X)["params"]
    report = jmp_policy.saved_residuals(
        lambda p, x: jnp.sum(model.apply({"params": p}, x)), params, X)
    assert activations(report) == [
        ("Model/Block_0", "tanh", (B, H), "float32"),
        ("Model/Block_0", TANH_DERIVATIVE, (B, H), "float32"),
        ("Model/Block_0/down", "add", (B, D), "float32"),  # Block_1's input
        ("Model/Block_1", "tanh", (B, H), "float32"),
        ("Model/Block_1", TANH_DERIVATIVE, (B, H), "float32"),
    ]
    assert report.by_scope(depth=2) == {"Model/Block_0": (2 * B * H + B * D) * F32,
                                        "Model/Block_1": 2 * B * H * F32}
    # Every kernel a cotangent passes through back to a parameter; not Block_0's first.
    kept = {r.argument for r in report if r.kind == "argument"}
    assert kept == {"p/Block_0/down/kernel", "p/Block_1/up/kernel", "p/Block_1/down/kernel",
                    "x"}


@pytest.mark.parametrize("remat", [False, True], ids=["scan", "scan_of_checkpoint"])
def test_a_scan_over_layers_keeps_stacked_residuals_once(remat):
    layers = 6

    def body(h, w):
        with jax.named_scope("layer"):
            return jnp.tanh(h @ w), None

    if remat:
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.dots_saveable)

    def stack(ws, x):
        with jax.named_scope("stack"):
            return jnp.sum(jax.lax.scan(body, x, ws)[0])

    report = jmp_policy.saved_residuals(stack, jnp.ones((layers, D, D)), X)
    # Without remat, tanh's output is the next carry, kept by the scan; JAX before 0.11
    # keeps it again for the derivative.
    inner = [("stack/layer", "dot_general")] if remat else [
        ("stack/layer", "tanh"), ("stack/layer", "sub")] if TANH_DERIVATIVE == "sub" else [
        ("stack/layer", TANH_DERIVATIVE)]
    # The carry each layer receives (its input), stacked by the scan; then the body's.
    assert [(r.scope, r.primitive) for r in report if r.kind == "activation"] == [
        ("stack", "scan"), *inner]
    for row in report:
        if row.kind == "activation":
            assert (row.shape, row.loop, row.bytes) == ((layers, B, D), "stack",
                                                        layers * B * D * F32)
    assert report.total_bytes == (1 + len(inner)) * layers * B * D * F32


def test_one_array_kept_for_two_uses_counts_once():
    @jax.jit
    def twice(x, w):
        h = jnp.tanh(x @ w)
        return h, h  # two outputs, one array

    def loss(w1, w2):
        a, b = twice(X, w1)
        return jnp.sum((a @ w2) * (b @ w2))  # each product keeps its operand

    report = jmp_policy.saved_residuals(loss, W1, W2, argnums=(0, 1))
    assert [(r.primitive, r.shape) for r in report if r.kind == "activation"] == [
        ("tanh", (B, H)), (TANH_DERIVATIVE, (B, H)),
        ("dot_general", (B, O)), ("dot_general", (B, O))]
    assert report.total_bytes == (2 * B * H + 2 * B * O) * F32


def test_closed_over_arrays_are_constants():
    report = jmp_policy.saved_residuals(lambda w1, w2: mlp(w1, w2, X), W1, W2, argnums=(0, 1))
    assert [(r.scope, r.kind, r.shape) for r in report if r.kind != "activation"] == [
        ("argument", "argument", (H, O)), ("constant", "constant", (B, D))]
    assert report.argument_bytes == (H * O + B * D) * F32


def test_bytes_are_the_shapes_times_the_itemsizes():
    def block(w, x):
        scores = x @ w
        keep = scores > 0                              # a bool residual of jnp.where
        probs = jax.nn.softmax(jnp.where(keep, scores, -1e9), axis=-1)
        return jnp.sum(jax.nn.relu(probs @ w.T))

    fn = jmp_policy.autocast(block, "mixed_bfloat16")
    report = jmp_policy.saved_residuals(fn, jnp.ones((D, D)), X)
    dtypes = {r.dtype for r in report}
    assert {"bfloat16", "float32", "bool"} <= dtypes
    for row in report:
        assert row.bytes == int(np.prod(row.shape)) * np.dtype(row.dtype).itemsize
    assert report.total_bytes == sum(r.bytes for r in report if r.kind == "activation")
    assert sum(report.by_scope().values()) == report.total_bytes


def test_an_nnx_module_is_differentiated_by_its_parameters():
    model = nnx.Sequential(nnx.Linear(D, H, rngs=nnx.Rngs(0)), jnp.tanh,
                           nnx.Linear(H, O, rngs=nnx.Rngs(1)))
    report = jmp_policy.saved_residuals(lambda m, x: jnp.sum(m(x)), model, X)
    assert activations(report) == [("Sequential", "tanh", (B, H), "float32"),
                                   ("Sequential", TANH_DERIVATIVE, (B, H), "float32")]


def test_the_table_and_json_say_the_same():
    report = jmp_policy.saved_residuals(mlp, W1, W2, X, argnums=(0, 1))
    lines = str(report).splitlines()
    assert lines[0] == ("Residuals of mlp: 2 activations, 160 B "
                        "(and 2 inputs of its own, 92 B, in memory anyway)")
    assert lines[1].split(" | ")[0].strip() == "scope"
    assert lines[3].split() == ["mlp/hidden", "|", "tanh", "|", "5x4", "|", "float32", "|",
                                "80", "B"]
    assert lines[-1] == "Activations by scope: mlp 160 B"
    document = json.loads(report.to_json())
    assert document["total_bytes"] == report.total_bytes == 160
    assert [tuple(r["shape"]) for r in document["rows"]] == [r.shape for r in report]
    assert report.largest(1)[0].primitive == "tanh" and len(report[:2]) == 2


def test_bad_argnums_are_clear_errors():
    with pytest.raises(ValueError, match=r"argnums=\(3,\).*3 positional argument"):
        jmp_policy.saved_residuals(mlp, W1, W2, X, argnums=3)
    with pytest.raises(TypeError, match="argnums must be an int or a non-empty tuple"):
        jmp_policy.saved_residuals(mlp, W1, W2, X, argnums=None)
    with pytest.raises(TypeError, match="argnums must be an int"):
        jmp_policy.saved_residuals(mlp, W1, W2, X, argnums="w1")
    with pytest.raises(ValueError, match="argument 2 of .* no floating-point arrays"):
        jmp_policy.saved_residuals(mlp, W1, W2, jnp.ones((B, D), jnp.int32), argnums=2)
    with pytest.raises(ValueError, match="by_scope depth"):
        jmp_policy.saved_residuals(mlp, W1, W2, X).by_scope(depth=0)


def _load_lm():
    path = pathlib.Path(__file__).resolve().parent.parent / "examples" / "transformer_lm.py"
    spec = importlib.util.spec_from_file_location("_residuals_transformer_lm", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # flax modules are dataclasses: they look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # a system test: examples/transformer_lm.py, initialized
def test_the_example_lm_keeps_what_the_debugging_guide_says():
    lm = _load_lm()
    config = lm.Config()
    reports = {}
    for policy in ("float32", "mixed_bfloat16"):
        init, _, eval_loss = lm.make_train_step(policy, config)
        params, _ = init(0)
        tokens = jnp.zeros((config.batch_size, config.seq_len), jnp.int32)
        reports[policy] = jmp_policy.saved_residuals(eval_loss, params, tokens)
    half, full = reports["mixed_bfloat16"], reports["float32"]
    mib = 2**20
    # docs/debugging.md: 17 MiB (26 MiB in float32), about 7.5 MiB per block; from JAX
    # 0.11, which keeps tanh's derivative as one array, 16 MiB (24 MiB) and 7 MiB.
    before_011 = TANH_DERIVATIVE == "sub"
    assert (round(half.total_bytes / mib), round(full.total_bytes / mib)) == (
        (17, 26) if before_011 else (16, 24))
    blocks = half.by_scope(depth=2)
    assert blocks["TransformerLM/Block_0"] == blocks["TransformerLM/Block_1"]
    assert round(blocks["TransformerLM/Block_0"] / mib, 1) == (7.5 if before_011 else 7.0)
    # ... the largest rows the float32 softmax of each attention layer and of the loss.
    assert [(r.scope.rpartition("/")[2], r.primitive, r.dtype) for r in half.largest(3)] == [
        ("", "exp", "float32"), ("Softmax_0", "exp", "float32"),
        ("Softmax_0", "exp", "float32")]
    # The MLP's GELU is bfloat16 under the policy.
    gelu = [r for r in half if r.scope == "TransformerLM/Block_0"
            and r.primitive in ("tanh", TANH_DERIVATIVE)]
    assert gelu and {r.dtype for r in gelu} == {"bfloat16"}
