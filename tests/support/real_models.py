"""A small zoo of real model architectures, in plain float32 Flax and Equinox.

Each model is ordinary, idiomatic user code of its framework, written here
after a public architecture, so that the library's transformations can be run
on what users actually write (tied embeddings, padding masks, dropout keys,
BatchNorm state, Equinox ``int`` fields, rotary embeddings, grouped-query
attention) rather than on toy functions. Nothing here uses ``jmp_policy``.

=============  =========  ======================================================
name           framework  follows
=============  =========  ======================================================
linen_lm       linen      Flax's lm1b example: decoder-only transformer LM
linen_resnet   linen      ResNet (He et al.) with BatchNorm, as in Flax's ImageNet example
nnx_decoder    nnx        Gemma/Llama: RMSNorm, GQA, rotary embeddings, GeGLU
nnx_bn_mlp     nnx        an MLP with ``nnx.BatchNorm`` (running statistics)
eqx_vit        equinox    ViT (Dosovitskiy et al.): patches, class token, MHA
=============  =========  ======================================================

Sizes are small (widths of 32) to keep the suite's compiles short, which grow
with the number of operations: the language models and the ViT have one block
(a padded, masked, tied-head decoder, or an encoder block, is there whole in
one; ``ViT(depth=2)`` builds the two blocks that a test pinning one block's layer
and not the other's needs) and the ResNet two stages (the second projects).

Each entry of `MODELS` is a `RealModel`; `train` runs jitted optax steps on
one fixed batch with any function that has the model's ``loss`` signature.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
import pytest

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")


@dataclasses.dataclass(frozen=True)
class RealModel:
    """A model of the zoo: how to build it, feed it, score it and differentiate it.

    Attributes:
      name: the key in `MODELS`.
      framework: ``"linen"``, ``"nnx"`` or ``"equinox"``.
      init: ``init(key) -> state``: linen, the variables dict (``{"params": ...}``
        and maybe ``"batch_stats"``); nnx and equinox, the module.
      batch: ``batch(key) -> dict`` of arrays, padding and labels included;
        deterministic given the key.
      loss: the float32 loss, returning ``(scalar, aux_dict)``: linen
        ``loss(params, rest, batch, key, train)`` (``rest``: the non-``"params"``
        collections, maybe ``{}``); nnx ``loss(model, batch, train)``; equinox
        ``loss(model, batch, key, train)``. ``train`` is a Python bool.
      value_and_grad: ``value_and_grad(loss_fn) -> g`` with ``loss``'s
        signature, returning ``((loss, aux), grads)`` by the framework's idiom.
    """

    name: str
    framework: str
    init: Callable[..., Any]
    batch: Callable[..., dict]
    loss: Callable[..., Any]
    value_and_grad: Callable[[Callable[..., Any]], Callable[..., Any]]


# --------------------------------------------------------------------------- data

VOCAB, SEQ, LM_BATCH = 64, 16, 4


@jax.jit
def lm_batch(key: jax.Array) -> dict:
    """Token sequences of lengths ``[16, 9..15, 1..8, 0]`` padded with token 0.

    Each row counts up from a random start by a random stride (mod the
    vocabulary, skipping 0), so the next token is learnable; the last row is
    entirely padding.
    """
    k_start, k_stride, k_len = jax.random.split(key, 3)
    start = jax.random.randint(k_start, (LM_BATCH, 1), 0, VOCAB - 1)
    stride = jax.random.randint(k_stride, (LM_BATCH, 1), 1, 4)
    tokens = 1 + (start + stride * jnp.arange(SEQ)) % (VOCAB - 1)
    mid = jax.random.randint(k_len, (2,), jnp.array([SEQ // 2 + 1, 1]), jnp.array([SEQ, SEQ // 2 + 1]))
    lengths = jnp.concatenate([jnp.array([SEQ]), mid, jnp.array([0])])
    tokens = jnp.where(jnp.arange(SEQ) < lengths[:, None], tokens, 0)
    return {"tokens": tokens.astype(jnp.int32)}


@functools.partial(jax.jit, static_argnums=1)
def image_batch(key: jax.Array, n: int = 8) -> dict:
    """``n`` random 16x16x3 images with labels in ``[0, 10)``."""
    k_x, k_y = jax.random.split(key)
    return {"images": jax.random.normal(k_x, (n, 16, 16, 3)),
            "labels": jax.random.randint(k_y, (n,), 0, 10)}


def shift_right(tokens: jax.Array) -> jax.Array:
    """The decoder's input: the targets delayed by one, with 0 as BOS (as in lm1b)."""
    return jnp.pad(tokens, ((0, 0), (1, 0)))[:, :-1]


