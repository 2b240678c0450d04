"""The transformations for long delays: error feedback, Muon with Spike Compensation (and Linear
Weight Prediction on it), and Nesterov AsyncPP as released.

Each is run against its rule written out in numpy in ``tests/oracle.py`` over several steps with
a delay, through the same checks as the shared suite of ``test_transforms.py`` (jit without
recompiling, ``optax.inject_hyperparams``, dtypes, extra arguments), and its hyperparameters out
of range are refused with a message.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pipejax import optim
from pipejax.optim import adam_family
from pipejax.optim.spike import compensated_first_moment
from tests import oracle

_RNG = np.random.default_rng(7)
# A matrix of each orientation (Muon), a vector and a scalar (NAdamW under Muon).
PARAMS = {'tall': _RNG.normal(size=(4, 3)).astype(np.float32),
          'wide': _RNG.normal(size=(2, 5)).astype(np.float32),
          'bias': _RNG.normal(size=(3,)).astype(np.float32),
          'scale': np.float32(0.7)}
GRADS = [jax.tree.map(lambda p: _RNG.normal(size=np.shape(p)).astype(np.float32), PARAMS)
         for _ in range(8)]
LR, BETA, B2, DECAY = 0.02, 0.8, 0.95, 0.1


def _tree(tree, dtype=jnp.float32):
  return jax.tree.map(lambda x: jnp.asarray(x, dtype), tree)


def _leaves(tree):
  return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]


def _assert_close(actual, expected, rtol=1e-5, atol=1e-6):
  for a, e in zip(_leaves(actual), expected):
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


@dataclasses.dataclass(frozen=True)
class Case:
  """A transformation: its factory and keyword arguments, and a numeric hyperparameter to
  change under ``optax.inject_hyperparams`` with a new value (or None)."""

  factory: Callable[..., optax.GradientTransformation]
  kwargs: dict[str, Any]
  injected: tuple[str, Any] | None
  static_args: tuple[str, ...] = ()

  def build(self):
    return optax.with_extra_args_support(self.factory(**self.kwargs))

  def build_injected(self, hyperparam_dtype=None):
    return optax.inject_hyperparams(self.factory, static_args=self.static_args,
                                    hyperparam_dtype=hyperparam_dtype)(**self.kwargs)


_MUON_KWARGS = dict(learning_rate=LR, delay=3, beta=BETA, weight_decay=DECAY, adam_b1=BETA,
                    adam_b2=B2, adam_weight_decay=DECAY, consistent_rms=0.2)

CASES = {
    'error_feedback': Case(optim.delayed_error_feedback,
                           dict(inner=optax.adamw(LR, b1=BETA, b2=B2, weight_decay=DECAY),
                                delay=3),
                           injected=('delay', 1), static_args=('inner',)),
    'error_feedback_smoothed': Case(optim.delayed_error_feedback,
                                    dict(inner=optax.sgd(LR, momentum=BETA), delay=2,
                                         smoothing=0.5),
                                    injected=('smoothing', 0.9), static_args=('inner',)),
    'muon_sc': Case(optim.muon_sc, _MUON_KWARGS, injected=('delay', 6)),
    'muon_sc_lwp': Case(optim.linear_weight_prediction,
                        dict(inner=optim.muon_sc(**_MUON_KWARGS), horizon=3, outermost=True),
                        injected=('horizon', 1), static_args=('inner',)),
    'nesterov_asyncpp_released': Case(
        adam_family.nesterov_asyncpp,
        dict(learning_rate=LR, delay=3, b1=0.99, b2=0.999, weight_decay=DECAY,
             adaptive_momentum=False, lr_correction=False),
        injected=('b1', 0.5)),
    'nesterov_asyncpp_released_torch': Case(
        adam_family.nesterov_asyncpp,
        dict(learning_rate=LR, delay=3, b1=0.99, b2=0.999, weight_decay=DECAY,
             adaptive_momentum=False, lr_correction=False, momentum_decay=0.004),
        injected=('momentum_decay', 0.04)),
}
CASE_NAMES = sorted(CASES)


# ------------------------------------------------------------------------------------------------
# The shared checks.


@pytest.mark.parametrize('name', CASE_NAMES)
def test_jit_matches_eager_and_does_not_recompile(name):
  opt = CASES[name].build()
  traces = []

  @jax.jit
  def step(params, state, grads):
    traces.append(None)  # Runs once per trace, not per call.
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = _tree(PARAMS)
  state = opt.init(params)
  eager_params, eager_state = params, state
  for grads in GRADS[:3]:
    params, state = step(params, state, _tree(grads))
    updates, eager_state = opt.update(_tree(grads), eager_state, eager_params)
    eager_params = optax.apply_updates(eager_params, updates)
  assert len(traces) == 1
  _assert_close(params, _leaves(eager_params), rtol=1e-5, atol=1e-6)
  _assert_close(state, _leaves(eager_state), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('name', CASE_NAMES)
def test_inject_hyperparams_gives_the_same_updates_and_changes_without_retracing(name):
  case = CASES[name]
  opt, reference = case.build_injected(), case.build()
  traces = []

  @jax.jit
  def step(params, state, grads):
    traces.append(None)
    return opt.update(grads, state, params)

  params = _tree(PARAMS)
  state, reference_state, changed_state = opt.init(params), reference.init(params), None
  for i, grads in enumerate(GRADS[:3]):
    updates, state = step(params, state, _tree(grads))
    expected, reference_state = reference.update(_tree(grads), reference_state, params)
    _assert_close(updates, _leaves(expected), rtol=2e-5, atol=1e-6)
    if i == 0:
      hyperparam, value = case.injected
      old = state.hyperparams[hyperparam]
      changed_state = state._replace(hyperparams={
          **state.hyperparams, hyperparam: jnp.zeros_like(old) + value})
    else:
      changed_updates, changed_state = step(params, changed_state, _tree(grads))
  assert len(traces) == 1  # a new value of a hyperparameter is not a new program
  changed = _leaves((changed_updates, changed_state.inner_state))
  assert any(not np.allclose(a, b) for a, b in zip(changed, _leaves((updates, state.inner_state)))
             ), f'changing {case.injected} had no effect'


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16], ids=['float32', 'bfloat16'])
@pytest.mark.parametrize('name', CASE_NAMES)
def test_keeps_dtypes(name, dtype):
  opt = CASES[name].build_injected(hyperparam_dtype=jnp.float32)
  params = _tree(PARAMS, dtype)
  state = opt.init(params)
  for grads in GRADS[:2]:
    updates, state = jax.jit(opt.update)(_tree(grads, dtype), state, params)
    params = optax.apply_updates(params, updates)
  # The updates may be float32 where float32 hyperparameters meet them, as in optax's own rules;
  # the weights and the state the rule keeps between steps stay in the params' dtype.
  for leaf in jax.tree.leaves(params):
    assert leaf.dtype == dtype
  kept_state = [] if name.startswith('nesterov_asyncpp') else jax.tree_util.tree_leaves_with_path(
      state.inner_state)  # optax.nadamw's own moment takes the hyperparameters' dtype
  for path, leaf in kept_state:
    if jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.ndim:
      assert leaf.dtype == dtype, jax.tree_util.keystr(path)
  assert all(np.all(np.isfinite(np.asarray(leaf, np.float32))) for leaf in jax.tree.leaves(params))


@pytest.mark.parametrize('name', CASE_NAMES)
def test_accepts_extra_arguments(name):
  opt = CASES[name].build()
  params = _tree(PARAMS)
  state = opt.init(params)
  updates, new_state = opt.update(_tree(GRADS[0]), state, params, value=jnp.ones([]), key='x')
  expected_updates, expected_state = opt.update(_tree(GRADS[0]), state, params)
  _assert_close((updates, new_state), _leaves((expected_updates, expected_state)), 0, 0)


FROZEN = {
    # An inner rule that takes None gradients (optax.adamw does not).
    'delayed_error_feedback': lambda: optim.delayed_error_feedback(
        optim.sgd_sc(LR, 2, BETA), 2, smoothing=0.5),
    'scale_by_muon_sc': lambda: optim.scale_by_muon_sc(2),
}


@pytest.mark.parametrize('name', sorted(FROZEN))
def test_frozen_parameters_keep_their_state(name):
  opt = FROZEN[name]()
  params = _tree({'tall': PARAMS['tall'], 'wide': PARAMS['wide']})
  state = opt.init(params)
  grads = [{'tall': _tree(g['tall']), 'wide': _tree(g['wide'])} for g in GRADS[:2]]
  _, state = opt.update(grads[0], state, params)
  updates, new_state = opt.update(dict(grads[1], wide=None), state, params)
  assert updates['wide'] is None and updates['tall'] is not None
  assert jax.tree.structure(new_state) == jax.tree.structure(state)
  for old, new in zip(jax.tree.leaves(state), jax.tree.leaves(new_state)):
    if np.shape(old) == np.shape(PARAMS['wide']):  # the frozen leaf's slots
      np.testing.assert_array_equal(old, new)


# ------------------------------------------------------------------------------------------------
# Against numpy, over several steps with a delay.


def _run_delayed(opt, rule, steps, delay, view=None, rule_view=None):
  """Trains both on the loss ``sum(w**2 * c) / 2 + g_k . w`` whose gradient at step ``k`` is taken
  at the forward weights of ``delay`` steps earlier (the weights, or ``view`` of them, as a
  pipeline stage with that delay sees them); returns both trajectories (numpy leaves)."""
  curvature = [np.linspace(0.5, 2.0, np.size(p)).reshape(np.shape(p)) for p in
               jax.tree.leaves(PARAMS)]
  treedef = jax.tree.structure(PARAMS)

  def gradient(k, w):
    return [c * x + np.asarray(n, np.float64)
            for c, x, n in zip(curvature, w, jax.tree.leaves(GRADS[k % len(GRADS)]))]

  params = _tree(PARAMS)
  state = opt.init(params)
  rule.init([np.asarray(x, np.float64) for x in jax.tree.leaves(PARAMS)])
  w = [np.asarray(x, np.float64) for x in jax.tree.leaves(PARAMS)]
  ours, theirs = [_leaves(params)], [w]
  ours_forward, theirs_forward = [], []
  step = jax.jit(opt.update)
  for k in range(steps):
    ours_forward.append(_leaves(view(params, state) if view else params))
    theirs_forward.append(rule_view(w) if rule_view else w)
    source = max(k - delay, 0)
    grads_ours = jax.tree.unflatten(treedef, [jnp.asarray(x, jnp.float32)
                                              for x in gradient(k, ours_forward[source])])
    updates, state = step(grads_ours, state, params)
    params = optax.apply_updates(params, updates)
    w = rule.step(w, gradient(k, theirs_forward[source]))
    ours.append(_leaves(params))
    theirs.append(w)
  return ours, theirs, state


@pytest.mark.parametrize('smoothing', [0.0, 0.5])
def test_error_feedback_matches_numpy_with_a_delay(smoothing):
  delay = 2
  opt = optim.delayed_error_feedback(optax.adamw(LR, b1=BETA, b2=B2, weight_decay=DECAY), delay,
                                     smoothing=smoothing)
  rule = oracle.ErrorFeedback(oracle.Adam(LR, BETA, B2, weight_decay=DECAY), delay, smoothing)
  ours, theirs, state = _run_delayed(opt, rule, steps=8, delay=delay)
  for a, b in zip(ours, theirs):
    _assert_close(a, b, rtol=1e-4, atol=1e-6)
  virtual = optim.error_feedback_virtual_params(state, jax.tree.unflatten(
      jax.tree.structure(PARAMS), [jnp.asarray(x, jnp.float32) for x in ours[-1]]))
  _assert_close(virtual, rule.virtual_view(theirs[-1]), rtol=1e-4, atol=1e-6)
  assert not np.allclose(ours[-1][0], _run_plain_adam(delay)[-1][0])  # the correction acts


def _run_plain_adam(delay):
  return _run_delayed(optax.adamw(LR, b1=BETA, b2=B2, weight_decay=DECAY),
                      oracle.Adam(LR, BETA, B2, weight_decay=DECAY), steps=8, delay=delay)[0]


def test_error_feedback_virtual_iterate_is_the_undelayed_rule_on_the_same_gradients():
  """w - e follows the inner rule alone: with a rule whose step depends on the gradients only,
  the virtual iterate after any number of steps is where that rule would be."""
  inner = optax.adam(0.1, b1=0.5, b2=0.9)
  opt = optim.delayed_error_feedback(inner, delay=4)
  params = plain = _tree(PARAMS)
  state, plain_state = opt.init(params), inner.init(plain)
  for grads in GRADS:
    updates, state = opt.update(_tree(grads), state, params)
    params = optax.apply_updates(params, updates)
    plain_updates, plain_state = inner.update(_tree(grads), plain_state, plain)
    plain = optax.apply_updates(plain, plain_updates)
  _assert_close(optim.error_feedback_virtual_params(state, params), _leaves(plain), 1e-5, 1e-6)
  # ... and the weights lie D times the last step ahead of it.
  _assert_close(params, [p + 4 * u for p, u in zip(_leaves(plain), _leaves(plain_updates))],
                1e-5, 1e-6)


def test_error_feedback_for_a_one_step_delay_mixes_the_two_latest_updates():
  inner = optax.sgd(0.1)
  opt = optim.delayed_error_feedback(inner, delay=1)
  params = jnp.zeros(2)
  state = opt.init(params)
  previous = jnp.zeros(2)
  for g in _RNG.normal(size=(5, 2)).astype(np.float32):
    updates, state = opt.update(jnp.asarray(g), state, params)
    np.testing.assert_allclose(updates, 2 * (-0.1 * g) - previous, rtol=1e-6)
    previous = -0.1 * g


def test_error_feedback_without_delay_is_the_inner_rule_bit_for_bit():
  inner = optax.adamw(LR, weight_decay=DECAY)
  opt = optim.delayed_error_feedback(inner, delay=0)
  params = _tree(PARAMS)
  state, inner_state = opt.init(params), inner.init(params)
  for grads in GRADS[:4]:
    updates, state = opt.update(_tree(grads), state, params)
    expected, inner_state = inner.update(_tree(grads), inner_state, params)
    jax.tree.map(np.testing.assert_array_equal, updates, expected)
    params = optax.apply_updates(params, updates)


def test_error_feedback_converges_under_a_delay_where_it_helps():
  """A parabola under high momentum (0.9) with gradients 2 steps stale: plain delayed momentum at
  this rate diverges; with error feedback it converges. (At momentum 0.5 or none, the correction
  costs instead: it is no cure-all, and the study measures where it helps.)"""
  loss = lambda w: 0.5 * jnp.sum(jnp.array([1.0, 0.3]) * (w - jnp.array([1.0, -2.0]))**2)

  def final_distance(opt):
    @jax.jit
    def run(w):
      def body(carry, _):
        w, state = carry
        updates, state = opt.update(jax.grad(loss)(w), state, w)
        return (optax.apply_updates(w, updates), state), None
      return jax.lax.scan(body, (w, opt.init(w)), None, length=400)[0][0]
    return float(jnp.linalg.norm(run(jnp.array([3.0, 1.0])) - jnp.array([1.0, -2.0])))

  inner = optax.sgd(0.1, momentum=0.9)
  corrected = final_distance(optax.chain(optim.delay_gradients(2),
                                         optim.delayed_error_feedback(inner, 2)))
  plain = final_distance(optax.chain(optim.delay_gradients(2), inner))
  assert corrected < 1e-3 and plain > 1.0


def test_muon_sc_matches_numpy_with_a_delay():
  delay = 4
  opt = optim.muon_sc(**dict(_MUON_KWARGS, delay=delay))
  rule = oracle.Muon(LR, BETA, B2, weight_decay=DECAY, rms=0.2, delay=delay,
                     spike_compensation=True)
  ours, theirs, _ = _run_delayed(opt, rule, steps=6, delay=delay)
  for a, b in zip(ours, theirs):
    _assert_close(a, b, rtol=1e-4, atol=1e-5)
  uncompensated = _run_delayed(optim.muon_sc(**dict(_MUON_KWARGS, delay=0)),
                               oracle.Muon(LR, BETA, B2, weight_decay=DECAY), 6, delay)[0]
  assert not np.allclose(ours[-1][0], uncompensated[-1][0])


def test_muon_sc_with_prediction_matches_numpy_with_a_delay():
  """PB + Muon + SC + LWP: the forward runs on w + D (w - w_previous), the applied Muon step."""
  delay = 3
  opt = optim.linear_weight_prediction(optim.muon_sc(**dict(_MUON_KWARGS, delay=delay)),
                                       horizon=delay, outermost=True)
  rule = oracle.Muon(LR, BETA, B2, weight_decay=DECAY, rms=0.2, delay=delay,
                     spike_compensation=True)
  history = []

  def rule_view(w):
    last = [a - b for a, b in zip(w, history[-1])] if history else [np.zeros_like(x) for x in w]
    history.append(w)
    return [x + delay * u for x, u in zip(w, last)]

  ours, theirs, _ = _run_delayed(opt, rule, steps=6, delay=delay,
                                 view=lambda p, s: optim.predicted_params(s, p),
                                 rule_view=rule_view)
  for a, b in zip(ours, theirs):
    _assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_muon_sc_without_delay_is_optax_muon_as_pb_muon_builds_it():
  kwargs = dict(beta=BETA, eps=1e-8, weight_decay=DECAY, adam_b1=BETA, adam_b2=B2,
                adam_weight_decay=DECAY, consistent_rms=0.2)
  # Without consistent_rms both scale a step by Muon's width rule instead.
  for kwargs in (kwargs, {k: v for k, v in kwargs.items() if k != 'consistent_rms'}):
    ours, theirs = optim.muon_sc(LR, 0, **kwargs), optax.contrib.muon(LR, **kwargs)
    params = _tree(PARAMS)
    state, reference_state = ours.init(params), theirs.init(params)
    for grads in GRADS[:4]:
      updates, state = jax.jit(ours.update)(_tree(grads), state, params)
      expected, reference_state = jax.jit(theirs.update)(_tree(grads), reference_state, params)
      _assert_close(updates, _leaves(expected), rtol=1e-5, atol=1e-7)
      params = optax.apply_updates(params, updates)


@pytest.mark.parametrize('nesterov', [False, True])
def test_scale_by_adam_sc_without_delay_is_optax_scale_by_adam_bit_for_bit(nesterov):
  ours = optim.scale_by_adam_sc(0, BETA, B2, nesterov=nesterov)
  theirs = optax.scale_by_adam(BETA, B2, nesterov=nesterov)
  params = _tree(PARAMS)
  state, reference_state = ours.init(params), theirs.init(params)
  for grads in GRADS[:4]:
    updates, state = ours.update(_tree(grads), state)
    expected, reference_state = theirs.update(_tree(grads), reference_state)
    jax.tree.map(np.testing.assert_array_equal, updates, expected)


@pytest.mark.parametrize('nesterov', [False, True])
@pytest.mark.parametrize('delay', [1, 3])
def test_compensated_moment_gives_a_late_gradient_its_undelayed_weights(delay, nesterov):
  """Long after the start (bias corrections at 1), one gradient ``g`` computed at step ``s``.

  Undelayed EMA momentum applies it ``k`` steps later with the weight ``(1 - b) b**k``, and in
  Nesterov's form ``(1 - b)(1 + b)`` at once and ``(1 - b) b**(k + 1)`` after. Compensated and
  ``D`` steps late, it gets on arrival the sum of what it missed and its due, and from then on
  the undelayed weight of step ``D + j``.
  """
  b, count = 0.7, 10_000
  undelayed = [(1 - b) * (1 + b) if k == 0 else (1 - b) * b**(k + 1) for k in range(12)] \
      if nesterov else [(1 - b) * b**k for k in range(12)]
  mu, weights = jnp.zeros(()), []
  for j in range(6):
    g = jnp.ones(()) if j == 0 else jnp.zeros(())
    mu = b * mu + (1 - b) * g
    weights.append(float(compensated_first_moment(g, mu, b, count + j, delay, nesterov)))
  np.testing.assert_allclose(weights[0], sum(undelayed[:delay + 1]), rtol=1e-5)
  np.testing.assert_allclose(weights[1:], undelayed[delay + 1:delay + 6], rtol=1e-4)


def test_nesterov_asyncpp_as_released_is_nadamw_with_a_flat_momentum():
  opt = adam_family.nesterov_asyncpp(LR, 6, b1=0.99, b2=0.999, weight_decay=DECAY,
                                     adaptive_momentum=False, lr_correction=False)
  reference = optax.nadamw(LR, b1=0.99, b2=0.999, weight_decay=DECAY)
  rule = oracle.NAdam(LR, 0.99, 0.999, weight_decay=DECAY)  # no AsyncPP correction
  params = _tree(PARAMS)
  state, reference_state = opt.init(params), reference.init(params)
  rule.init(_leaves(params))
  w = _leaves(params)
  for grads in GRADS[:5]:
    updates, state = opt.update(_tree(grads), state, params)
    expected, reference_state = reference.update(_tree(grads), reference_state, params)
    jax.tree.map(np.testing.assert_array_equal, updates, expected)
    params = optax.apply_updates(params, updates)
    w = rule.step(w, _leaves(grads))
  _assert_close(params, w, rtol=1e-5, atol=1e-6)


def test_nesterov_asyncpp_with_torchs_nadam_matches_numpy_with_a_delay():
  """As released: PyTorch's NAdam (momentum warm-up 0.004), b1 0.99 flat, no rate correction."""
  opt = adam_family.nesterov_asyncpp(LR, 2, b1=0.99, b2=0.999, weight_decay=DECAY,
                                     adaptive_momentum=False, lr_correction=False,
                                     momentum_decay=0.004)
  rule = oracle.TorchNAdam(LR, 0.99, 0.999, 0.004, weight_decay=DECAY)
  ours, theirs, _ = _run_delayed(opt, rule, steps=8, delay=2)
  for a, b in zip(ours, theirs):
    _assert_close(a, b, rtol=1e-5, atol=1e-6)
  # Its momentum starts near b1 / 2: the first steps differ from optax's NAdamW at b1.
  dozat = _run_delayed(optax.nadamw(LR, b1=0.99, b2=0.999, weight_decay=DECAY),
                       oracle.NAdam(LR, 0.99, 0.999, weight_decay=DECAY), 8, 2)[0]
  assert not np.allclose(ours[-1][0], dozat[-1][0], rtol=1e-3)


