"""A causal pre-norm transformer language model, one block per pipeline stage.

The named layers are the token-plus-position embedding, ``blocks`` identical pre-norm blocks
(causal self-attention, then an MLP, each on a residual branch) and the head (final LayerNorm and
the output projection to the vocabulary). At ``layers_per_stage=1`` the embedding is stage 0, each
block a stage of its own, and the head the last stage: ``blocks + 2`` stages whose middle ones are
structurally identical (the same module with the same parameter shapes).

One micro-batch is ``b`` sequences of ``T`` tokens (b = 1 in the fine-grained setting); the input
is the ``(b, T)`` token ids (as the float32 the data stream hands out, read back as integers), the
output ``(b, T, vocab)`` logits, and the loss the mean next-token cross-entropy over all ``b T``
positions (:func:`pipejax.core.stages.softmax_cross_entropy` with ``(b, T)`` labels). The context
length ``T`` is taken from the input when the model is initialized.
"""

from __future__ import annotations


import flax.linen as nn
import jax
import jax.numpy as jnp

from pipejax.models import sequential
from pipejax.core.stages import LossFn, Model, ModelError, softmax_cross_entropy

_INIT = nn.initializers.normal(stddev=0.02)


class Embedding(nn.Module):
  """Token embedding plus a learned position embedding of the input's length."""

  vocab_size: int
  width: int

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    tokens = tokens.astype(jnp.int32)
    positions = self.param("position", _INIT, (tokens.shape[-1], self.width))
    return nn.Embed(self.vocab_size, self.width, embedding_init=_INIT, name="token")(tokens) + \
        positions


class CausalSelfAttention(nn.Module):
  """Multi-head self-attention where position t attends to positions <= t only."""

  width: int
  heads: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, _ = x.shape
    head_width = self.width // self.heads
    qkv = nn.Dense(3 * self.width, kernel_init=_INIT, name="qkv")(x)
    q, k, v = jnp.split(qkv.reshape(b, t, 3, self.heads, head_width), 3, axis=2)
    q, k, v = (a[:, :, 0] for a in (q, k, v))  # (b, t, heads, head_width)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_width).astype(x.dtype)
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    attended = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    return nn.Dense(self.width, kernel_init=_INIT, name="out")(attended.reshape(b, t, self.width))


class Block(nn.Module):
  """Pre-norm transformer block: ``x + attn(LN(x))``, then ``h + MLP(LN(h))`` (GELU MLP)."""

  width: int
  heads: int
  mlp_ratio: int = 4

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    h = x + CausalSelfAttention(self.width, self.heads, name="attention")(
        nn.LayerNorm(name="norm1")(x))
    y = nn.LayerNorm(name="norm2")(h)
    y = nn.Dense(self.mlp_ratio * self.width, kernel_init=_INIT, name="mlp_in")(y)
    y = nn.Dense(self.width, kernel_init=_INIT, name="mlp_out")(nn.gelu(y))
    return h + y


class Head(nn.Module):
  """Final LayerNorm and the projection to the vocabulary's logits."""

  vocab_size: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return nn.Dense(self.vocab_size, kernel_init=_INIT, name="logits")(
        nn.LayerNorm(name="norm")(x))


def transformer_layers(num_classes: int = 256, width: int = 128, blocks: int = 4,
                       heads: int = 4, mlp_ratio: int = 4) -> list:
  """The named layers of :func:`transformer_lm` (see there), before grouping into stages."""
  if width % heads:
    raise ModelError(f"The transformer's width ({width}) must be a multiple of its number of "
                     f"heads ({heads}); set model_kwargs.width or model_kwargs.heads so.")
  named = [("embed", Embedding(num_classes, width))]
  named += [(f"block{i + 1}", Block(width, heads, mlp_ratio)) for i in range(blocks)]
  named.append(("head", Head(num_classes)))
  return named


def transformer_lm(num_classes: int = 256, width: int = 128, blocks: int = 4, heads: int = 4,
                   mlp_ratio: int = 4, layers_per_stage: int | None = 1,
                   loss: LossFn = softmax_cross_entropy) -> Model:
  """A causal pre-norm transformer LM: embedding, ``blocks`` blocks, head (module docstring).

  Args:
    num_classes: vocabulary size (256 for byte tokens).
    width: the residual stream's width.
    blocks: transformer blocks; ``blocks + 2`` stages at ``layers_per_stage=1``.
    heads: attention heads (``width`` must be a multiple).
    mlp_ratio: the MLP's hidden width over ``width``.
    layers_per_stage: consecutive layers per stage (None: one stage, no pipeline).
    loss: loss on the ``(b, T, vocab)`` logits and ``(b, T)`` labels.

  Returns:
    A :class:`pipejax.Model` of ``ceil((blocks + 2) / layers_per_stage)`` stages.
  """
  return sequential.stack_layers(
      transformer_layers(num_classes, width, blocks, heads, mlp_ratio), layers_per_stage, loss)