def padded_cross_entropy(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, dict]:
    """Cross-entropy weighted by ``targets != 0``, over max(number of tokens, 1)."""
    weights = (targets != 0).astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    n_tokens = jnp.sum(weights)
    return jnp.sum(losses * weights) / jnp.maximum(n_tokens, 1.0), {"n_tokens": n_tokens}


def classification_loss(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, dict]:
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}


# ------------------------------------------------------------------ linen_lm


class LinenBlock(nn.Module):
    """A pre-LayerNorm transformer decoder block (lm1b's ``EncoderDecoder1DBlock``)."""

    num_heads: int
    mlp_dim: int
    dropout_rate: float

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array, train: bool) -> jax.Array:
        y = nn.LayerNorm()(x)
        y = nn.MultiHeadDotProductAttention(num_heads=self.num_heads, dropout_rate=self.dropout_rate,
                                            deterministic=not train)(y, y, mask=mask)
        x = x + nn.Dropout(self.dropout_rate)(y, deterministic=not train)
        y = nn.LayerNorm()(x)
        y = nn.gelu(nn.Dense(self.mlp_dim)(y))
        y = nn.Dropout(self.dropout_rate)(y, deterministic=not train)
        y = nn.Dense(x.shape[-1])(y)
        return x + nn.Dropout(self.dropout_rate)(y, deterministic=not train)


class LinenLM(nn.Module):
    """Decoder-only transformer LM after Flax's lm1b example.

    Exercises: ``nn.Embed`` with the output head tied through ``embed.attend``,
    learned positions, a causal mask combined with a padding mask (token 0),
    ``nn.MultiHeadDotProductAttention``, ``nn.gelu``, ``nn.Dropout`` driven by a
    ``train`` argument of ``apply`` and the ``"dropout"`` rng, ``nn.LayerNorm``.
    """

    vocab_size: int = VOCAB
    width: int = 32
    num_layers: int = 1
    num_heads: int = 4
    mlp_dim: int = 64
    max_len: int = SEQ
    dropout_rate: float = 0.1

    @nn.compact
    def __call__(self, targets: jax.Array, train: bool) -> jax.Array:
        mask = nn.combine_masks(nn.make_attention_mask(targets > 0, targets > 0),
                                nn.make_causal_mask(targets))
        embed = nn.Embed(self.vocab_size, self.width,
                         embedding_init=nn.initializers.normal(stddev=1.0))
        x = embed(shift_right(targets))
        pos = self.param("pos_embedding", nn.initializers.normal(stddev=0.02),
                         (1, self.max_len, self.width))
        x = x + pos[:, : x.shape[1]]
        x = nn.Dropout(self.dropout_rate)(x, deterministic=not train)
        for _ in range(self.num_layers):
            x = LinenBlock(self.num_heads, self.mlp_dim, self.dropout_rate)(x, mask, train)
        x = nn.LayerNorm()(x)
        return embed.attend(x) / jnp.sqrt(x.shape[-1])


LINEN_LM = LinenLM()


@jax.jit  # one compilation instead of an eager dispatch per initializer
def linen_lm_init(key: jax.Array) -> dict:
    return LINEN_LM.init(key, jnp.ones((LM_BATCH, SEQ), jnp.int32), train=False)


def linen_lm_loss(params, rest, batch, key, train):
    """Cross-entropy over the non-padding tokens; ``aux`` holds the token count."""
    logits = LINEN_LM.apply({"params": params, **rest}, batch["tokens"], train=train,
                            rngs={"dropout": key})
    return padded_cross_entropy(logits, batch["tokens"])


# -------------------------------------------------------------- linen_resnet


class ResNetBlock(nn.Module):
    """A basic residual block: two 3x3 convs with BatchNorm; 1x1 projection if shapes change."""

    features: int
    strides: int = 1

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
        y = nn.Conv(self.features, (3, 3), self.strides, use_bias=False)(x)
        y = nn.relu(norm()(y))
        y = nn.Conv(self.features, (3, 3), use_bias=False)(y)
        y = norm(scale_init=nn.initializers.zeros)(y)
        if x.shape != y.shape:
            x = nn.Conv(self.features, (1, 1), self.strides, use_bias=False, name="proj")(x)
            x = norm(name="proj_bn")(x)
        return nn.relu(x + y)


