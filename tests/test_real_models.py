"""The real-model zoo (tests/support/real_models.py) in plain float32: what the models are.

These are the baselines that the library's transformations are held to (in
tests/test_real_models_autocast.py, where every model also trains in float16):
language models carry padding and tied heads, BatchNorm statistics move only
in train mode, and the
Equinox model's ``int`` fields survive ``eqx.filter_jit``.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.slow  # a system test: the real-model zoo

pytest.importorskip("flax")
pytest.importorskip("equinox")
import equinox as eqx  # noqa: E402
from flax import nnx  # noqa: E402

from support.real_models import MODELS, train_with_state  # noqa: E402

NAMES = list(MODELS)
LM_NAMES = ["linen_lm", "nnx_decoder"]


@pytest.mark.parametrize("name", LM_NAMES)
def test_language_model_batches_are_padded_to_different_lengths(name):
    # Loss and gradients are compared with autocast's, finite, in test_real_models_autocast.
    batch = MODELS[name].batch(jax.random.key(1))
    lengths = np.sum(np.asarray(batch["tokens"]) != 0, axis=1)
    assert lengths[-1] == 0 and len(set(lengths.tolist())) == len(lengths), lengths


def test_language_model_heads_are_tied_to_their_embeddings():
    linen_params = MODELS["linen_lm"].init(jax.random.key(0))["params"]
    assert sorted(linen_params) == ["Embed_0", "LayerNorm_0", "LinenBlock_0",
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
    losses, trained = train_with_state(model, steps=5)  # steps under eqx.filter_jit
    assert losses[-1] < losses[0]
    assert type(trained.patch_size) is int and trained.patch_size == 4
    assert type(trained.width) is int and trained.width == 32
    assert eqx.tree_equal(trained.head.weight.shape, fresh.head.weight.shape)
    assert not eqx.tree_equal(trained.head.weight, fresh.head.weight)
