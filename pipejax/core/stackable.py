"""Which consecutive stages are identical, so that they tick as one stacked part.

A deep pipeline is mostly runs of identical stages (the residual MLP's blocks, the blocks of one
ResNet width, transformer blocks). Traced stage by stage, the tick holds each operation once per
stage, so its kernels and its compile time grow with depth. The local runner
(:class:`~pipejax.core.engine.Pipeline` with ``stack=True``) advances each such run as one
stacked part (docs/design.md §6.1): its weights, optimizer states, registers and variables are
stacked on a leading stage axis, and :class:`~pipejax.core.stage_maths.StageMaths` runs under
``jax.vmap`` over it, with the stage number (the rng fold-in) and the delay ``D_s`` as arrays
over the axis. Every method's weight views and update rules take the delay as a value
(``pipejax.optim`` accepts traced hyperparameters), so Spike Compensation's coefficients, the
prediction horizons and PipeMare's rates become per-stage arrays without any change to the
methods.

**Which stages stack** (:func:`find_parts`): two stages are identical when their forward (over
its parameters' flattened leaves), and the method's weight views and update with the delay as an
input, written over the flattened leaves of the stage's state, trace to the same jaxprs
(operations, shapes, dtypes, constants); the backward is the forward's VJP. Their parameter trees
may differ in names only (``block3`` against ``block4``): a stacked part keeps its first stage's
tree structure, and the logical state keeps every stage's own. The first and the last stage never
stack (they skip the input gradient, and meet the loss). A method whose update cannot take a
traced delay (an optimizer factory that branches on it in Python) stacks nothing: the pipeline
then runs stage by stage. A stacked part also initializes as one program under ``vmap``
(:func:`init_program`): flax derives each weight's key by folding a hash of its module's name into
the stage's key, so identical blocks trace to initializations that differ in those constants
only, which are lifted out into an input.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np

from pipejax.core.initial import StateInit
from pipejax.core.state import PipelineState, StageState

PyTree = Any


def _signature(initial: StateInit, s: int, spec: PipelineState):
  """What stage ``s`` computes, as text and constants: equal for identical stages.

  The stage's forward (traced when the pipeline was built), and the method's weight views and
  update (:func:`update_program`); the backward is the forward's VJP. None when the method cannot
  take a traced delay.
  """
  update = update_program(initial, s, spec)
  if update is None:
    return None
  line = [(a.shape[1:], a.dtype) for a in jax.tree.leaves(spec.stages[s].delay_line)]
  return _as_text((initial.spec.forward_program(s), update)), str(line)


def update_program(initial: StateInit, s: int, spec: PipelineState):
  """The method's weight views and update of stage ``s`` with the delay as a traced value, as a
  closed jaxpr over the flattened leaves of the stage's state; None when the method cannot take
  a traced delay, or its update's state is not the state the stage's init makes."""
  method, st = initial.spec.method, spec.stages[s]
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


def init_program(initial: StateInit, s: int) -> InitProgram | None:
  """Stage ``s``'s init traced with its key, delay and fill value as inputs
  (:meth:`~pipejax.core.initial.StateInit.stage_program`), and the constants it folds into its key
  (flax derives each weight's key from its module's name, so ``block3`` and ``block4`` fold in
  different ones) lifted out as a further input.

  Stages whose programs are then equal initialize under one ``vmap`` over their keys, delays and
  salts, with the per-stage init's numbers. None when the method's optimizer state cannot start
  from a traced delay.
  """
  closed, out_shape = initial.stage_program(s)
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


def find_parts(initial: StateInit) -> list[tuple[int, int]]:
  """The pipeline's parts as contiguous ``(start, stop)`` pairs: identical consecutive stages
  (module docstring) as one stacked part, every other stage a part of its own."""
  num, spec, model = initial.spec.num_stages, initial.state_spec, initial.spec.model
  signatures = [None] * num
  for s in range(1, num - 1):
    # Stages a Model declares repeated run one program (pipejax.Model): the first one's is traced.
    same = model.repeats(s) and s > 1
    signatures[s] = signatures[s - 1] if same else _signature(initial, s, spec)
  bounds, start = [], 0
  for s in range(1, num + 1):
    same = (s < num and signatures[s] is not None and signatures[s] == signatures[start])
    if not same:
      bounds.append((start, s))
      start = s
  return bounds