class LinenResNet(nn.Module):
    """A small ResNet after He et al. (2016) and Flax's ImageNet example.

    Exercises: ``nn.Conv``, ``nn.BatchNorm(use_running_average=not train)``
    whose ``batch_stats`` collection is updated through ``mutable``, a
    projection shortcut where the shape changes, global average pooling,
    ``nn.Dense``.
    """

    stage_features: tuple[int, ...] = (16, 32)
    num_classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = nn.Conv(self.stage_features[0], (3, 3), use_bias=False, name="stem")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
        for i, features in enumerate(self.stage_features):
            x = ResNetBlock(features, strides=1 if i == 0 else 2)(x, train)
        return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))


LINEN_RESNET = LinenResNet()


@jax.jit
def linen_resnet_init(key: jax.Array) -> dict:
    return LINEN_RESNET.init(key, jnp.ones((8, 16, 16, 3)), train=False)


def linen_resnet_loss(params, rest, batch, key, train):
    """Cross-entropy; ``aux["batch_stats"]``: the statistics after this call.

    BatchNorm updates them in train mode and leaves them as they are in eval
    mode (they come back unchanged). ``key`` is unused: the model has no dropout.
    """
    del key
    logits, updates = LINEN_RESNET.apply({"params": params, **rest}, batch["images"], train=train,
                                         mutable=["batch_stats"])
    loss, aux = classification_loss(logits, batch["labels"])
    return loss, {**aux, "batch_stats": updates["batch_stats"]}


def linen_value_and_grad(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
    """Gradients with respect to ``params``, the first argument."""
    return jax.value_and_grad(loss_fn, has_aux=True)


# --------------------------------------------------------------- nnx_decoder


def apply_rope(x: jax.Array, positions: jax.Array, max_wavelength: float = 10_000.0) -> jax.Array:
    """Rotary position embedding (Su et al.) of ``x[batch, seq, heads, head_dim]``."""
    half = x.shape[-1] // 2
    inv_freq = max_wavelength ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[..., None, None] * inv_freq  # [batch, seq, 1, half]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Attention(nnx.Module):
    """Grouped-query self-attention with rotary embeddings, written out by hand."""

    def __init__(self, width: int, num_heads: int, num_kv_heads: int, head_dim: int, *, rngs):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nnx.Linear(width, num_heads * head_dim, use_bias=False, rngs=rngs)
        self.k_proj = nnx.Linear(width, num_kv_heads * head_dim, use_bias=False, rngs=rngs)
        self.v_proj = nnx.Linear(width, num_kv_heads * head_dim, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(num_heads * head_dim, width, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        groups = self.num_heads // self.num_kv_heads
        q = apply_rope(self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim), positions)
        k = apply_rope(self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim), positions)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        q = q.reshape(b, t, self.num_kv_heads, groups, self.head_dim) * self.head_dim ** -0.5
        logits = jnp.einsum("btkgd,bskd->bkgts", q, k)
        logits = jnp.where(mask[:, None, None], logits, jnp.finfo(logits.dtype).min)
        probs = jax.nn.softmax(logits, axis=-1)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, -1)
        return self.o_proj(out)


