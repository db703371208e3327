"""The real-model zoo (tests/real_models.py) in plain float32: each model trains.

These are the baselines that the library's transformations are later held to:
every model learns its fixed batch, its loss and gradients are finite with the
padding it carries, BatchNorm statistics move only in train mode, and the
Equinox model's ``int`` fields survive ``eqx.filter_jit``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("equinox")
import equinox as eqx  # noqa: E402
from flax import nnx  # noqa: E402

from real_models import MODELS, train_with_state  # noqa: E402

NAMES = list(MODELS)
LM_NAMES = ["linen_lm", "nnx_decoder"]
WITH_DROPOUT = ["linen_lm", "nnx_decoder", "nnx_bn_mlp", "eqx_vit"]


def _all_finite(tree) -> bool:
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree)
               if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact))


def _jitted_value_and_grad(model, train: bool):
    """``model.value_and_grad(model.loss)`` under the framework's jit, ``train`` fixed."""
    g = model.value_and_grad(model.loss)
    if model.framework == "linen":
        return jax.jit(lambda p, rest, batch, key: g(p, rest, batch, key, train))
    if model.framework == "nnx":
        return nnx.jit(lambda m, batch: g(m, batch, train))
    return eqx.filter_jit(lambda m, batch, key: g(m, batch, key, train))


def _call(model, fn, state, batch, key):
    if model.framework == "linen":
        rest = {k: v for k, v in state.items() if k != "params"}
        return fn(state["params"], rest, batch, key)
    if model.framework == "nnx":
        return fn(state, batch)  # dropout draws from the module's own Rngs
    return fn(state, batch, key)


@functools.cache
def _trained(name):
    """30 jitted train-mode steps (dropout on) on the model's fixed batch: (losses, final state).

    The loss goes in wrapped, as a transformed loss will: ``value_and_grad``
    takes any function with the loss's signature.
    """
    loss = MODELS[name].loss

    def wrapped(*args):
        return loss(*args)

    return train_with_state(MODELS[name], wrapped, steps=30)  # optax.adam(3e-3)


@pytest.mark.parametrize("name", NAMES)
def test_trains_on_a_fixed_batch(name):
    losses, _ = _trained(name)
    assert np.all(np.isfinite(losses))
    # Measured final/initial ratios, seeds 0 to 3: 0.03 to 0.43 (linen_resnet the highest).
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("name", NAMES)
def test_loss_and_grads_are_finite_under_jit(name):
    model = MODELS[name]
    state, batch = model.init(jax.random.key(0)), model.batch(jax.random.key(1))
    if name in LM_NAMES:  # rows of different lengths, the last one all padding
        lengths = np.sum(np.asarray(batch["tokens"]) != 0, axis=1)
        assert lengths[-1] == 0 and len(set(lengths.tolist())) == len(lengths), lengths
    fn = _jitted_value_and_grad(model, train=True)
    (loss1, aux), grads = _call(model, fn, state, batch, jax.random.key(2))
    (loss2, _), _ = _call(model, fn, state, batch, jax.random.key(3))
    assert loss1.shape == () and _all_finite((loss1, aux, grads))
    if name in WITH_DROPOUT:  # train=True draws new dropout masks
        assert loss1 != loss2
    if model.framework == "nnx":
        assert isinstance(grads, nnx.State)
        assert jax.tree.structure(grads) == jax.tree.structure(nnx.state(state, nnx.Param))
    if name == "nnx_decoder":
        assert "q_proj" in grads["blocks"][0]["attn"]


def test_language_model_heads_are_tied_to_their_embeddings():
    linen_params = MODELS["linen_lm"].init(jax.random.key(0))["params"]
    assert sorted(linen_params) == ["Embed_0", "LayerNorm_0", "LinenBlock_0", "LinenBlock_1",
                                    "pos_embedding"]  # no output Dense
    nnx_params = nnx.state(MODELS["nnx_decoder"].init(jax.random.key(0)), nnx.Param)
    assert sorted(nnx_params) == ["blocks", "embedder", "final_norm"]


def test_linen_resnet_batch_stats_move_in_train_mode_only():
    model = MODELS["linen_resnet"]
    variables, batch = model.init(jax.random.key(0)), model.batch(jax.random.key(1))
    params, rest = variables["params"], {"batch_stats": variables["batch_stats"]}
    loss = jax.jit(model.loss, static_argnums=4)
    _, aux = loss(params, rest, batch, jax.random.key(2), True)
    moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), aux["batch_stats"], rest["batch_stats"])
    assert all(jax.tree.leaves(moved)), moved
    _, aux = loss(params, rest, batch, jax.random.key(2), False)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)),
                                     aux["batch_stats"], rest["batch_stats"]))


def test_nnx_bn_mlp_running_statistics_move_in_train_mode_only():
    model = MODELS["nnx_bn_mlp"]
    module, batch = model.init(jax.random.key(0)), model.batch(jax.random.key(1))
    loss = nnx.jit(model.loss, static_argnums=2)

    def stats():
        return {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(module, nnx.BatchStat))}

    before = stats()
    assert sorted(p[-1] for p in before) == ["mean", "var"]
    loss(module, batch, True)
    after_train = stats()
    assert all(np.any(after_train[k] != before[k]) for k in before)
    eval1, _ = loss(module, batch, False)
    eval2, _ = loss(module, batch, False)
    assert all(np.array_equal(stats()[k], after_train[k]) for k in before)
    assert eval1 == eval2  # no dropout in eval mode


def test_eqx_vit_trains_under_filter_jit_with_its_int_fields_intact():
    model = MODELS["eqx_vit"]
    fresh = model.init(jax.random.key(0))
    assert type(fresh.patch_size) is int and type(fresh.width) is int
    # The int fields are ordinary (non-static) pytree leaves, as are eqx.nn.Dropout's p and inference.
    ints = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(fresh)
            if type(x) is int}
    assert ints == {".patch_size": 4, ".width": 32}
    losses, trained = _trained("eqx_vit")  # steps under eqx.filter_jit
    assert losses[-1] < 0.7 * losses[0]
    assert type(trained.patch_size) is int and trained.patch_size == 4
    assert type(trained.width) is int and trained.width == 32
    assert eqx.tree_equal(trained.head.weight.shape, fresh.head.weight.shape)
    assert not eqx.tree_equal(trained.head.weight, fresh.head.weight)
