"""From a list of named weight layers to a pipelined :class:`pipejax.Model`.

Every builder first lists its weight layers as ``(name, flax module)`` pairs, then groups
``layers_per_stage`` consecutive layers into one stage. A stage's parameters are
``{layer_name: layer_params}``, so the same network at two granularities has the same
parameters, only grouped differently (:func:`merge_stage_params`, :func:`split_layer_params`).
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax

from pipejax.core.flax_bridge import from_flax
from pipejax.core.stages import LossFn, Model, ModelError, Stage, softmax_cross_entropy

PyTree = Any
NamedLayers = Sequence[tuple[str, nn.Module]]


class Chain(nn.Module):
  """Applies named layers in order; parameters are ``{name: that layer's parameters}``.

  Attributes:
    layers: The (unbound) flax modules, applied first to last.
    layer_names: One unique name per layer; the keys of the parameter dict.
  """

  layers: Sequence[nn.Module]
  layer_names: Sequence[str]

  @nn.compact
  def __call__(self, x: PyTree) -> PyTree:
    for name, layer in zip(self.layer_names, self.layers):
      # Cloning under an explicit name keys the parameters by layer name rather than by the
      # position inside this stage, which would change with layers_per_stage.
      x = layer.clone(parent=self, name=name)(x)
    return x


def stack_layers(layers: NamedLayers, layers_per_stage: int | None = 1,
                 loss: LossFn = softmax_cross_entropy) -> Model:
  """Groups consecutive named layers into stages of ``layers_per_stage`` layers each.

  Args:
    layers: ``(name, module)`` pairs in forward order; names must be unique.
    layers_per_stage: Layers per stage (the last stage takes what is left). 1 is the paper's
      fine-grained pipeline: one weight layer per stage; None puts every layer in one stage (no
      pipeline: the engine then trains exactly as plain backprop does).
    loss: The model's loss on the last stage's output.

  Returns:
    A :class:`pipejax.Model`; stage k is named after its layers ('a' or 'a..b').
  """
  if layers_per_stage is None:
    layers_per_stage = max(len(layers), 1)
  if isinstance(layers_per_stage, bool) or not isinstance(layers_per_stage, int) or (
      layers_per_stage < 1):
    raise ModelError(f"layers_per_stage must be a positive int or None, got "
                     f"{layers_per_stage!r}.")
  names = [name for name, _ in layers]
  duplicates = sorted({n for n in names if names.count(n) > 1})
  if duplicates:
    raise ModelError(f"Layer names must be unique; repeated: {duplicates}.")
  stages = [layers_stage(layers[start:start + layers_per_stage])
            for start in range(0, len(layers), layers_per_stage)]
  return Model(stages=tuple(stages), loss=loss)


def layers_stage(group: NamedLayers) -> Stage:
  """One stage of consecutive named layers, named after them ('a' or 'a..b')."""
  group_names = tuple(name for name, _ in group)
  stage_name = group_names[0] if len(group) == 1 else f"{group_names[0]}..{group_names[-1]}"
  chain = Chain(layers=tuple(module for _, module in group), layer_names=group_names)
  return from_flax(chain, name=stage_name)


def merge_stage_params(stage_params: Sequence[dict]) -> dict:
  """Per-stage parameters -> one ``{layer_name: params}`` dict for the whole network."""
  merged = {}
  for params in stage_params:
    merged.update(params)
  return merged


def split_layer_params(model: Model, layer_params: dict, example_input: PyTree) -> list[dict]:
  """``{layer_name: params}`` -> per-stage parameters of ``model`` (any ``layers_per_stage``).

  ``example_input`` is one micro-batch (arrays or ``jax.ShapeDtypeStruct``), used only to find
  each stage's layer names abstractly. Raises :class:`ModelError` if a layer is missing.
  """
  shapes, _ = model.trace_shapes(jax.random.key(0), example_input)
  per_stage = []
  for s, stage_shapes in enumerate(shapes):
    missing = [name for name in stage_shapes if name not in layer_params]
    if missing:
      raise ModelError(f"{model.stage_label(s)} needs parameters for layers {missing}, which "
                       "the given dict does not have.")
    per_stage.append({name: layer_params[name] for name in stage_shapes})
  return per_stage
