"""Every primitive ordinary model code reaches is classified: no AutocastWarning.

The corpus is what models are written with: ``jax.numpy``, ``jax.nn``,
``jax.lax`` (convolutions, pooling, loops, checkpoints, random numbers),
optax losses, and the layers of Flax linen, Flax NNX and Equinox, forward and
backward. Each is traced under ``autocast`` (``equinox.filter_make_jaxpr``:
no computation) with warnings turned into errors, so a new JAX or Flax
version that emits an unknown primitive fails here, naming it.
"""

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import jmp_policy

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")

X = jax.random.normal(jax.random.key(0), (4, 8))
IMG = jax.random.normal(jax.random.key(1), (2, 8, 8, 3))
LABELS = jnp.arange(4) % 3
KEY = jax.random.key(2)


def numpy_functions(x):
    grid = jnp.linspace(-3, 3, 5)
    return (jnp.mean(x), jnp.var(x, 0), jnp.std(x), jnp.where(x > 0, x, 0.0), jnp.clip(x, -1, 1),
            jnp.sort(x), jnp.argsort(x), jnp.cumsum(x, 1), jnp.cumprod(x, 0),
            jnp.einsum("ij,kj->ik", x, x), jnp.take_along_axis(x, jnp.argsort(x, 1), 1),
            jnp.linalg.norm(x, axis=1), jnp.max(x), jnp.abs(x).sum(), x ** 2, x ** 3,
            jnp.power(jnp.abs(x), 1.5), jnp.sqrt(jnp.abs(x)), jnp.round(x), jnp.tril(x),
            jnp.roll(x, 1), jnp.repeat(x, 2, 0), jnp.median(x), jnp.quantile(x, 0.3),
            jnp.nan_to_num(x), jnp.sign(x), jnp.log(jnp.abs(x) + 1), jnp.exp2(x),
            jnp.arctan2(x, x), jnp.hypot(x, x), jnp.logaddexp(x, x), jnp.mod(x, 2.0),
            jnp.pad(x, 1), jnp.argmax(x, 1), jnp.fft.rfft(x).real, jnp.interp(x, grid, grid),
            jnp.histogram(x, bins=4)[0], jnp.searchsorted(grid, x))


def nn_functions(x):
    q = x[None, :, None, :]
    return (jax.nn.relu(x), jax.nn.gelu(x), jax.nn.gelu(x, approximate=False), jax.nn.silu(x),
            jax.nn.softmax(x), jax.nn.log_softmax(x), jax.nn.sigmoid(x), jax.nn.softplus(x),
            jax.nn.elu(x), jax.nn.leaky_relu(x), jax.nn.standardize(x), jax.nn.logsumexp(x),
            jax.nn.relu6(x), jax.nn.celu(x), jax.nn.selu(x), jax.nn.glu(x), jax.nn.mish(x),
            jax.nn.log_sigmoid(x), jax.nn.one_hot(LABELS, 3),
            jax.nn.dot_product_attention(q, q, q, is_causal=True))


