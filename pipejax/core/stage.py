"""A stage: the pure (init, apply) pair a pipeline is made of, and its variables.

A stage is ``init(rng, x) -> params`` and ``apply(params, x, rng) -> y`` with pytree ``x`` and
``y``. ``rng`` is derived by the engine from (sample index, stage index), so a stage that draws
randomness (dropout) draws the same numbers in its forward pass and in the backward's recompute.

**Stages with state.** A stage may also keep non-trainable :class:`Variables` (running statistics,
as Online Normalization's), in two parts by who updates them:

* ``forward`` variables are updated by the forward pass. The backward's recompute of a sample sees
  the values its forward saw (the engine stashes them with the input in the delay line), so forward
  and recompute compute the same function, as for weight stashing;
* ``backward`` variables are updated by the backward pass. The stage reads them as an extra input,
  and the cotangent the VJP returns for them is their *increment*: a ``jax.custom_vjp`` writes
  state in its backward by returning ``new - old`` as that input's cotangent. The engine adds it.

Such a stage has ``init_variables(rng, x) -> Variables`` and ``apply(params, x, rng, variables) ->
(y, forward variables after this micro-batch)``; ``infer(params, x, variables)`` evaluates it with
the variables read-only. A stage whose ``init_variables`` is None or returns None is stateless and
costs the engine nothing extra. Flax modules become stages with
:func:`pipejax.core.flax_bridge.from_flax`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

PyTree = Any
LossFn = Callable[[PyTree, PyTree], tuple[jax.Array, dict[str, jax.Array]]]

# The flax collection a stage's backward pass updates (see the module docstring). Every other
# collection besides "params" is updated by the forward pass (pipejax.core.flax_bridge).
BACKWARD_COLLECTION = "backward_state"


class Variables(NamedTuple):
  """A stateful stage's non-trainable variables, split by the pass that updates them."""

  forward: PyTree  # e.g. running mean and variance
  backward: PyTree  # e.g. Online Normalization's gradient control processes


class ModelError(ValueError):
  """A model or its stages do not fit together; the message says how to fix it."""


# A runner's run() donates the state it is given (XLA reuses its buffers for the new state), so
# every array of it is freed, also one a caller kept a reference to.
DONATED_MESSAGE = (
    "An array passed in was donated to an earlier run() call, which freed its buffers: run() "
    "consumes the state it is given, and with it every part of that state kept from before the "
    "call (e.g. params = state.stages[0].params). Use the state that call returned (state, "
    "metrics = pipe.run(state, ...)) and take its parts after the call, or keep a copy "
    "(jax.tree.map(jnp.copy, state)) before running if you need the old one.")


def donated(tree: PyTree) -> bool:
  """Whether an array of ``tree`` was freed by a donation (traced values never are)."""
  return any(isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) and a.is_deleted()
             for a in jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True)
class Stage:
  """One pipeline stage: pure ``init(rng, x) -> params`` and ``apply(params, x, rng) -> y``.

  ``input_shape``, when given, is the per-sample shape (no batch axis) the stage insists on; the
  pipeline checks it when it is built. Without it the stage takes whatever its ``init`` accepts.
  A stage with state (module docstring) also has ``init_variables`` and ``infer``, and its
  ``apply`` takes the variables as a fourth argument. ``init_with_variables``, when given, makes
  both in one call (:meth:`initial`): a flax module's init makes them together, and building a
  deep pipeline traces every stage's initialization, so one trace where two would do matters.
  ``infer_differs`` says that ``infer_with`` computes other than ``apply`` without randomness
  for a stateless stage too (:func:`~pipejax.core.flax_bridge.from_flax`'s ``eval_kwargs``);
  without it such a stage evaluates with ``apply(params, x, None)``.
  """

  init: Callable[[jax.Array, PyTree], PyTree]
  apply: Callable[..., PyTree]
  name: str = "stage"
  input_shape: tuple[int, ...] | None = None
  init_variables: Callable[[jax.Array, PyTree], Variables | None] | None = None
  infer_with: Callable[[PyTree, PyTree, Variables], PyTree] | None = None
  init_with_variables: Callable[[jax.Array, PyTree], tuple[PyTree, Variables | None]] | None = None
  infer_differs: bool = False

  def initial(self, rng: jax.Array, x: PyTree) -> tuple[PyTree, Variables | None]:
    """``(init(rng, x), variables(rng, x))``, from one call where the stage has one."""
    if self.init_with_variables is not None:
      return self.init_with_variables(rng, x)
    return self.init(rng, x), self.variables(rng, x)

  def variables(self, rng: jax.Array, x: PyTree) -> Variables | None:
    """The initial variables for input ``x``; None for a stateless stage."""
    return None if self.init_variables is None else self.init_variables(rng, x)

  def forward(self, params: PyTree, x: PyTree, rng: jax.Array,
              variables: Variables | None) -> tuple[PyTree, PyTree]:
    """``(y, forward variables after x)``; ``(apply(params, x, rng), None)`` when stateless."""
    if variables is None:
      return self.apply(params, x, rng), None
    return self.apply(params, x, rng, variables)

  def infer(self, params: PyTree, x: PyTree, variables: Variables | None = None) -> PyTree:
    """Evaluation: the output with the variables read-only (None for a stateless stage), without
    randomness."""
    if self.infer_with is None or variables is None and not self.infer_differs:
      return self.apply(params, x, None)
    return self.infer_with(params, x, variables)


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array):
  """Mean cross-entropy over the micro-batch, with accuracy as a metric.

  ``labels`` holds one class per row of ``logits`` but the last axis: ``(b,)`` for ``(b, C)``
  logits, ``(b, T)`` for per-token ``(b, T, C)`` ones; both are averaged over every label.
  """
  logits = logits.astype(jnp.float32)
  log_probs = jax.nn.log_softmax(logits)
  nll = -jnp.take_along_axis(log_probs, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
  accuracy = jnp.mean((jnp.argmax(logits, -1) == labels).astype(jnp.float32))
  return jnp.mean(nll), {"accuracy": accuracy}
