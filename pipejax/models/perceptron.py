"""Multi-layer perceptron, one dense layer (+ normalization + ReLU) per pipeline stage."""

from __future__ import annotations

from typing import Sequence

from pipejax.models import blocks, layers, sequential
from pipejax.core.stages import LossFn, Model, softmax_cross_entropy


def mlp_layers(hidden: Sequence[int] = (256, 128, 100), num_classes: int = 10,
               normalization: str | None = None) -> list:
  """The named weight layers of :func:`mlp` (see there), before grouping into stages."""
  layers.check_normalization(normalization, allowed=(None, "layer", "online"))
  named = [(f"fc{i + 1}", blocks.DenseLayer(width, normalization=normalization))
           for i, width in enumerate(hidden)]
  named.append(("head", blocks.DenseLayer(num_classes, activation=None)))
  return named


def mlp(hidden: Sequence[int] = (256, 128, 100), num_classes: int = 10,
        layers_per_stage: int | None = 1, normalization: str | None = None,
        loss: LossFn = softmax_cross_entropy) -> Model:
  """An MLP on flattened inputs (the first stage flattens all but the micro-batch axis).

  The default widths, 256-128-100, are a Fashion-MNIST-sized MLP (about 88% test accuracy
  class): 4 weight layers, so 4 stages at ``layers_per_stage=1``.

  Args:
    hidden: Widths of the hidden layers (each: dense, optional normalization, ReLU).
    num_classes: Width of the final dense layer (logits, no activation).
    layers_per_stage: Consecutive weight layers per stage (None: one stage, no pipeline).
    normalization: None, 'layer' (LayerNorm) or 'online' (Online Normalization, whose stages
      keep running statistics). 'batch' raises :class:`pipejax.ModelError` (BatchNorm at
      micro-batch size 1 is degenerate).
    loss: Loss on the logits.

  Returns:
    A :class:`pipejax.Model` with ``ceil((len(hidden) + 1) / layers_per_stage)`` stages.
  """
  return sequential.stack_layers(mlp_layers(hidden, num_classes, normalization),
                                 layers_per_stage, loss)