def lax_functions(x):
    from jax.ad_checkpoint import checkpoint_name

    window = (1, 2, 2, 1)
    return (jax.lax.conv_general_dilated(IMG, jnp.ones((3, 3, 3, 4)), (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC")),
            jax.lax.reduce_window(IMG, -jnp.inf, jax.lax.max, window, window, "VALID"),
            jax.lax.reduce_window(IMG, 0.0, jax.lax.add, window, window, "VALID"),
            jax.lax.top_k(x, 2)[0], jax.lax.cumlogsumexp(x, 1), jax.lax.erf(x),
            jax.lax.cummax(x, 1), x.at[0].add(1.0), x.at[jnp.array([0, 1])].set(2.0),
            jax.lax.reduce_precision(x, 5, 10), checkpoint_name(x * 2, "h"),
            jax.lax.ragged_dot(x, jnp.ones((2, 8, 3)), jnp.array([2, 2], jnp.int32)),
            jax.random.normal(KEY, x.shape), jax.random.bernoulli(KEY, 0.5, x.shape),
            jax.random.categorical(KEY, x), jax.random.truncated_normal(KEY, -2.0, 2.0, x.shape),
            jax.lax.scan(lambda c, a: (c + a, c * a), x[0], x)[1],
            jax.lax.fori_loop(0, 3, lambda i, c: c * 0.5, x),
            jax.lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x),
            jax.checkpoint(lambda v: jnp.sin(v) @ v.T)(x))


def optax_losses(x):
    probs = jax.nn.softmax(x)
    return (optax.softmax_cross_entropy_with_integer_labels(x[:, :3], LABELS),
            optax.softmax_cross_entropy(x, probs), optax.safe_softmax_cross_entropy(x, probs),
            optax.sigmoid_binary_cross_entropy(x, (x > 0).astype(jnp.float32)),
            optax.l2_loss(x), optax.huber_loss(x), optax.cosine_similarity(x, x),
            optax.log_cosh(x), optax.kl_divergence(jax.nn.log_softmax(x), probs))


class LinenLayers(nn.Module):
    @nn.compact
    def __call__(self, img, x, train=True):
        h = nn.GroupNorm(2)(nn.BatchNorm(use_running_average=not train)(nn.Conv(4, (3, 3))(img)))
        h = nn.max_pool(nn.avg_pool(h, (2, 2), (2, 2)), (2, 2), (2, 2))
        embed = nn.Embed(10, 8)
        mask = nn.make_causal_mask(jnp.ones((1, 4)))
        y = (nn.LayerNorm()(x) + nn.RMSNorm()(x) + embed(jnp.arange(4))
             + nn.MultiHeadDotProductAttention(2)(x[None], mask=mask)[0]
             + nn.Dropout(0.1, deterministic=not train)(x))
        y = nn.Dense(8)(nn.gelu(y)) + nn.ConvTranspose(8, (2,))(y[None])[0]
        return h.sum() + y.sum() + embed.attend(y).sum() + nn.GRUCell(8)(y, y)[1].sum()


class NnxLayers(nnx.Module):
    def __init__(self, rngs):
        self.conv, self.bn = nnx.Conv(3, 4, (3, 3), rngs=rngs), nnx.BatchNorm(4, rngs=rngs)
        self.gn = nnx.GroupNorm(4, num_groups=2, rngs=rngs)
        self.ln, self.rms = nnx.LayerNorm(8, rngs=rngs), nnx.RMSNorm(8, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(2, 8, decode=False, rngs=rngs)
        self.embed, self.linear = nnx.Embed(10, 8, rngs=rngs), nnx.Linear(8, 8, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.einsum = nnx.Einsum("ab,bc->ac", (8, 8), rngs=rngs)

    def __call__(self, img, x):
        h = self.gn(self.bn(self.conv(img)))
        mask = nnx.make_causal_mask(jnp.ones((1, 4)))
        y = (self.ln(x) + self.rms(x) + self.attention(x[None], mask=mask)[0]
             + self.embed(jnp.arange(4)))
        y = self.dropout(self.linear(nnx.gelu(y))) + self.einsum(y)
        return h.sum() + y.sum() + self.embed.attend(y).sum()


class EqxLayers(eqx.Module):
    linear: eqx.nn.Linear
    conv: eqx.nn.Conv2d
    norms: tuple
    attention: eqx.nn.MultiheadAttention
    embed: eqx.nn.Embedding
    mlp: eqx.nn.MLP
    rope: eqx.nn.RotaryPositionalEmbedding
    gru: eqx.nn.GRUCell

    def __init__(self, key):
        k = jax.random.split(key, 6)
        self.linear, self.conv = eqx.nn.Linear(8, 8, key=k[0]), eqx.nn.Conv2d(3, 4, 3, key=k[1])
        self.norms = (eqx.nn.LayerNorm(8), eqx.nn.RMSNorm(8), eqx.nn.GroupNorm(2, 4))
        self.attention = eqx.nn.MultiheadAttention(2, 8, key=k[2])
        self.embed, self.mlp = eqx.nn.Embedding(10, 8, key=k[3]), eqx.nn.MLP(8, 8, 16, 2, key=k[4])
        self.rope, self.gru = eqx.nn.RotaryPositionalEmbedding(4), eqx.nn.GRUCell(8, 8, key=k[5])

    def __call__(self, img, x, key):
        layer_norm, rms_norm, group_norm = self.norms
        h = group_norm(self.conv(img[0].transpose(2, 0, 1)))
        h = eqx.nn.AvgPool2d(2, 2)(eqx.nn.MaxPool2d(2, 2)(h))
        y = (jax.vmap(layer_norm)(x) + jax.vmap(rms_norm)(x) + self.attention(x, x, x)
             + jax.vmap(self.embed)(jnp.arange(4)))
        y = y + jax.vmap(self.mlp)(y) + eqx.nn.Dropout(0.1)(jax.vmap(self.linear)(y), key=key)
        r = self.rope(y.reshape(4, 2, 4)[:, 0])
        return h.sum() + y.sum() + r.sum() + self.gru(y[0], y[1]).sum()


# The models' parameters as shapes: the tests only trace (built eagerly, each model's
# initializers compiled one by one, ~100 programs).

def _linen_case():
    variables = jax.eval_shape(LinenLayers().init, {"params": KEY, "dropout": KEY}, IMG, X)

    def loss(params, batch_stats, img, x):
        out, _ = LinenLayers().apply({"params": params, "batch_stats": batch_stats}, img, x,
                                     rngs={"dropout": KEY}, mutable=["batch_stats"])
        return out

    return loss, (variables["params"], variables["batch_stats"], IMG, X)


def _nnx_case():
    graphdef, state = nnx.split(nnx.eval_shape(lambda: NnxLayers(nnx.Rngs(0))))
    # A module merged inside the traced function: tracing leaves the state alone.
    return (lambda state, img, x: nnx.merge(graphdef, state)(img, x)), (state, IMG, X)


CASES = {
    "jax.numpy": lambda: (numpy_functions, (X,)),
    "jax.nn": lambda: (nn_functions, (X,)),
    "jax.lax": lambda: (lax_functions, (X,)),
    "optax": lambda: (optax_losses, (X,)),
    "flax.linen": _linen_case,
    "flax.nnx": _nnx_case,
    "equinox": lambda: ((lambda model, img, x: model(img, x, KEY)),
                        (eqx.filter_eval_shape(EqxLayers, KEY), IMG, X)),
}


def _total(out):
    return sum(jnp.sum(o.astype(jnp.float32)) for o in jax.tree.leaves(out)
               if jnp.issubdtype(o.dtype, jnp.floating))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("fp8", [None, "rowwise"])
def test_every_primitive_of_ordinary_model_code_is_classified(case, fp8):
    if fp8 and case == "optax":
        pytest.skip("no matrix products")
    fn, args = CASES[case]()
    recipe = fp8 and jmp_policy.Float8Recipe(fp8, min_size=0)  # the corpus's matrices are small
    f = jmp_policy.autocast(fn, "mixed_float16", fp8=recipe)
    grad = eqx.filter_grad(lambda first, *rest: _total(f(first, *rest)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jmp_policy.AutocastWarning)
        for g in (f, grad):
            eqx.filter_make_jaxpr(g)(*args)
