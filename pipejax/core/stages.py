"""The model: a chain of :class:`~pipejax.core.stage.Stage` s and the loss its last output meets.

A stage is a pure (init, apply) pair (``pipejax.core.stage``); flax modules become stages with
:func:`~pipejax.core.flax_bridge.from_flax`; :meth:`Model.trace` traces every stage once
(``pipejax.core.model_trace``). The names a model's user needs from ``pipejax.core.stage`` can be
imported from here too.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import optax

from pipejax.core.model_trace import ModelTrace as ModelTrace, trace_stages
from pipejax.core.stage import BACKWARD_COLLECTION as BACKWARD_COLLECTION
from pipejax.core.stage import DONATED_MESSAGE as DONATED_MESSAGE
from pipejax.core.stage import LossFn as LossFn
from pipejax.core.stage import ModelError as ModelError
from pipejax.core.stage import Stage as Stage
from pipejax.core.stage import Variables as Variables
from pipejax.core.stage import donated as donated
from pipejax.core.stage import softmax_cross_entropy as softmax_cross_entropy

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Model:
  """A sequence of stages whose last output goes into ``loss(outputs, labels)``.

  ``loss`` returns ``(scalar_loss, metrics_dict)``; metrics are scalars averaged over the
  micro-batch.

  One :class:`Stage` object at consecutive places, ``[stem] + [block] * n + [head]``, *declares*
  a run of repeated stages: one module whose weights each stage draws from its own key (a layer
  axis, as scanned layers have). The model traces it once, not once per stage, and a stacking
  runner (``Pipeline(..., stack=True)``, ``pipejax.core.stackable``) takes the run as one stacked
  part without comparing its stages' programs, so building a deep pipeline costs about what a
  shallow one does.
  """

  stages: tuple[Stage, ...]
  loss: LossFn = softmax_cross_entropy

  def __post_init__(self):
    if isinstance(self.stages, Stage):
      raise ModelError("Model takes a list of stages, e.g. Model([stage]) for a single one; got "
                       "one Stage.")
    object.__setattr__(self, "stages", tuple(self.stages))
    if not self.stages:
      raise ModelError("A model needs at least one stage (got S = 0). Pass a non-empty list of "
                       "stages, e.g. Model([from_flax(nn.Dense(10))]).")
    for i, stage in enumerate(self.stages):
      if not isinstance(stage, Stage):
        raise ModelError(f"Stage {i} is a {type(stage).__name__}, not a pipejax Stage; wrap flax "
                         "modules with pipejax.from_flax(module).")
    # Model.trace's results by the abstract signature of its arguments (see there).
    object.__setattr__(self, "_traces", {})

  @property
  def num_stages(self) -> int:
    return len(self.stages)

  def stage_label(self, s: int) -> str:
    return f"stage {s} ('{self.stages[s].name}')"

  def repeats(self, s: int) -> bool:
    """Whether stage ``s`` is the same :class:`Stage` object as stage ``s - 1``: the two belong to
    a declared run of repeated stages (class docstring)."""
    return s > 0 and self.stages[s] is self.stages[s - 1]

  def apply(self, params: Sequence[PyTree], x: PyTree, rng: jax.Array | None = None,
            variables: Sequence[Variables | None] | None = None) -> PyTree:
    """The whole network as one function, unpipelined: every stage in order on ``x``.

    Args:
      params: one params tree per stage.
      x: a batch of inputs.
      rng: None for no randomness; else stage ``s`` draws from ``jax.random.fold_in(rng, s)``.
      variables: one :class:`Variables` (or None, for a stateless stage) per stage: given, the
        stages evaluate (:meth:`Stage.infer`: the variables read-only,
        :func:`~pipejax.core.flax_bridge.from_flax`'s ``eval_kwargs``, no randomness); without
        them they run their training ``apply``.

    Returns:
      The last stage's output (what ``loss`` takes).

    Raises:
      ModelError: ``params`` or ``variables`` is not one entry per stage, ``rng`` is given
        together with variables, or an array of them was donated to a runner's ``run()``.
    """
    if donated((params, variables)):
      raise ModelError(DONATED_MESSAGE)
    if len(params) != self.num_stages:
      raise ModelError(f"Model.apply takes one params tree per stage: {len(params)} for "
                       f"{self.num_stages} stages.")
    if variables is not None and len(variables) != self.num_stages:
      raise ModelError(f"Model.apply takes one Variables (or None) per stage: {len(variables)} "
                       f"for {self.num_stages} stages.")
    if rng is not None and any(v is not None for v in variables or ()):
      raise ModelError("Model.apply evaluates stages with variables read-only, without "
                       "randomness; pass rng=None with variables.")
    evaluate = variables is not None and rng is None
    for s, (stage, p, v) in enumerate(zip(self.stages, params, variables or [None] * len(params))):
      if evaluate:
        x = stage.infer(p, x, v)
      else:
        x = stage.apply(p, x, None if rng is None else jax.random.fold_in(rng, s))
    return x

  def trace_shapes(self, rng: jax.Array, x: PyTree) -> tuple[list[PyTree], list[PyTree]]:
    """Abstractly runs init and apply of every stage on a micro-batch ``x``.

    Returns (params shapes, input shapes) per stage, as ``jax.ShapeDtypeStruct`` trees, without
    any computation. A stage that cannot take its predecessor's output is a :class:`ModelError`
    naming both stages and both shapes.
    """
    traced = self.trace(rng, x)
    return list(traced.params), list(traced.inputs)

  def trace(self, rng: jax.Array, x: PyTree) -> ModelTrace:
    """:meth:`trace_shapes`, with each stage's ``initial`` and ``forward`` as programs.

    A deep pipeline is built from these: ``pipejax.core.stackable`` compares the forwards to
    find identical stages, and the engine initializes each stage by running its ``initial``
    program, so that building traces each stage's initialization and forward once.

    The result depends on the shapes and dtypes of ``rng`` and ``x`` alone (the programs take the
    key and the input as arguments), so a model traces once per such signature, for every
    pipeline and check built on it: the pipelines of several methods over one model share it.
    """
    leaves, structure = jax.tree.flatten((rng, x))
    signature = (structure, tuple((jnp.shape(a), jnp.result_type(a)) for a in leaves))
    if signature not in self._traces:
      self._traces[signature] = trace_stages(self.stages, rng, x, self.stage_label)
    return self._traces[signature]


def plain_step(model: Model, tx):
  """One optax step of the whole network, unpipelined (:meth:`Model.apply`), for ``lax.scan``:
  ``(params, opt_state), (x, y) -> ((params, opt_state), loss)``, ``tx`` an optax
  transformation. The baseline the pipeline is measured against."""
  def loss_fn(params, x, y):
    return model.loss(model.apply(params, x), y)[0]

  def step(carry, batch):
    params, opt_state = carry
    loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  return step
