"""What is static about a pipeline: a model, a method and one micro-batch's shapes, traced once.

:class:`PipelineSpec` checks them against each other and traces every stage abstractly when it is
made, so that a stage that does not fit the next one, S = 0 or an empty micro-batch is an error
before anything runs. The initial state (``pipejax.core.initial``) and the tick
(``pipejax.core.engine``) both read it; it computes nothing itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.extend.core

from pipejax.core import accounting, checks
from pipejax.core.stages import Model, ModelTrace, softmax_cross_entropy
from pipejax.core.state import Batch
from pipejax.methods import Method

PyTree = Any


@dataclasses.dataclass(frozen=True, eq=False)
class PipelineSpec:
  """A model, a method and the shape of one micro-batch.

  Args:
    model: the stages and the loss.
    method: weight views and per-stage update rule (``pipejax.methods``).
    example_inputs: one micro-batch of inputs, shape ``(b, ...)`` (arrays or ShapeDtypeStructs).
    example_labels: the matching labels, shape ``(b, ...)``.
    track_weight_discrepancy: also report, per stage and tick, the relative distance
      ``|w_fwd - w_bwd| / |w_bwd|`` between the weights the forward of the sample being
      backwarded used and the weights its backward uses: staleness made visible. It keeps a copy
      of the forward's weights beside each stashed input (as PipeDream's stash does), so it costs
      memory and time; the training numbers are unchanged.
  """

  model: Model
  method: Method
  example_inputs: PyTree
  example_labels: PyTree
  track_weight_discrepancy: bool = False
  trace: ModelTrace = dataclasses.field(init=False, repr=False)
  """Every stage traced once (:meth:`pipejax.Model.trace`): shapes, forwards, initializations."""

  def __post_init__(self):
    checks.check_model_and_method(self.model, self.method)
    inputs, labels = checks.micro_batch_specs(self.example_inputs, self.example_labels)
    object.__setattr__(self, "example_inputs", inputs)
    object.__setattr__(self, "example_labels", labels)
    traced = self.model.trace(jax.random.PRNGKey(0), inputs)
    checks.check_floating_params(self.model, traced.params)
    object.__setattr__(self, "trace", traced)
    checks.check_loss(self.model.loss, self.last_stage_output(), labels)

  @property
  def num_stages(self) -> int:
    return self.model.num_stages

  @property
  def micro_batch_size(self) -> int:
    return jax.tree.leaves(self.example_inputs)[0].shape[0]

  @property
  def delays(self) -> list[int]:
    return accounting.stage_delays(self.num_stages)

  @property
  def stage_input_shapes(self) -> list[PyTree]:
    """ShapeDtypeStructs of each stage's input micro-batch."""
    return list(self.trace.inputs)

  @property
  def stage_param_shapes(self) -> list[PyTree]:
    """ShapeDtypeStructs of each stage's parameters."""
    return list(self.trace.params)

  def forward_program(self, s: int) -> jax.extend.core.ClosedJaxpr:
    """Stage ``s``'s forward as a closed jaxpr of its parameters, input, key and variables."""
    return self.trace.forwards[s]

  @property
  def stashes_weights(self) -> bool:
    """Whether delay lines keep the forward's weights beside each input."""
    return self.method.stash_forward_weights or self.track_weight_discrepancy

  def stash_bytes(self) -> int:
    """Bytes of stashed activations by the formula sum_s (D_s + 1) |x_s|."""
    return accounting.stash_bytes(self.trace.inputs)

  def last_stage_output(self):
    """The last stage's output shape (abstractly, with its variables if it has any)."""
    last = self.model.stages[-1]
    key, x = jax.random.PRNGKey(0), self.trace.inputs[-1]
    out, _ = jax.eval_shape(last.forward, self.trace.params[-1], x, key,
                            jax.eval_shape(last.variables, key, x))
    return out

  @property
  def num_classes(self) -> int | None:
    """The logits' width when the loss is the built-in classification loss, else None."""
    if self.model.loss is not softmax_cross_entropy:
      return None  # a custom loss defines what its labels are
    return int(self.last_stage_output().shape[-1])

  def checked_batch(self, inputs, labels, valid, ticks) -> Batch:
    """Validates a micro-batch (``ticks=None``) or a stream of them; returns a :class:`Batch`."""
    valid = checks.checked_stream(
        inputs, labels, valid, example_inputs=self.example_inputs,
        example_labels=self.example_labels, micro_batches=self.method.micro_batches_per_flush,
        ticks=bool(ticks))
    self.check_labels(labels, valid)
    return Batch(inputs, labels, valid)

  def check_labels(self, labels, valid) -> None:
    """Refuses class labels outside ``[0, classes)``
    (:func:`pipejax.core.checks.check_class_labels`)."""
    checks.check_class_labels(labels, valid, self.num_classes)
