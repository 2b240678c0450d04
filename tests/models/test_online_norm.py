"""Online Normalization against a numpy re-derivation of the paper's equations, its statistics over
a stream, and a normalization='online' run resuming bit-exactly after SIGTERM. (The engine against
the naive oracle with stateful stages: tests/core/test_engine.py; on a mesh:
tests/parallel/test_sharding.py.)"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipejax
from pipejax.models import online_norm
from pipejax.core.stages import Variables

# ----------------------------------------------------------------------------- numpy reference


class NumpyOnlineNorm:
  """The paper's equations in float64, one sample (features last, spatial axes before) at a time."""

  def __init__(self, features, alpha_fwd, alpha_bkw, eps=1e-5, error_check="clamp", clamp=5.0,
               ls_eps=1e-5):
    self.af, self.ab, self.eps = alpha_fwd, alpha_bkw, eps
    self.error_check, self.clamp, self.ls_eps = error_check, clamp, ls_eps
    self.mu, self.var = np.zeros(features), np.ones(features)
    self.u, self.v = np.zeros(features), np.zeros(features)

  def forward(self, x, gamma, beta):
    """One sample x of shape (..., C); returns y and what the backward needs."""
    spatial = tuple(range(x.ndim - 1))
    scale = np.sqrt(self.var + self.eps)
    normalized = (x - self.mu) / scale
    m, v = x.mean(axis=spatial), x.var(axis=spatial)
    self.var = self.af * self.var + (1 - self.af) * v + self.af * (1 - self.af) * (m - self.mu) ** 2
    self.mu = self.af * self.mu + (1 - self.af) * m
    z = normalized * gamma + beta
    if self.error_check == "clamp":
      out = np.clip(z, -self.clamp, self.clamp)
      cache = (normalized, scale, z, None)
    else:
      root = np.sqrt(np.mean(z * z) + self.ls_eps)
      out = z / root
      cache = (normalized, scale, out, root)
    return out, cache

  def backward(self, dout, cache, gamma):
    """d out -> (d x, d gamma, d beta) for the sample of ``cache``; advances u and v."""
    normalized, scale, z_or_out, root = cache
    spatial = tuple(range(dout.ndim - 1))
    if self.error_check == "clamp":
      dz = np.where(np.abs(z_or_out) >= self.clamp, 0.0, dout)
    else:
      out = z_or_out
      dz = (dout - np.mean(dout * out) * out) / root
    dgamma, dbeta = (dz * normalized).sum(axis=spatial), dz.sum(axis=spatial)
    g = dz * gamma - (1 - self.ab) * self.v * normalized
    self.v = self.v + np.mean(g * normalized, axis=spatial)
    g = g / scale
    dx = g - (1 - self.ab) * self.u
    self.u = self.u + np.mean(dx, axis=spatial)
    return dx, dgamma, dbeta


