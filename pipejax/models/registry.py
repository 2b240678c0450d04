"""Build models by name, and describe a model's stages."""

from __future__ import annotations

import difflib
import functools
import inspect
import math
from typing import Any, Callable

import jax

from pipejax.models import cnn, perceptron, residual, resnet, transformer
from pipejax.core.stages import Model, ModelError

PyTree = Any

_BUILDERS: dict[str, Callable[..., Model]] = {
    "mlp": perceptron.mlp,
    "residual_mlp": residual.residual_mlp,
    "small_cnn": cnn.small_cnn,
    "vgg": cnn.vgg,
    **{f"cifar_resnet{depth}": functools.partial(resnet.cifar_resnet, depth=depth)
       for depth in (20, 32, 44, 56, 110)},
    "resnet50": resnet.resnet50,
    "transformer_lm": transformer.transformer_lm,
}


def names() -> list[str]:
  """The names :func:`build` knows."""
  return list(_BUILDERS)


def build(name: str, **kwargs) -> Model:
  """Builds the model called ``name`` with the builder's keyword arguments.

  Names: 'mlp', 'residual_mlp', 'small_cnn', 'vgg', 'cifar_resnet20' (32, 44, 56, 110),
  'resnet50' and 'transformer_lm'.

  Example:
    >>> model = build('cifar_resnet20', layers_per_stage=2)
    >>> model.num_stages
    10
  """
  if name not in _BUILDERS:
    raise ModelError(f"Unknown model {name!r}; known models: {', '.join(_BUILDERS)}.")
  accepted = keywords(name)
  unknown = sorted(set(kwargs) - set(accepted))
  if unknown:
    close = {k: difflib.get_close_matches(k, accepted, n=1) for k in unknown}
    hints = "".join(f" Did you mean '{c[0]}' for '{k}'?" for k, c in close.items() if c)
    raise ModelError(f"Model {name!r} takes no keyword(s) {', '.join(map(repr, unknown))}.{hints} "
                     f"Its keywords: {', '.join(accepted)} (set them with "
                     "--config.model_kwargs.KEYWORD=VALUE).")
  return _BUILDERS[name](**kwargs)


def keywords(name: str) -> list[str]:
  """The keyword arguments the builder of model ``name`` takes (all but ``loss``)."""
  parameters = inspect.signature(_BUILDERS[name]).parameters
  return [k for k, p in parameters.items()
          if k not in ("loss",) and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def describe(model: Model, example_input: PyTree,
             rng: jax.Array | None = None) -> list[dict[str, Any]]:
  """One dict per stage: 'stage' (index), 'name', 'params' (count), 'input_shape', 'output_shape'.

  Shapes include the leading micro-batch axis of ``example_input`` and are pytrees of tuples
  where a stage passes ``(h, shortcut)``. Nothing is computed (abstract evaluation only).
  """
  rng = jax.random.key(0) if rng is None else rng
  params, inputs = model.trace_shapes(rng, example_input)
  rows = []
  for s, (stage, stage_params, stage_input) in enumerate(zip(model.stages, params, inputs)):
    output = jax.eval_shape(stage.infer, stage_params, stage_input,
                            jax.eval_shape(stage.variables, rng, stage_input))
    rows.append({
        "stage": s,
        "name": stage.name,
        "params": sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(stage_params)),
        "input_shape": _shapes(stage_input),
        "output_shape": _shapes(output),
    })
  return rows


def _shapes(tree: PyTree) -> PyTree:
  return jax.tree.map(lambda leaf: tuple(leaf.shape), tree)
