"""The flax bridge: a flax linen module as a pipeline :class:`~pipejax.core.stage.Stage`.

We use **linen** rather than nnx: a linen module's ``init``/``apply`` already *are* the pure pair
the engine needs, so a stage is a thin closure with no split/merge of object state on every tick.
A module's mutable collections become the stage's :class:`~pipejax.core.stage.Variables`:
:data:`~pipejax.core.stage.BACKWARD_COLLECTION` its backward variables, every other one its
forward variables.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax

from pipejax.core.stage import BACKWARD_COLLECTION, ModelError, Stage, Variables


def from_flax(module, *, name: str | None = None, input_shape: Sequence[int] | None = None,
              train_kwargs: dict[str, Any] | None = None,
              eval_kwargs: dict[str, Any] | None = None, **unknown) -> Stage:
  """Makes a :class:`Stage` from a flax linen module (one line per stage).

  The module's call arguments come in two sets, as flax modules take them:

  * ``train_kwargs`` for training: ``init``, the forward and the backward's recompute, with the
    stage's ``'dropout'`` key. E.g. ``{'use_running_average': False}`` for a
    ``nn.BatchNorm(use_running_average=None)``, ``{'deterministic': False}`` for a
    ``nn.Dropout(rate)``, ``{'train': True}`` for a module of your own;
  * ``eval_kwargs`` for evaluation (:meth:`Stage.infer`), without randomness and with the
    collections passed immutable: ``{'use_running_average': True}``,
    ``{'deterministic': True}``, ``{'train': False}``.

  A module that keeps mutable collections (running statistics) becomes a stage with state: the
  collection named :data:`BACKWARD_COLLECTION` holds its backward variables, every other one its
  forward variables (module docstring), which its training call must update: building a
  pipeline refuses a stage whose forward variables its training forward leaves unchanged, and
  one that cannot evaluate, naming the argument to give.
  """
  from flax import linen as nn  # pylint: disable=import-outside-toplevel  # only here
  if isinstance(module, type) and issubclass(module, nn.Module):
    raise ModelError(f"from_flax takes a module instance, e.g. from_flax({module.__name__}(...)) "
                     f"with its arguments; got the class {module.__name__} itself.")
  if not isinstance(module, nn.Module):
    raise ModelError(f"from_flax takes a flax linen module (e.g. nn.Dense(10)); got "
                     f"{type(module).__name__}. Wrap a plain function as pipejax.Stage(init, "
                     "forward).")
  stage_name = name or type(module).__name__
  train_kwargs = _call_kwargs(train_kwargs, "train_kwargs", stage_name)
  eval_kwargs = _call_kwargs(eval_kwargs, "eval_kwargs", stage_name)
  if unknown:
    given = ", ".join(f"{k}={v!r}" for k, v in unknown.items())
    raise ModelError(
        f"from_flax('{stage_name}') takes the module's call arguments in two sets, "
        "train_kwargs for training (init, forward and recompute) and eval_kwargs for "
        f"evaluation; got {given} on its own, which would serve both (a BatchNorm's statistics "
        "would then never move, or evaluation would try to update them). Pass e.g. "
        f"from_flax(module, train_kwargs={dict(unknown)!r}, eval_kwargs={{...}}) with the "
        "values for inference.")
  if isinstance(input_shape, int):
    input_shape = (input_shape,)

  def init_all(rng, x):
    return module.init({"params": rng, "dropout": rng}, x, **train_kwargs)

  def init(rng, x):
    return init_all(rng, x).get("params", {})

  def init_variables(rng, x):
    return _as_variables(init_all(rng, x), x)

  def init_with_variables(rng, x):
    everything = init_all(rng, x)
    return everything.get("params", {}), _as_variables(everything, x)

  def _as_variables(everything, x):
    collections = {k: v for k, v in everything.items() if k != "params"}
    if not collections:
      return None
    if "batch_stats" in collections and {a.shape[0] for a in jax.tree.leaves(x)} == {1}:
      raise ModelError(
          f"Stage '{stage_name}' keeps BatchNorm statistics ('batch_stats') at micro-batch size "
          "1, where batch statistics are degenerate (a dense layer's normalized output is "
          "identically zero). Use Online Normalization (pipejax.models.online_norm.OnlineNorm, "
          "normalization='online' in the model builders), made for batch 1, or GroupNorm or "
          "LayerNorm; or train with a larger micro-batch.")
    backward = collections.pop(BACKWARD_COLLECTION, {})
    return Variables(collections, backward)

  def rngs_for(rng):
    return None if rng is None else {"dropout": rng}

  def apply(params, x, rng, variables=None):
    if variables is None:
      return module.apply({"params": params}, x, rngs=rngs_for(rng), **train_kwargs)
    y, forward = module.apply(_all_collections(params, variables), x, rngs=rngs_for(rng),
                              mutable=list(variables.forward), **train_kwargs)
    return y, {k: forward[k] for k in variables.forward}

  def infer_with(params, x, variables):
    collections = {"params": params} if variables is None else _all_collections(params, variables)
    return module.apply(collections, x, **eval_kwargs)

  return Stage(init=init, apply=apply, name=stage_name,
               input_shape=tuple(input_shape) if input_shape is not None else None,
               init_variables=init_variables, infer_with=infer_with,
               init_with_variables=init_with_variables,
               infer_differs=_differ(train_kwargs, eval_kwargs))


def _differ(train_kwargs: dict, eval_kwargs: dict) -> bool:
  """Whether the two sets may call the module differently. By identity: values may be arrays (an
  attention mask), whose ``==`` is elementwise; equal values that are not the same object only
  cost a trace of the stage's evaluation."""
  return train_kwargs.keys() != eval_kwargs.keys() or any(
      train_kwargs[k] is not eval_kwargs[k] for k in train_kwargs)


def _call_kwargs(kwargs, what: str, stage_name: str) -> dict[str, Any]:
  if kwargs is None:
    return {}
  if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
    raise ModelError(f"from_flax('{stage_name}'): {what} must be a dict of the module's keyword "
                     f"arguments, e.g. {{'train': True}}; got {kwargs!r}.")
  return dict(kwargs)


def _all_collections(params, variables: Variables) -> dict:
  return {"params": params, **variables.forward, BACKWARD_COLLECTION: variables.backward}
