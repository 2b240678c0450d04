"""Stages: the pure (init, apply) pairs a pipeline is made of, and the model that chains them.

A stage is ``init(rng, x) -> params`` and ``apply(params, x, rng) -> y`` with pytree ``x`` and
``y``. ``rng`` is derived by the engine from (sample index, stage index), so a stage that draws
randomness (dropout) draws the same numbers in its forward pass and in the backward's recompute.

Flax modules become stages with :func:`from_flax`. We use **linen** rather than nnx: a linen
module's ``init``/``apply`` already *are* the pure pair the engine needs, so a stage is a thin
closure with no split/merge of object state on every tick.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

PyTree = Any
LossFn = Callable[[PyTree, PyTree], tuple[jax.Array, dict[str, jax.Array]]]


class ModelError(ValueError):
  """A model or its stages do not fit together; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class Stage:
  """One pipeline stage: pure ``init(rng, x) -> params`` and ``apply(params, x, rng) -> y``.

  ``input_shape``, when given, is the per-sample shape (no batch axis) the stage insists on; the
  pipeline checks it when it is built. Without it the stage takes whatever its ``init`` accepts.
  """

  init: Callable[[jax.Array, PyTree], PyTree]
  apply: Callable[[PyTree, PyTree, jax.Array], PyTree]
  name: str = "stage"
  input_shape: tuple[int, ...] | None = None


def from_flax(module, *, name: str | None = None, input_shape: Sequence[int] | None = None,
              **apply_kwargs) -> Stage:
  """Makes a :class:`Stage` from a flax linen module (one line per stage).

  ``apply_kwargs`` are passed to every call (e.g. ``train=True``). Modules that keep mutable
  collections such as BatchNorm's ``batch_stats`` are refused: a pipelined stage sees one
  micro-batch at a time and its statistics would differ between forward and recompute.
  """
  stage_name = name or type(module).__name__

  def init(rng, x):
    variables = module.init({"params": rng, "dropout": rng}, x, **apply_kwargs)
    extra = sorted(k for k in variables if k != "params")
    if extra:
      raise ModelError(
          f"Stage '{stage_name}' keeps mutable state {extra} (BatchNorm's batch_stats, most "
          "likely). Pipelined stages must be stateless functions of (weights, input): each stage "
          "sees one micro-batch per tick and recomputes its forward in the backward pass, so "
          "running statistics would differ between the two. Use GroupNorm or LayerNorm instead.")
    return variables.get("params", {})

  def apply(params, x, rng):
    rngs = None if rng is None else {"dropout": rng}
    return module.apply({"params": params}, x, rngs=rngs, **apply_kwargs)

  return Stage(init=init, apply=apply, name=stage_name,
               input_shape=tuple(input_shape) if input_shape is not None else None)


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array):
  """Mean cross-entropy over the micro-batch, with accuracy as a metric."""
  logits = logits.astype(jnp.float32)
  log_probs = jax.nn.log_softmax(logits)
  nll = -jnp.take_along_axis(log_probs, labels[:, None].astype(jnp.int32), axis=-1)[:, 0]
  accuracy = jnp.mean((jnp.argmax(logits, -1) == labels).astype(jnp.float32))
  return jnp.mean(nll), {"accuracy": accuracy}


@dataclasses.dataclass(frozen=True)
class Model:
  """A sequence of stages whose last output goes into ``loss(outputs, labels)``.

  ``loss`` returns ``(scalar_loss, metrics_dict)``; metrics are scalars averaged over the
  micro-batch.
  """

  stages: tuple[Stage, ...]
  loss: LossFn = softmax_cross_entropy

  def __post_init__(self):
    object.__setattr__(self, "stages", tuple(self.stages))
    if not self.stages:
      raise ModelError("A model needs at least one stage (got S = 0). Pass a non-empty list of "
                       "stages, e.g. Model([from_flax(nn.Dense(10))]).")
    for i, stage in enumerate(self.stages):
      if not isinstance(stage, Stage):
        raise ModelError(f"Stage {i} is a {type(stage).__name__}, not a pipejax Stage; wrap flax "
                         "modules with pipejax.from_flax(module).")

  @property
  def num_stages(self) -> int:
    return len(self.stages)

  def stage_label(self, s: int) -> str:
    return f"stage {s} ('{self.stages[s].name}')"

  def trace_shapes(self, rng: jax.Array, x: PyTree) -> tuple[list[PyTree], list[PyTree]]:
    """Abstractly runs init and apply of every stage on a micro-batch ``x``.

    Returns (params shapes, input shapes) per stage, as ``jax.ShapeDtypeStruct`` trees, without
    any computation. A stage that cannot take its predecessor's output is a :class:`ModelError`
    naming both stages and both shapes.
    """
    params_shapes, input_shapes = [], []
    keys = jax.random.split(rng, self.num_stages)
    x = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), x)
    for s, stage in enumerate(self.stages):
      source = "the input batch" if s == 0 else self.stage_label(s - 1)
      if stage.input_shape is not None:
        got = jax.tree.map(lambda a: tuple(a.shape[1:]), x)
        if got != stage.input_shape:
          raise ModelError(
              f"{source} produces per-sample shape {_fmt(x)} but {self.stage_label(s)} expects "
              f"per-sample shape {stage.input_shape}. Change one of the two stages so they agree.")
      try:
        p = jax.eval_shape(stage.init, keys[s], x)
        y = jax.eval_shape(stage.apply, p, x, keys[s])
      except ModelError:
        raise
      except Exception as e:  # flax/XLA shape errors are long; keep the first line.
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(
            f"{source} produces {_fmt(x)}, which {self.stage_label(s)} cannot take: {first_line}. "
            "Change one of the two stages so the output of the first fits the input of the "
            "second.") from None
      params_shapes.append(p)
      input_shapes.append(x)
      x = y
    return params_shapes, input_shapes


def _fmt(tree: PyTree) -> str:
  leaves = jax.tree.leaves(tree)
  if len(leaves) == 1:
    a = leaves[0]
    return f"{tuple(a.shape)} {jnp.dtype(a.dtype).name}"
  return str(jax.tree.map(lambda a: f"{tuple(a.shape)} {jnp.dtype(a.dtype).name}", tree))