@pytest.mark.parametrize("error_check", ["clamp", "layer_scaling"])
@pytest.mark.parametrize("sample_shape,b", [((6,), 1), ((6,), 4), ((3, 3, 5), 1)])
def test_online_norm_equals_numpy_reference(sample_shape, b, error_check):
  """>= 100 samples streamed through the module (b at a time) against the float64 equations."""
  num_samples = 120
  features = sample_shape[-1]
  rng = np.random.RandomState(0)
  # Drifting inputs away from zero mean and unit variance, so the statistics have work to do.
  xs = (rng.randn(num_samples, *sample_shape) * 2.0 + 1.5
        + np.linspace(0, 3, num_samples).reshape((-1,) + (1,) * len(sample_shape)))
  dys = rng.randn(num_samples, *sample_shape) + 0.5
  gamma, beta = 1.0 + 0.3 * rng.randn(features), 0.2 * rng.randn(features)
  kwargs = dict(alpha_fwd=0.95, alpha_bkw=0.9)
  module = online_norm.OnlineNorm(error_check=error_check, clamp_value=2.5, **kwargs)
  stage = pipejax.from_flax(module)
  x0 = jnp.zeros((b,) + sample_shape, jnp.float32)
  params = {"scale": jnp.asarray(gamma, jnp.float32), "bias": jnp.asarray(beta, jnp.float32)}
  variables = stage.variables(jax.random.PRNGKey(0), x0)
  step = jax.jit(streamed_step(stage))

  ref = NumpyOnlineNorm(features, error_check=error_check, clamp=2.5, **kwargs)
  clamped = 0
  for start in range(0, num_samples, b):
    x, dy = xs[start:start + b], dys[start:start + b]
    y, dparams, dx, variables = step(params, variables, jnp.asarray(x, jnp.float32),
                                     jnp.asarray(dy, jnp.float32))
    caches, expected_y = [], []
    for t in range(b):
      out, cache = ref.forward(x[t], gamma, beta)
      expected_y.append(out)
      caches.append(cache)
    grads = [ref.backward(dy[t], caches[t], gamma) for t in range(b)]
    clamped += int(np.sum(np.abs(np.stack(expected_y)) >= 2.5))
    np.testing.assert_allclose(y, np.stack(expected_y), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(dx, np.stack([g[0] for g in grads]), rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(dparams["scale"], sum(g[1] for g in grads), rtol=2e-4, atol=1e-4)
    np.testing.assert_allclose(dparams["bias"], sum(g[2] for g in grads), rtol=2e-4, atol=1e-4)
  stats = variables.forward[online_norm.STATS_COLLECTION]
  np.testing.assert_allclose(stats["mean"], ref.mu, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(stats["var"], ref.var, rtol=1e-5)
  np.testing.assert_allclose(variables.backward["u"], ref.u, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(variables.backward["v"], ref.v, rtol=1e-4, atol=1e-5)
  assert np.abs(ref.u).max() > 1e-2 and np.abs(ref.v).max() > 1e-2  # the controls did work
  if error_check == "clamp":
    assert clamped > 0  # the clamp's zero gradient was exercised


def streamed_step(stage):
  """One micro-batch through a stateful stage: y, d params, d x and the variables after it."""
  def step(params, variables, x, dy):
    def f(p, backward, h):
      return stage.forward(p, h, None, Variables(variables.forward, backward))
    (y, forward), vjp = jax.vjp(f, params, variables.backward, x)
    dparams, increment, dx = vjp((dy, jax.tree.map(jnp.zeros_like, forward)))
    backward = jax.tree.map(jnp.add, variables.backward, increment)
    return y, dparams, dx, Variables(forward, backward)
  return step


def test_online_norm_statistics_over_a_stream():
  """The paper's properties over a stream at b = 1: the normalized output has zero mean and unit
  variance; the control processes make the input gradient orthogonal to the constant and to the
  output (its stream means of dx and dx * y vanish), which the bare 1/sigma scaling does not."""
  num_samples, features = 4000, 8
  rng = np.random.RandomState(1)
  xs = rng.randn(num_samples, 1, features) * np.linspace(0.5, 4, features) + np.arange(features)
  noise = rng.randn(num_samples, 1, features)
  stage = pipejax.from_flax(online_norm.OnlineNorm(alpha_fwd=0.99, alpha_bkw=0.99, affine=False,
                                                   error_check=None))
  params = {}
  variables = stage.variables(jax.random.PRNGKey(0), jnp.zeros((1, features)))
  step = streamed_step(stage)

  def scan_step(variables, sample):
    x, eps = sample
    y = stage.forward(params, x, None, variables)[0]
    dy = 1.0 + 0.7 * y + eps  # a gradient with components along the constant and the output
    y, _, dx, variables = step(params, variables, x, dy)
    return variables, (y, dx)

  _, (ys, dxs) = jax.jit(lambda v, s: jax.lax.scan(scan_step, v, s))(
      variables, (jnp.asarray(xs, jnp.float32), jnp.asarray(noise, jnp.float32)))
  ys, dxs = np.asarray(ys)[1000:, 0], np.asarray(dxs)[1000:, 0]  # after the statistics settle
  np.testing.assert_allclose(ys.mean(axis=0), 0.0, atol=0.1)
  np.testing.assert_allclose(ys.var(axis=0), 1.0, atol=0.1)
  sigma = np.linspace(0.5, 4, features)
  uncontrolled = 1.0 / sigma  # the mean of dy / sigma: what the gradient would carry without u
  assert np.all(np.abs(dxs.mean(axis=0)) < 0.05 * uncontrolled)
  assert np.all(np.abs((dxs * ys).mean(axis=0)) < 0.05 * 0.7 / sigma)


# ----------------------------------------------------------------------------- in a pipeline


# The SIGTERM resume through the binary runs Online Norm: tests/train/test_training.py.


def test_online_norm_in_the_conv_models():
  """'online' in a CNN (per channel) trains through the pipeline; a ResNet's norms (projection
  shortcuts included) all become stages with state."""
  from pipejax import methods, models  # pylint: disable=g-import-not-at-top
  from pipejax.core.engine import Pipeline  # pylint: disable=g-import-not-at-top
  model = models.build("small_cnn", widths=(4, 8), dense=(8,), normalization="online")
  x = np.random.default_rng(0).standard_normal((12, 1, 8, 8, 1)).astype(np.float32)
  y = np.arange(12, dtype=np.int32).reshape(12, 1) % 10
  pipe = Pipeline(model, methods.make_method("pb_sc_lwp", learning_rate=0.01), x[0], y[0])
  state = pipe.init(jax.random.PRNGKey(0))
  before = jax.tree.map(np.array, [st.variables for st in state.stages])
  state, metrics = pipe.run(state, x, y)
  assert np.asarray(metrics["finite"]).all() and np.asarray(metrics["valid"]).sum() == 9
  means = [leaf.shape for st in state.stages
           for path, leaf in jax.tree_util.tree_leaves_with_path(st.variables)
           if "mean" in jax.tree_util.keystr(path)]
  assert means == [(4,), (8,), (8,)]  # conv channels, dense features; the head has no norm
  for old, new in zip(jax.tree.leaves(before), jax.tree.leaves([st.variables
                                                                for st in state.stages])):
    assert np.abs(np.asarray(new) - old).max() > 0
  resnet = models.build("cifar_resnet20", width=4, normalization="online")
  rows = models.describe(resnet, jnp.zeros((1, 8, 8, 3)))
  assert len(rows) == 20
  variables = jax.eval_shape(Pipeline(resnet, methods.make_method("pb", learning_rate=0.01),
                                      jnp.zeros((1, 8, 8, 3)), jnp.zeros((1,), jnp.int32)).init,
                             jax.random.PRNGKey(0))
  stateful = [st.variables is not None for st in variables.stages]
  assert stateful == [True] * 19 + [False]  # every conv layer; the dense head has no norm
