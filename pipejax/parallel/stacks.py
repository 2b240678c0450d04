"""Which consecutive stages are identical, so that they can run as one stack.

Two stages are identical when their forward (over its parameters' flattened leaves), and the
method's weight views and update with the delay as an input, written over the flattened leaves of
the stage's state, trace to the same jaxprs (operations, shapes, dtypes, constants); the backward
is the forward's VJP. Their parameter trees may differ in names only (``block3`` against
``block4``): a stack keeps its first stage's tree structure, and the logical state keeps every
stage's own. The first and the last stage never stack (they skip the input gradient, and meet the
loss). A method whose update cannot take a traced delay (an optimizer factory that branches on it
in Python) makes no stack: the pipeline then runs stage by stage.

A stack also initializes as one program under ``vmap`` (:func:`init_program`): flax derives each
weight's key by folding a hash of its module's name into the stage's key, so identical blocks
trace to initializations that differ in those constants only, which are lifted out into an input.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np

from pipejax.core.engine import Pipeline
from pipejax.core.state import PipelineState, StageState


def _signature(pipeline: Pipeline, s: int, spec: PipelineState):
  """What stage ``s`` computes, as text and constants: equal for identical stages.

  The stage's forward (traced when the pipeline was built), and the method's weight views and
  update (:func:`update_program`); the backward is the forward's VJP. None when the method cannot
  take a traced delay.
  """
  update = update_program(pipeline, s, spec)
  if update is None:
    return None
  line = [(a.shape[1:], a.dtype) for a in jax.tree.leaves(spec.stages[s].delay_line)]
  return _as_text((pipeline.forward_program(s), update)), str(line)


def update_program(pipeline: Pipeline, s: int, spec: PipelineState):
  """The method's weight views and update of stage ``s`` with the delay as a traced value, as a
  closed jaxpr over the flattened leaves of the stage's state; None when the method cannot take
  a traced delay, or its update's state is not the state the stage's init makes."""
  method, st = pipeline.method, spec.stages[s]
  leaves, treedef = jax.tree.flatten(st._replace(delay_line=None))
  opt_structure = []

  def update(leaves, delay):
    st = jax.tree.unflatten(treedef, leaves)
    extra = {"gradient_params": st.params} if method.pass_gradient_weights else {}
    updates, opt_state = method.optimizer(delay).update(st.params, st.opt_state, st.params,
                                                        **extra)
    opt_structure.append(jax.tree.structure(opt_state))
    return (method.forward_weights(st.params, st.opt_state, delay),
            method.backward_weights(st.params, st.opt_state, delay), updates, opt_state)

  try:
    program = jax.make_jaxpr(update)(leaves, _TRACED_DELAY)
  except (TypeError, ValueError):  # a traced delay the method cannot take, among them
    return None
  if opt_structure[0] != jax.tree.structure(st.opt_state):
    return None
  return program


class InitProgram(NamedTuple):
  """One stage's initialization as a program of its key, delay, fill value and salts."""

  closed: jax_core.ClosedJaxpr  # the salts lifted out of it into inputs
  salts: np.ndarray  # (k,) uint32: the constants this stage folds into its key
  out_tree: Any  # the StageState structure it returns
  text: tuple  # equal for stages that run one program (names of weights may differ)

  def run(self, keys: jax.Array, delays, fill_value: jax.Array, salts: np.ndarray) -> StageState:
    """The stacked initial states of the stages whose keys, delays and salts are given."""
    program = jax_core.jaxpr_as_fun(self.closed)
    leaves = jax.vmap(lambda key, delay, salts: program(key, delay, fill_value, *salts))(
        keys, jnp.asarray(delays, jnp.int32), jnp.asarray(salts))
    return jax.tree.unflatten(self.out_tree, leaves)


def init_program(pipeline: Pipeline, s: int) -> InitProgram | None:
  """Stage ``s``'s ``init_stage`` traced with its key, delay and fill value as inputs, and the
  constants it folds into its key (flax derives each weight's key from its module's name, so
  ``block3`` and ``block4`` fold in different ones) lifted out as a further input.

  Stages whose programs are then equal initialize under one ``vmap`` over their keys, delays and
  salts, with the per-stage init's numbers. None when the method's optimizer state cannot start
  from a traced delay.
  """
  closed, out_shape = pipeline.traced_init_stage(s)
  if closed is None:
    return None
  eqns, salt_vars, salts = [], [], []
  for eqn in closed.jaxpr.eqns:
    if eqn.primitive.name == "random_fold_in" and isinstance(eqn.invars[1], jax_core.Literal):
      salt_vars.append(jax_core.Var(eqn.invars[1].aval))
      salts.append(eqn.invars[1].val)
      eqn = eqn.replace(invars=[eqn.invars[0], salt_vars[-1]])
    eqns.append(eqn)
  debug, names = closed.jaxpr.debug_info, tuple(f"salt{i}" for i in range(len(salts)))
  lifted = jax_core.ClosedJaxpr(
      closed.jaxpr.replace(invars=closed.jaxpr.invars + salt_vars, eqns=eqns,
                           debug_info=debug._replace(arg_names=debug.arg_names + names)),
      closed.consts)
  return InitProgram(lifted, np.asarray(salts, np.uint32), jax.tree.structure(out_shape),
                      _as_text((lifted,)))


_TRACED_DELAY = jax.ShapeDtypeStruct((), jnp.int32)


def _as_text(traced) -> tuple:
  """Closed jaxprs as comparable text: the programs, and their constants' shapes and bytes."""
  consts = tuple((np.shape(c), str(np.result_type(c)), np.asarray(c).tobytes())
                 for closed in traced for c in closed.consts)
  return tuple(str(closed.jaxpr) for closed in traced), consts


def find_stacks(pipeline: Pipeline) -> list[tuple[int, int]]:
  """The pipeline's stages as contiguous ``(start, stop)`` runs; a run of two or more stages is
  a stack of identical stages (module docstring), every other run a single stage."""
  num, spec = pipeline.num_stages, pipeline.state_spec
  signatures = [None] + [_signature(pipeline, s, spec) for s in range(1, num - 1)] + [None]
  runs, start = [], 0
  for s in range(1, num + 1):
    same = (s < num and signatures[s] is not None and signatures[s] == signatures[start])
    if not same:
      runs.append((start, s))
      start = s
  return runs
