"""Evaluation: a model's mean loss and accuracy over a whole split, the network run as one function.

The stages run unpipelined (:meth:`pipejax.core.stages.Model.apply`) with their variables read-only,
in batches of a fixed size; the last, partial batch is padded and masked, so that every example
counts once and nothing compiles twice.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pipejax import data as data_lib
from pipejax.core.stages import Model


def make_evaluator(model: Model, batch_size: int) -> Callable[..., dict]:
  """A function (stage params, test source, stage variables) -> {loss, accuracy} over the split."""
  @jax.jit
  def batch_sums(params, variables, x, y, mask):
    logits = model.apply(params, x, variables=variables)
    loss, _ = jax.vmap(lambda out, label: model.loss(out[None], label[None]))(logits, y)
    # One accuracy per example: the fraction of its labels hit (per-token labels of an LM too).
    correct = jnp.mean((jnp.argmax(logits, -1) == y).reshape(y.shape[0], -1), axis=1)
    return jnp.sum(loss * mask), jnp.sum(correct * mask)

  def evaluate(stage_params, test_source, stage_variables=None) -> dict:
    loss_sum, correct_sum, count = 0.0, 0.0, 0
    stage_variables = stage_variables or [None] * len(stage_params)
    for x, y, mask in data_lib.eval_batches(test_source, batch_size):
      loss, correct = batch_sums(stage_params, stage_variables, x, y, mask.astype(np.float32))
      loss_sum += float(loss)
      correct_sum += float(correct)
      count += int(mask.sum())
    return {"loss": loss_sum / count, "accuracy": correct_sum / count}

  return evaluate
