"""The curvature a delayed update meets: the top eigenvalue of each stage's block of the Hessian.

The convex quadratic (:mod:`pipejax.analysis.quadratic`) tells whether a method is stable at a
given ``ηλ`` and delay ``D``. On a network its ``λ`` is a curvature along which one stage's
weights move, and its ``D`` is that stage's delay: each stage's own update sees the diagonal block
of the Hessian that belongs to its weights, with the other stages held where they are. This module
finds that block's largest eigenvalue, ``λ_s``, by power iteration on Hessian-vector products
(forward over reverse), so that ``η λ_s`` can be set beside the quadratic's edge at ``D_s``.

The loss is the mean over a fixed batch of training examples: the Hessian of the expected loss,
which is what sets the stability of the mean dynamics, not any one example's.

Example:
  >>> import jax.numpy as jnp
  >>> hvp = lambda v: {"w": jnp.array([3.0, 1.0]) * v["w"]}
  >>> round(top_eigenvalue(hvp, {"w": jnp.ones(2)}, jax.random.PRNGKey(0)), 3)
  3.0
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def _dot(a: PyTree, b: PyTree) -> jax.Array:
  return sum(jnp.vdot(x, y) for x, y in zip(jax.tree_util.tree_leaves(a),
                                            jax.tree_util.tree_leaves(b)))


def _normalized(tree: PyTree) -> PyTree:
  return jax.tree_util.tree_map(lambda leaf: leaf / jnp.sqrt(_dot(tree, tree)), tree)


@jax.jit
def _power_step(v: PyTree, hv: PyTree, shift: jax.Array
                ) -> tuple[jax.Array, jax.Array, PyTree]:
  """For a unit ``v`` and ``hv = H v``: the Rayleigh quotient ``μ`` of ``v`` under ``H``, the
  residual ``‖H v − μ v‖ / |μ|`` and the next iterate under ``H + shift I``. One compiled program
  a tree shape, so an iteration costs one product and one dispatch more."""
  quotient = _dot(v, hv)
  residual = jax.tree_util.tree_map(lambda h, x: h - quotient * x, hv, v)
  shifted = jax.tree_util.tree_map(lambda h, x: h + shift * x, hv, v)
  relative = jnp.sqrt(_dot(residual, residual)) / jnp.maximum(jnp.abs(quotient), 1e-30)
  return quotient, relative, _normalized(shifted)


def top_eigenvalue(hvp: Callable[[PyTree], PyTree], like: PyTree, key: jax.Array,
                   iterations: int = 30, tolerance: float = 1e-3) -> float:
  """The algebraically largest eigenvalue of a symmetric operator given as ``v -> H v``.

  Power iteration finds the eigenvalue of largest magnitude; when that one is negative (a saddle
  direction, which no step size makes unstable), the iteration is run again on ``H + |μ| I`` so
  that the answer is the largest *positive* curvature, the one that bounds a stable step.

  Args:
    hvp: ``v -> H v`` on trees shaped like ``like``.
    like: A tree of the operator's shape (its values are not used).
    key: Seeds the starting vector.
    iterations: At most this many products.
    tolerance: Stop when ``‖H v − μ v‖ ≤ tolerance · |μ|``: the eigenvalue is then off by
      about ``tolerance²`` times ``|μ|`` over the gap to the next one, relative.

  Returns:
    The Rayleigh quotient of the last iterate, a float.
  """
  leaves, treedef = jax.tree_util.tree_flatten(like)
  keys = jax.random.split(key, len(leaves))
  start = _normalized(treedef.unflatten(
      [jax.random.normal(k, jnp.shape(leaf), jnp.result_type(leaf)) for k, leaf in
       zip(keys, leaves)]))

  def iterate(shift: float) -> float:
    v, value = start, None
    for _ in range(iterations):
      quotient, residual, v = _power_step(v, hvp(v), jnp.float32(shift))
      value = float(quotient)
      if float(residual) <= tolerance:
        break
    return value

  largest = iterate(0.0)
  return largest if largest >= 0 else iterate(-largest)


def stage_sharpness(loss: Callable[[Sequence[PyTree]], jax.Array], stage_params: Sequence[PyTree],
                    stages: Sequence[int], key: jax.Array, iterations: int = 30,
                    preconditioner: Sequence[PyTree] | None = None) -> np.ndarray:
  """Top eigenvalue of the Hessian's diagonal block of each stage in ``stages``.

  Args:
    loss: The mean training loss as a function of the list of every stage's params.
    stage_params: Every stage's params, where the curvature is taken.
    stages: Which stages' blocks to measure.
    key: Seeds the power iterations.
    iterations: Power-iteration products per stage.
    preconditioner: Every stage's diagonal ``P`` (a tree like its params, > 0), or None. Given,
      the eigenvalue is that of ``P⁻¹ H_s`` (read as ``P^{-1/2} H_s P^{-1/2}``, which has the
      same spectrum and stays symmetric): the curvature a step divided by ``P`` meets, e.g.
      Adam's ``√ν̂ + ε`` (:func:`adam_preconditioner`).

  Returns:
    ``float64[len(stages)]``: ``λ_s`` per requested stage.
  """
  params = list(stage_params)
  zeros = [jax.tree_util.tree_map(jnp.zeros_like, p) for p in params]

  # The weights are an argument, not constants of the program: XLA would fold every weight of a
  # deep network into it and compile for minutes.
  @jax.jit
  def full_hvp(at, direction):
    return jax.jvp(jax.grad(loss), (at,), (direction,))[1]

  scales = None if preconditioner is None else [
      jax.tree_util.tree_map(lambda p: 1.0 / jnp.sqrt(p), tree) for tree in preconditioner]
  scaled = lambda v, s: v if scales is None else jax.tree_util.tree_map(jnp.multiply, scales[s], v)
  result = []
  for i, s in enumerate(stages):
    def block_hvp(v, s=s):
      return scaled(full_hvp(params, zeros[:s] + [scaled(v, s)] + zeros[s + 1:])[s], s)
    result.append(top_eigenvalue(block_hvp, params[s], jax.random.fold_in(key, i), iterations))
  return np.asarray(result, np.float64)


def adam_preconditioner(loss: Callable[..., jax.Array], stage_params: Sequence[PyTree],
                        batches: Sequence[tuple], eps: float = 1e-8) -> list[PyTree]:
  """Adam's divisor ``√ν̂ + ε`` at ``stage_params``, every stage's, for :func:`stage_sharpness`.

  ``ν̂`` is the bias-corrected mean of squared gradients. Where the weights move slowly against
  ``1 / (1 − b2)`` steps it is the mean of the squared gradient of one step's batch, which is what
  this returns: the mean over ``batches`` (each the inputs of one optimizer step) of the squared
  gradient of ``loss(params, *batch)``. It holds the gradient's noise as well as its mean, as
  the optimizer's own ``ν̂`` does.

  Args:
    loss: ``loss(params, *batch)``: the mean loss of one batch, params the list of every stage's.
    stage_params: Every stage's params.
    batches: The batches of as many optimizer steps.
    eps: Adam's ε.

  Returns:
    A list of trees like ``stage_params``: ``√ν̂ + ε``.
  """
  params = list(stage_params)
  grad = jax.jit(jax.grad(loss))
  total = jax.tree_util.tree_map(jnp.zeros_like, params)
  for batch in batches:
    total = jax.tree_util.tree_map(lambda t, g: t + g * g, total, grad(params, *batch))
  return jax.tree_util.tree_map(lambda t: jnp.sqrt(t / len(batches)) + eps, total)