@pytest.mark.parametrize('adaptive_momentum, lr_correction', [(True, False), (False, True)])
def test_nesterov_asyncpp_flags_turn_off_one_correction_each(adaptive_momentum, lr_correction):
  delay, max_delay, anneal = 4, 6, 10
  opt = adam_family.nesterov_asyncpp(
      LR, delay, max_delay if adaptive_momentum else None, anneal if lr_correction else None,
      b1=0.9, adaptive_momentum=adaptive_momentum, lr_correction=lr_correction)
  b1 = 0.9 + delay * (0.99 - 0.9) / (max_delay + 1) if adaptive_momentum else 0.9
  rate = ((lambda k: LR / delay ** (1 - min((k + 1) / anneal, 1.0))) if lr_correction else
          (lambda k: LR))
  reference = optax.nadamw(rate, b1=b1, weight_decay=0.0)  # optax's default decay is 1e-4
  params = _tree(PARAMS)
  state, reference_state = opt.init(params), reference.init(params)
  for grads in GRADS[:4]:
    updates, state = opt.update(_tree(grads), state, params)
    expected, reference_state = reference.update(_tree(grads), reference_state, params)
    _assert_close(updates, _leaves(expected), rtol=1e-5, atol=1e-9)


# ------------------------------------------------------------------------------------------------
# Weight views and bad input.


