"""Every stage of a model traced once, abstractly, and the checks that refuse a model that
cannot train: a stage that does not fit its predecessor, merges samples, keeps forward variables
that never move, or cannot evaluate.

The traces are what a deep pipeline is built from (:class:`ModelTrace`): shapes, each stage's
forward and initialization as programs, so that building traces each stage once.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp

from pipejax.core.stage import ModelError, Stage, Variables

PyTree = Any


def trace_stages(stages: Sequence[Stage], rng: jax.Array, x: PyTree,
                 label: Callable[[int], str]) -> ModelTrace:
  """Traces each of ``stages`` on the output of the one before, ``x`` entering the first,
  refusing a model that cannot train (module docstring); ``label(s)`` names stage ``s`` in the
  messages. Consecutive places of one :class:`~pipejax.core.stage.Stage` object are traced
  once."""
  params_shapes, input_shapes, forwards, initials = [], [], [], []
  keys = jax.random.split(rng, len(stages))
  x = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), x)
  for s, stage in enumerate(stages):
    if s and stages[s] is stages[s - 1] and _fmt(x) == _fmt(input_shapes[-1]):
      # A repeated stage (pipejax.Model): the programs take the key and the input as
      # arguments, so the previous stage's serve this one; its output is its input's shape.
      for found in (params_shapes, input_shapes, forwards, initials):
        found.append(found[-1])
      continue
    source = "the input batch" if s == 0 else label(s - 1)
    if stage.input_shape is not None:
      got = jax.tree.map(lambda a: tuple(a.shape[1:]), x)
      if got != stage.input_shape:
        raise ModelError(
            f"{source} produces per-sample shape {_fmt(x)} but {label(s)} expects "
            f"per-sample shape {stage.input_shape}. Change one of the two stages so they agree.")
    try:
      initial, (p, v) = jax.make_jaxpr(stage.initial, return_shape=True)(keys[s], x)
      forward, (y, _) = jax.make_jaxpr(stage.forward, return_shape=True)(p, x, keys[s], v)
    except ModelError:
      raise
    except Exception as e:  # flax/XLA shape errors are long; keep the first line.
      first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      raise ModelError(
          f"{source} produces {_fmt(x)}, which {label(s)} cannot take: {first_line}. "
          "Change one of the two stages so the output of the first fits the input of the "
          "second.") from None
    # The engine moves each micro-batch's samples through the delay lines together, and the
    # loss averages over them: a stage that merges or splits samples would train silently wrong.
    batch = jax.tree.leaves(input_shapes[0] if input_shapes else x)[0].shape[0]
    changed = [tuple(a.shape) for a in jax.tree.leaves(y) if a.shape[:1] != (batch,)]
    if changed:
      raise ModelError(
          f"{label(s)} turns a micro-batch of {batch} into outputs of shape "
          f"{changed[0]}: every output of a stage must keep the leading micro-batch axis "
          f"({batch}), one row per sample. Reshape within each sample, e.g. "
          "x.reshape(x.shape[0], -1).")
    _check_variables_move(label(s), forward, (p, x, keys[s]), v)
    _check_evaluates(label(s), stage, forward, (p, x, keys[s]), v, y)
    params_shapes.append(p)
    input_shapes.append(x)
    forwards.append(forward)
    initials.append(InitialProgram(initial, jax.tree.structure((p, v))))
    x = y
  return ModelTrace(tuple(params_shapes), tuple(input_shapes), tuple(forwards), tuple(initials),
                    {})


def _check_variables_move(label: str, forward: jax_core.ClosedJaxpr, before: tuple,
                          variables: Variables | None) -> None:
  """Refuses forward variables that the traced training forward returns as it took them: they
  would keep their initial values for ever (``before``: the forward's arguments before them)."""
  if variables is None or not jax.tree.leaves(variables.forward):
    return
  paths = jax.tree_util.tree_leaves_with_path(variables.forward)
  start = len(jax.tree.leaves(before))
  taken = forward.jaxpr.invars[start:start + len(paths)]
  returned = forward.jaxpr.outvars[len(forward.jaxpr.outvars) - len(paths):]
  frozen = [jax.tree_util.keystr(path) for (path, _), a, b in zip(paths, taken, returned)
            if a is b]
  if frozen:
    raise ModelError(
        f"{label} keeps forward variables that its training forward returns unchanged "
        f"({', '.join(frozen[:3])}{', ...' if len(frozen) > 3 else ''}), so they would keep "
        "their initial values for ever (a BatchNorm's running mean 0 and variance 1) and "
        "evaluation would read those. Update them in training: flax's BatchNorm needs "
        "use_running_average=False there and True in evaluation, e.g. "
        "from_flax(nn.BatchNorm(use_running_average=None), train_kwargs={'use_running_average': "
        "False}, eval_kwargs={'use_running_average': True}). A value that never changes "
        "belongs in the stage's closure, not in its variables.")


def _check_evaluates(label: str, stage: Stage, forward: jax_core.ClosedJaxpr, before: tuple,
                     variables: Variables | None, trained) -> None:
  """Traces the stage's evaluation (:meth:`Stage.infer`) where it is not its training forward
  without randomness, and refuses one that fails or gives another shape than training."""
  key = forward.jaxpr.invars[len(jax.tree.leaves(before[:2]))]
  draws = any(key is a for eqn in forward.jaxpr.eqns for a in eqn.invars)
  if variables is None and not stage.infer_differs and not draws:
    return
  params, x, _ = before
  try:
    evaluated = jax.eval_shape(stage.infer, params, x, variables)
  except ModelError:
    raise
  except Exception as e:  # pylint: disable=broad-except  # flax's errors are long
    first_line = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else \
        type(e).__name__
    raise ModelError(
        f"{label} cannot evaluate: {first_line}. Evaluation (Stage.infer: Model.apply with "
        "variables, the trainer's test) reads the variables without updating them and draws "
        "no randomness; give from_flax the module's arguments for it as eval_kwargs, e.g. "
        "{'use_running_average': True} for a BatchNorm, {'deterministic': True} for a Dropout, "
        "{'train': False} for a module of your own (and the training ones as "
        "train_kwargs).") from None
  if _fmt(evaluated) != _fmt(trained):
    raise ModelError(f"{label} evaluates to {_fmt(evaluated)} but trains to {_fmt(trained)}; "
                     "the next stage takes one shape. Make its eval_kwargs give the training "
                     "output's shape.")


class InitialProgram(NamedTuple):
  """A stage's ``initial(rng, x)`` as a closed jaxpr of the key and the input's leaves."""

  closed: jax_core.ClosedJaxpr
  out_tree: Any  # the structure of (params, variables)

  def __call__(self, rng: jax.Array, x: PyTree) -> tuple[PyTree, Variables | None]:
    leaves = jax_core.jaxpr_as_fun(self.closed)(rng, *jax.tree.leaves(x))
    return jax.tree.unflatten(self.out_tree, leaves)


class ModelTrace(NamedTuple):
  """What :meth:`Model.trace` finds, one entry per stage."""

  params: tuple  # ShapeDtypeStruct trees of the parameters
  inputs: tuple  # ShapeDtypeStruct trees of the input micro-batch
  forwards: tuple  # closed jaxprs of forward(params, x, rng, variables)
  initials: tuple  # InitialProgram of initial(rng, x)
  # Programs compiled from the trace, kept with it for every pipeline built on it (the initial
  # weights: pipejax.core.initial.CompiledInit), by the signature of their arguments.
  compiled: dict


def _fmt(tree: PyTree) -> str:
  leaves = jax.tree.leaves(tree)
  if len(leaves) == 1:
    a = leaves[0]
    return f"{tuple(a.shape)} {jnp.dtype(a.dtype).name}"
  return str(jax.tree.map(lambda a: f"{tuple(a.shape)} {jnp.dtype(a.dtype).name}", tree))