class GatedMLP(nnx.Module):
    """GeGLU feed-forward (Shazeer 2020), as in Gemma."""

    def __init__(self, width: int, hidden: int, *, rngs):
        self.gate_proj = nnx.Linear(width, hidden, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(width, hidden, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(hidden, width, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(nnx.gelu(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nnx.Module):
    def __init__(self, width, num_heads, num_kv_heads, head_dim, hidden, dropout_rate, *, rngs):
        self.pre_attn_norm = nnx.RMSNorm(width, rngs=rngs)
        self.attn = Attention(width, num_heads, num_kv_heads, head_dim, rngs=rngs)
        self.pre_mlp_norm = nnx.RMSNorm(width, rngs=rngs)
        self.mlp = GatedMLP(width, hidden, rngs=rngs)
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

    def __call__(self, x, positions, mask, train: bool):
        y = self.attn(self.pre_attn_norm(x), positions, mask)
        x = x + self.dropout(y, deterministic=not train)
        y = self.mlp(self.pre_mlp_norm(x))
        return x + self.dropout(y, deterministic=not train)


class NNXDecoder(nnx.Module):
    """Decoder-only LM after Gemma/Llama, in Flax NNX.

    Exercises: ``nnx.Embed`` with the head tied through ``self.embedder.attend``,
    ``nnx.RMSNorm``, hand-written grouped-query attention (4 query heads, 2
    key/value heads) with ``nnx.Linear`` projections and rotary embeddings, a
    GeGLU MLP, ``nnx.Dropout`` drawing from the module's ``nnx.Rngs``, blocks
    in ``self.blocks`` (paths ``blocks/0/attn/q_proj``), a padding mask.
    """

    def __init__(self, *, rngs, vocab_size=VOCAB, width=32, num_layers=1, num_heads=4,
                 num_kv_heads=2, head_dim=8, hidden=64, dropout_rate=0.1):
        self.embedder = nnx.Embed(vocab_size, width, rngs=rngs)
        self.blocks = nnx.List([
            DecoderBlock(width, num_heads, num_kv_heads, head_dim, hidden, dropout_rate, rngs=rngs)
            for _ in range(num_layers)])
        self.final_norm = nnx.RMSNorm(width, rngs=rngs)

    def __call__(self, targets: jax.Array, train: bool) -> jax.Array:
        valid = targets > 0
        causal = jnp.tril(jnp.ones((targets.shape[1],) * 2, bool))
        mask = valid[:, :, None] & valid[:, None, :] & causal  # [batch, query, key]
        positions = jnp.broadcast_to(jnp.arange(targets.shape[1]), targets.shape)
        x = self.embedder(shift_right(targets))
        x = x * jnp.sqrt(x.shape[-1]).astype(x.dtype)
        for block in self.blocks:
            x = block(x, positions, mask, train)
        return self.embedder.attend(self.final_norm(x))


def nnx_decoder_init(key: jax.Array) -> NNXDecoder:
    k_params, k_dropout = jax.random.split(key)
    return NNXDecoder(rngs=nnx.Rngs(params=k_params, dropout=k_dropout))


def nnx_decoder_loss(model, batch, train):
    return padded_cross_entropy(model(batch["tokens"], train), batch["tokens"])


# ---------------------------------------------------------------- nnx_bn_mlp


class BNMLP(nnx.Module):
    """An MLP classifier with ``nnx.BatchNorm`` and ``nnx.Dropout``.

    Exercises NNX state updates: in train mode BatchNorm normalizes with the
    batch's statistics and updates its ``mean``/``var`` ``nnx.BatchStat``
    variables; in eval mode it uses and keeps them.
    """

    def __init__(self, *, rngs, din=48, hidden=64, num_classes=10, dropout_rate=0.1):
        self.linear1 = nnx.Linear(din, hidden, rngs=rngs)
        self.bn = nnx.BatchNorm(hidden, momentum=0.9, rngs=rngs)
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)
        self.linear2 = nnx.Linear(hidden, num_classes, rngs=rngs)

    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = nnx.relu(self.bn(self.linear1(x), use_running_average=not train))
        return self.linear2(self.dropout(x, deterministic=not train))


def nnx_bn_mlp_init(key: jax.Array) -> BNMLP:
    k_params, k_dropout = jax.random.split(key)
    return BNMLP(rngs=nnx.Rngs(params=k_params, dropout=k_dropout))


@jax.jit
def nnx_bn_mlp_batch(key: jax.Array) -> dict:
    """16 random 48-feature vectors (offset and scaled, so the statistics move) with labels."""
    k_x, k_y = jax.random.split(key)
    return {"x": 3.0 * jax.random.normal(k_x, (16, 48)) + 1.0,
            "labels": jax.random.randint(k_y, (16,), 0, 10)}


def nnx_bn_mlp_loss(model, batch, train):
    return classification_loss(model(batch["x"], train), batch["labels"])


def nnx_value_and_grad(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``nnx.value_and_grad``: grads is an ``nnx.State`` of the ``nnx.Param`` variables."""
    return nnx.value_and_grad(loss_fn, has_aux=True)


# -------------------------------------------------------------------- eqx_vit


class ViTBlock(eqx.Module):
    """A pre-LayerNorm ViT encoder block of Equinox layers (one example, ``[seq, width]``)."""

    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, width: int, num_heads: int, hidden: int, dropout_rate: float, *, key):
        k_attn, k_fc1, k_fc2 = jax.random.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(width)
        self.attn = eqx.nn.MultiheadAttention(num_heads, width, key=k_attn)
        self.norm2 = eqx.nn.LayerNorm(width)
        self.fc1 = eqx.nn.Linear(width, hidden, key=k_fc1)
        self.fc2 = eqx.nn.Linear(hidden, width, key=k_fc2)
        self.dropout = eqx.nn.Dropout(dropout_rate)

    def __call__(self, x: jax.Array, *, key: jax.Array, train: bool) -> jax.Array:
        k1, k2, k3 = jax.random.split(key, 3)
        y = jax.vmap(self.norm1)(x)
        x = x + self.dropout(self.attn(y, y, y), key=k1, inference=not train)
        y = jax.nn.gelu(jax.vmap(self.fc1)(jax.vmap(self.norm2)(x)))
        y = jax.vmap(self.fc2)(self.dropout(y, key=k2, inference=not train))
        return x + self.dropout(y, key=k3, inference=not train)


class ViT(eqx.Module):
    """Vision Transformer after Dosovitskiy et al. (2021), in Equinox; one image ``[H, W, C]``.

    Exercises: patches cut by reshape and embedded by ``eqx.nn.Linear``, a
    learned position embedding and class token (array fields),
    ``eqx.nn.LayerNorm``, ``eqx.nn.MultiheadAttention``, a ``jax.nn.gelu``
    MLP, ``eqx.nn.Dropout`` with keys threaded by hand, a ``head`` classifier,
    and plain ``int`` fields (``patch_size``, ``width``) that are *not* static
    yet are used as shapes in ``__call__``: ``eqx.filter_jit`` and
    ``eqx.filter_grad`` must leave them Python ints.
    """

    patch_size: int
    width: int
    patch_embed: eqx.nn.Linear
    cls_token: jax.Array
    pos_embed: jax.Array
    blocks: list[ViTBlock]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, *, key, image_size=16, channels=3, patch_size=4, width=32, depth=1,
                 num_heads=4, hidden=64, num_classes=10, dropout_rate=0.1):
        k_patch, k_cls, k_pos, k_head, *k_blocks = jax.random.split(key, 4 + depth)
        num_patches = (image_size // patch_size) ** 2
        self.patch_size, self.width = patch_size, width
        self.patch_embed = eqx.nn.Linear(patch_size * patch_size * channels, width, key=k_patch)
        self.cls_token = 0.02 * jax.random.normal(k_cls, (width,))
        self.pos_embed = 0.02 * jax.random.normal(k_pos, (num_patches + 1, width))
        self.blocks = [ViTBlock(width, num_heads, hidden, dropout_rate, key=k) for k in k_blocks]
        self.norm = eqx.nn.LayerNorm(width)
        self.head = eqx.nn.Linear(width, num_classes, key=k_head)

    def __call__(self, image: jax.Array, *, key: jax.Array, train: bool) -> jax.Array:
        h, w, c = image.shape
        p = self.patch_size
        patches = image.reshape(h // p, p, w // p, p, c).transpose(0, 2, 1, 3, 4)
        x = jax.vmap(self.patch_embed)(patches.reshape(-1, p * p * c))
        x = jnp.concatenate([self.cls_token.reshape(1, self.width), x]) + self.pos_embed
        for block, k in zip(self.blocks, jax.random.split(key, len(self.blocks))):
            x = block(x, key=k, train=train)
        return self.head(self.norm(x[0]))


@eqx.filter_jit  # one compilation instead of an eager dispatch per initializer
def eqx_vit_init(key: jax.Array) -> ViT:
    return ViT(key=key)


def eqx_vit_loss(model, batch, key, train):
    """Cross-entropy of the model ``jax.vmap``-ed over the batch, one dropout key per example."""
    keys = jax.random.split(key, batch["images"].shape[0])
    logits = jax.vmap(functools.partial(model, train=train))(batch["images"], key=keys)
    return classification_loss(logits, batch["labels"])


def eqx_value_and_grad(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``eqx.filter_value_and_grad``: gradients of the model's float arrays."""
    return eqx.filter_value_and_grad(loss_fn, has_aux=True)


# --------------------------------------------------------------------- registry

MODELS: dict[str, RealModel] = {m.name: m for m in [
    RealModel("linen_lm", "linen", linen_lm_init, lm_batch, linen_lm_loss, linen_value_and_grad),
    RealModel("linen_resnet", "linen", linen_resnet_init, image_batch, linen_resnet_loss,
              linen_value_and_grad),
    RealModel("nnx_decoder", "nnx", nnx_decoder_init, lm_batch, nnx_decoder_loss, nnx_value_and_grad),
    RealModel("nnx_bn_mlp", "nnx", nnx_bn_mlp_init, nnx_bn_mlp_batch, nnx_bn_mlp_loss,
              nnx_value_and_grad),
    RealModel("eqx_vit", "equinox", eqx_vit_init, image_batch, eqx_vit_loss, eqx_value_and_grad),
]}


# --------------------------------------------------------------------- training


def train_linen(model: RealModel, loss_fn, steps: int, tx: optax.GradientTransformation,
                seed: int = 0) -> tuple[list[float], dict]:
    """``steps`` jitted optax steps; threads ``aux["batch_stats"]`` and a fresh dropout key per step."""
    key_init, key_batch, key_dropout = jax.random.split(jax.random.key(seed), 3)
    variables, batch = model.init(key_init), model.batch(key_batch)
    params, rest = variables["params"], {k: v for k, v in variables.items() if k != "params"}
    grad_fn = model.value_and_grad(loss_fn)

    @jax.jit
    def step(params, rest, opt_state, batch, key):
        (loss, aux), grads = grad_fn(params, rest, batch, key, True)
        updates, opt_state = tx.update(grads, opt_state, params)
        rest = {k: aux.get(k, v) for k, v in rest.items()}
        return optax.apply_updates(params, updates), rest, opt_state, loss

    opt_state, losses = jax.jit(tx.init)(params), []  # eagerly, a program per leaf shape
    for i in range(steps):
        key = jax.random.fold_in(key_dropout, i)
        params, rest, opt_state, loss = step(params, rest, opt_state, batch, key)
        losses.append(float(loss))
    return losses, {"params": params, **rest}


def train_nnx(model: RealModel, loss_fn, steps: int, tx: optax.GradientTransformation,
              seed: int = 0) -> tuple[list[float], Any]:
    """``steps`` ``nnx.jit`` steps with ``nnx.Optimizer``; dropout draws from the module's Rngs."""
    key_init, key_batch = jax.random.split(jax.random.key(seed))
    module, batch = model.init(key_init), model.batch(key_batch)
    optimizer = nnx.Optimizer(module, tx, wrt=nnx.Param)
    grad_fn = model.value_and_grad(loss_fn)

    @nnx.jit
    def step(module, optimizer, batch):
        (loss, _), grads = grad_fn(module, batch, True)
        optimizer.update(module, grads)
        return loss

    losses = [float(step(module, optimizer, batch)) for _ in range(steps)]
    return losses, module


def train_eqx(model: RealModel, loss_fn, steps: int, tx: optax.GradientTransformation,
              seed: int = 0) -> tuple[list[float], Any]:
    """``steps`` ``eqx.filter_jit`` optax steps on the module's float arrays; a dropout key per step."""
    key_init, key_batch, key_dropout = jax.random.split(jax.random.key(seed), 3)
    module, batch = model.init(key_init), model.batch(key_batch)
    grad_fn = model.value_and_grad(loss_fn)

    @eqx.filter_jit
    def step(module, opt_state, batch, key):
        (loss, _), grads = grad_fn(module, batch, key, True)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(module, eqx.is_inexact_array))
        return eqx.apply_updates(module, updates), opt_state, loss

    opt_state, losses = jax.jit(tx.init)(eqx.filter(module, eqx.is_inexact_array)), []
    for i in range(steps):
        module, opt_state, loss = step(module, opt_state, batch, jax.random.fold_in(key_dropout, i))
        losses.append(float(loss))
    return losses, module


_TRAINERS = {"linen": train_linen, "nnx": train_nnx, "equinox": train_eqx}


def train_with_state(model: RealModel, loss_fn=None, steps: int = 30,
                     tx: optax.GradientTransformation | None = None,
                     seed: int = 0) -> tuple[list[float], Any]:
    """Trains ``model`` on its fixed batch ``model.batch(seed's key)`` with ``train=True``.

    ``loss_fn`` (default ``model.loss``) has ``model.loss``'s signature; ``tx``
    defaults to ``optax.adam(3e-3)``, with which every model's loss falls below
    0.45x its first value in 30 steps (1e-3 is too slow for that). Returns
    the losses of each step (before its update) and the final state: linen, the
    variables dict; nnx and equinox, the module.
    """
    tx = optax.adam(3e-3) if tx is None else tx
    return _TRAINERS[model.framework](model, model.loss if loss_fn is None else loss_fn, steps, tx, seed)


def train(model: RealModel, loss_fn=None, steps: int = 30,
          tx: optax.GradientTransformation | None = None, seed: int = 0) -> list[float]:
    """The losses of `train_with_state`."""
    return train_with_state(model, loss_fn, steps, tx, seed)[0]