def test_virtual_params_find_the_state_nested_and_per_label():
  per_label = optax.multi_transform(
      {'ef': optim.delayed_error_feedback(optax.sgd(0.5), 2), 'plain': optax.sgd(0.5)},
      {'a': 'ef', 'b': 'plain'})
  opt = optax.chain(optax.clip(10.0), per_label)
  params = {'a': jnp.zeros(2), 'b': jnp.zeros(2)}
  state = opt.init(params)
  updates, state = opt.update({'a': jnp.ones(2), 'b': jnp.ones(2)}, state, params)
  params = optax.apply_updates(params, updates)
  virtual = optim.error_feedback_virtual_params(state, params)
  np.testing.assert_allclose(virtual['a'], [-0.5, -0.5])  # -1.5 less the error of -1
  np.testing.assert_allclose(virtual['b'], params['b'])  # no error feedback: as it is


BAD_INPUTS = {
    'ef inner uncalled': (lambda: optim.delayed_error_feedback(optax.adamw, 2),
                          r'did you mean adamw\(...\), called with its arguments'),
    'ef inner a number': (lambda: optim.delayed_error_feedback(0.1, 2),
                          'inner must be an optax GradientTransformation'),
    'ef negative delay': (lambda: optim.delayed_error_feedback(optax.sgd(0.1), -1),
                          r'delayed_error_feedback: delay must be in \[0, inf\)'),
    'ef fractional delay': (lambda: optim.delayed_error_feedback(optax.sgd(0.1), 1.5),
                            'whole number'),
    'ef smoothing 1': (lambda: optim.delayed_error_feedback(optax.sgd(0.1), 2, smoothing=1.0),
                       r'smoothing must be in \[0, 1\)'),
    'ef injected smoothing': (
        lambda: optax.inject_hyperparams(optim.delayed_error_feedback, static_args='inner')(
            inner=optax.sgd(0.1), delay=2, smoothing=-0.5).init(jnp.zeros(2)), 'smoothing'),
    'ef gradient shape': (
        lambda: optim.delayed_error_feedback(optax.sgd(0.1), 2).update(
            jnp.zeros(3), optim.delayed_error_feedback(optax.sgd(0.1), 2).init(jnp.zeros(2))),
        'delayed_error_feedback: the gradients must have the structure'),
    'virtual params without the state': (
        lambda: optim.error_feedback_virtual_params(optax.sgd(0.1).init(jnp.zeros(2)),
                                                    jnp.zeros(2)),
        'holds no delayed_error_feedback state'),
    'virtual params swapped': (
        lambda: optim.error_feedback_virtual_params(jnp.zeros(2), optim.delayed_error_feedback(
            optax.sgd(0.1), 1).init(jnp.zeros(2))), 'arguments are swapped'),
    'muon beta 1': (lambda: optim.muon_sc(0.1, 2, beta=1.0), r'muon_sc: beta must be in \[0, 1\)'),
    'muon delay': (lambda: optim.muon_sc(0.1, -2), 'muon_sc: delay'),
    'muon adam b2': (lambda: optim.muon_sc(0.1, 2, adam_b2=1.0), 'muon_sc: adam_b2'),
    'muon weight decay': (lambda: optim.muon_sc(0.1, 2, weight_decay=-1.0),
                          'muon_sc: weight_decay'),
    'muon rms': (lambda: optim.muon_sc(0.1, 2, consistent_rms=0.0), 'consistent_rms'),
    'muon learning rate': (lambda: optim.muon_sc(-0.1, 2), 'learning_rate'),
    'muon nesterov': (lambda: optim.muon_sc(0.1, 2, nesterov=1), 'nesterov must be a Python bool'),
    'muon coefficients': (lambda: optim.scale_by_muon_sc(2, ns_coeffs=(1.0, 2.0)),
                          'ns_coeffs must be a tuple of three'),
    'muon steps': (lambda: optim.scale_by_muon_sc(2, ns_steps=0), 'ns_steps'),
    'muon injected beta': (
        lambda: optax.inject_hyperparams(optim.muon_sc)(learning_rate=0.1, delay=2,
                                                        beta=1.5).init(PARAMS), 'beta'),
    'muon frozen': (
        lambda: optim.muon_sc(0.1, 2).update({'a': None, 'b': jnp.zeros(2)}, optim.muon_sc(
            0.1, 2).init({'a': jnp.zeros(2), 'b': jnp.zeros(2)})),
        'muon_sc: a None gradient'),
    'muon vector': (lambda: optim.scale_by_muon_sc(2).init(jnp.zeros(3)),
                    'every parameter must be a matrix'),
    'muon gradient shape': (
        lambda: optim.muon_sc(0.1, 2).update({'w': jnp.zeros((2, 2))},
                                             optim.muon_sc(0.1, 2).init({'w': jnp.zeros((2, 3))})),
        'muon_sc: the gradients must have the structure'),
    'muon params shape': (
        lambda: optim.muon_sc(0.1, 2, weight_decay=0.1).update(
            jnp.zeros(3), optim.muon_sc(0.1, 2).init(jnp.zeros(3)), jnp.zeros(1)),
        'muon_sc: params must have the structure'),
    'adam nesterov': (lambda: optim.scale_by_adam_sc(2, nesterov='yes'),
                      'nesterov must be a Python bool'),
    'asyncpp flag': (lambda: adam_family.nesterov_asyncpp(0.1, 2, adaptive_momentum=0,
                                                          lr_correction=False),
                     'adaptive_momentum must be a Python bool'),
    'asyncpp adaptive without max delay': (
        lambda: adam_family.nesterov_asyncpp(0.1, 2, lr_correction=False),
        'needs the pipeline.s largest delay: pass max_delay'),
    'asyncpp correction without anneal': (
        lambda: adam_family.nesterov_asyncpp(0.1, 2, 4, adaptive_momentum=True),
        'lr_correction=True needs anneal_steps'),
    'asyncpp flat with max delay': (
        lambda: adam_family.nesterov_asyncpp(0.1, 2, 4, adaptive_momentum=False,
                                             lr_correction=False),
        'max_delay .4. only sets the delay-dependent momentum'),
    'asyncpp flat with anneal': (
        lambda: adam_family.nesterov_asyncpp(0.1, 2, anneal_steps=10, adaptive_momentum=False,
                                             lr_correction=False),
        'anneal_steps .10. only sets the rate correction'),
    'asyncpp momentum decay': (
        lambda: adam_family.nesterov_asyncpp(0.1, 2, b1=0.99, adaptive_momentum=False,
                                             lr_correction=False, momentum_decay=-0.004),
        'momentum_decay must be in'),
    'asyncpp flat b1 1': (
        lambda: adam_family.nesterov_asyncpp(0.1, 2, b1=1.0, adaptive_momentum=False,
                                             lr_correction=False), r'b1 must be in \[0, 1\)'),
}


@pytest.mark.parametrize('name', sorted(BAD_INPUTS))
def test_bad_input_raises_a_clear_error(name):
  make, message = BAD_INPUTS[name]
  with pytest.raises(ValueError, match=message) as error:
    make()
  assert '\n' not in str(error.value)
