"""Stage sharpness against dense Hessians, and the quadratic's delay limit against a brute force."""

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

from pipejax.analysis import quadratic
from pipejax.analysis import sharpness


def _symmetric(eigenvalues, seed=0):
  q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(len(eigenvalues),) * 2))
  return (q * np.asarray(eigenvalues)) @ q.T


def test_top_eigenvalue_is_numpys_largest_of_a_symmetric_matrix():
  h = jnp.asarray(_symmetric([7.0, 3.0, 2.5, -1.0, 0.1]), jnp.float32)
  value = sharpness.top_eigenvalue(lambda v: {"a": h @ v["a"]}, {"a": jnp.zeros(5)},
                                   jax.random.PRNGKey(1), iterations=200, tolerance=1e-7)
  assert value == pytest.approx(7.0, rel=1e-3)


def test_a_dominant_negative_eigenvalue_gives_the_largest_positive_one():
  # A saddle's negative curvature bounds no step size: the answer is the positive curvature.
  h = jnp.asarray(_symmetric([-9.0, 2.0, 1.0, 0.5]), jnp.float32)
  value = sharpness.top_eigenvalue(lambda v: h @ v, jnp.zeros(4), jax.random.PRNGKey(0),
                                   iterations=500, tolerance=1e-8)
  assert value == pytest.approx(2.0, rel=1e-2)


def test_stage_blocks_leave_out_the_coupling_between_stages():
  a, b = _symmetric([4.0, 1.0, 0.5], 1), _symmetric([9.0, 2.0], 2)
  c = np.random.default_rng(3).normal(size=(3, 2)) * 2.0  # cross terms: in H, not in its blocks

  def loss(params):
    p, q = params[0]["w"], params[1]["w"]
    return 0.5 * p @ a @ p + 0.5 * q @ b @ q + p @ c @ q
  params = [{"w": jnp.ones(3)}, {"w": jnp.ones(2)}]
  got = sharpness.stage_sharpness(loss, params, [0, 1], jax.random.PRNGKey(0), iterations=300)
  np.testing.assert_allclose(got, [4.0, 9.0], rtol=1e-3)
  whole = np.block([[a, c], [c.T, b]])
  assert np.linalg.eigvalsh(whole).max() > 9.5  # the coupling would have changed the answer


def test_a_small_networks_stage_sharpness_equals_its_dense_hessians_blocks():
  keys = jax.random.split(jax.random.PRNGKey(4), 4)
  x = jax.random.normal(keys[0], (16, 3))
  y = jax.random.normal(keys[1], (16,))
  params = [{"w": jax.random.normal(keys[2], (3, 4)) * 0.7},
            {"w": jax.random.normal(keys[3], (4,)) * 0.7}]

  def loss(ps):
    return jnp.mean((jnp.tanh(x @ ps[0]["w"]) @ ps[1]["w"] - y) ** 2)
  got = sharpness.stage_sharpness(loss, params, [0, 1], jax.random.PRNGKey(5), iterations=200)
  flat, unflatten = jax.flatten_util.ravel_pytree(params)
  dense = np.asarray(jax.hessian(lambda f: loss(unflatten(f)))(flat), np.float64)
  blocks = [dense[:12, :12], dense[12:, 12:]]
  np.testing.assert_allclose(got, [np.linalg.eigvalsh(h).max() for h in blocks], rtol=2e-3)


@pytest.mark.parametrize("method", ["pb", "pb_sc", "pb_sc_lwp", "spectrain"])
def test_largest_stable_delay_is_the_brute_forces_last_stable_delay(method):
  momentum = 0.9
  x = 0.6 * quadratic.max_stable_lr(method, momentum, 6)
  flags = [quadratic.spectral_radius(method, x, momentum, d) < 1.0 for d in range(41)]
  last = flags.index(False) - 1
  assert all(flags[:last + 1]) and not any(flags[last + 1:])  # stability falls with the delay
  assert quadratic.largest_stable_delay(method, x, momentum, max_delay=40) == last
  assert last >= 6


def test_largest_stable_delay_names_no_limit_and_no_stable_delay():
  assert quadratic.largest_stable_delay("pb", 1e-9, 0.9, max_delay=16) is None
  assert quadratic.largest_stable_delay("pb", 10.0, 0.9, max_delay=16) == -1
  with pytest.raises(ValueError, match="pipemare"):
    quadratic.largest_stable_delay("pipemare", 1e-3, 0.9)
