"""The shared suite of :mod:`pipejax.optim`: every transformation through the same checks (jit
without recompiling, convergence on a parabola and on Rosenbrock's function,
optax.inject_hyperparams, dtypes, extra arguments, frozen parameters), and the package's
docstrings. Each module's own identities are in its own file (``test_spike.py``, ...).
"""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import inspect
import pkgutil
from typing import Any, Callable

import jax
import jax.numpy as jnp
import chex
import optax
import pytest
from absl.testing import parameterized

from pipejax import optim
from pipejax.optim import (adam_sc, delay_gradients, linear_weight_prediction, pipemare,
                           pipemare_discrepancy, predicted_params, scale_by_adam_sc, sgd_sc,
                           spike_compensation)
from tests.optim.common import (PARAMS, GRADS, tree, assert_trees_close, trees_differ,
                                current_weights, trajectory, frozen)


# ------------------------------------------------------------------------------------------------
# Problems and helpers.


def parabola(w):
  curvatures = jnp.array([1.0, 0.3])
  return 0.5 * jnp.sum(curvatures * (w - jnp.array([1.0, -2.0]))**2)


def rosenbrock(w):
  return (1.0 - w[0])**2 + 100.0 * (w[1] - w[0]**2)**2


@dataclasses.dataclass(frozen=True)
class Problem:
  loss: Callable[[jax.Array], jax.Array]
  start: tuple[float, float]
  optimum: tuple[float, float]
  steps: int
  tolerance: float  # on the distance to the optimum at the end


PROBLEMS = {
    'parabola': Problem(parabola, (3.0, 1.0), (1.0, -2.0), steps=300, tolerance=1e-3),
    # Delayed momentum must keep lr * lambda_max / (1 - m) below about 1 / D, and the valley's
    # curvature is 2500 times smaller than lambda_max ~ 1000, hence the small rate and many steps
    # (a scan of 20k steps of a 2-vector takes well under a second).
    'rosenbrock': Problem(rosenbrock, (0.0, 0.0), (1.0, 1.0), steps=20_000, tolerance=1e-2),
}


@dataclasses.dataclass(frozen=True)
class Setting:
  """Hyperparameters of a convergence run: the delay is the gradients' staleness."""

  learning_rate: float
  delay: int
  momentum: float


DEFAULT_SETTINGS = {
    'parabola': Setting(learning_rate=0.05, delay=2, momentum=0.9),
    'rosenbrock': Setting(learning_rate=1e-4, delay=2, momentum=0.9),
}


def _delay_line(setting: Setting) -> list[optax.GradientTransformation]:
  return [delay_gradients(setting.delay)] if setting.delay else []


def _nothing(setting: Setting) -> list[optax.GradientTransformation]:
  del setting
  return []


def _predicted_weights(params, opt_state):
  return predicted_params(opt_state, params)


@dataclasses.dataclass(frozen=True)
class Case:
  """One transformation under the shared checks.

  The convergence runs use ``chain(*head(setting), factory(**kwargs(setting)), *tail(setting))``
  and take each gradient at ``view(params, opt_state)``; the other checks use the factory alone.
  """

  factory: Callable[..., optax.GradientTransformation]
  kwargs: Callable[[Setting], dict[str, Any]]
  # A numeric hyperparameter to inject and a new value for it (None: it has none).
  injected: tuple[str, Any] | None
  head: Callable[[Setting], list] = _delay_line
  tail: Callable[[Setting], list] = _nothing
  view: Callable[[Any, Any], Any] = current_weights
  settings: dict[str, Setting] = dataclasses.field(default_factory=lambda: DEFAULT_SETTINGS)
  static_args: tuple[str, ...] = ()

  def optimizer(self, setting: Setting) -> optax.GradientTransformation:
    return optax.chain(*self.head(setting), self.factory(**self.kwargs(setting)),
                       *self.tail(setting))


def _learning_rate_after(setting):
  return [optax.scale_by_learning_rate(setting.learning_rate)]


CASES = {
    'spike_compensation': Case(
        spike_compensation,
        lambda s: dict(delay=s.delay, momentum=s.momentum),
        injected=('momentum', 0.5),
        tail=_learning_rate_after),
    'sgd_sc': Case(
        sgd_sc,
        lambda s: dict(learning_rate=s.learning_rate, delay=s.delay, momentum=s.momentum),
        injected=('learning_rate', 0.01)),
    'scale_by_adam_sc': Case(
        scale_by_adam_sc,
        # b2 = 0.999 is 1.0 in bfloat16, which inject_hyperparams would give it (and be refused).
        lambda s: dict(delay=s.delay, b1=s.momentum, b2=0.99),
        injected=('b1', 0.5),
        tail=_learning_rate_after,
        settings={'parabola': Setting(0.05, 2, 0.9), 'rosenbrock': Setting(1e-3, 2, 0.9)}),
    'adam_sc': Case(
        adam_sc,
        lambda s: dict(learning_rate=s.learning_rate, delay=s.delay, b1=s.momentum, b2=0.99,
                       weight_decay=0.0),
        injected=('delay', 5),
        settings={'parabola': Setting(0.05, 2, 0.9), 'rosenbrock': Setting(1e-3, 2, 0.9)}),
    'lwp_update': Case(
        linear_weight_prediction,
        lambda s: dict(inner=sgd_sc(s.learning_rate, s.delay, s.momentum), horizon=s.delay,
                       form='update'),
        injected=('horizon', 5),
        view=_predicted_weights),
    'lwp_velocity': Case(
        linear_weight_prediction,
        lambda s: dict(inner=lambda rate: optax.sgd(rate, momentum=s.momentum),
                       horizon=s.delay, form='velocity', learning_rate=s.learning_rate),
        injected=('learning_rate', 1.0),
        view=_predicted_weights,
        static_args=('inner',)),
    'delay_gradients': Case(
        delay_gradients,
        lambda s: dict(delay=s.delay),
        injected=None,
        head=_nothing,  # It is the delay line.
        tail=lambda s: [optax.sgd(s.learning_rate, momentum=s.momentum)],
        settings={'parabola': Setting(0.05, 2, 0.5), 'rosenbrock': Setting(5e-4, 1, 0.5)},
        static_args=('delay',)),
    'pipemare': Case(
        pipemare,
        lambda s: dict(learning_rate=s.learning_rate, delay=s.delay, momentum=s.momentum,
                       anneal_steps=100),
        injected=('learning_rate', 0.01),
        # After annealing PipeMare is plain delayed momentum, stable only for smaller lr * D.
        settings={'parabola': Setting(0.02, 2, 0.9), 'rosenbrock': Setting(1e-4, 1, 0.9)}),
    'pipemare_discrepancy': Case(
        pipemare_discrepancy,
        lambda s: dict(gamma=0.9),
        injected=('gamma', 0.5),
        head=lambda s: [optax.sgd(s.learning_rate, momentum=s.momentum)],  # Must come last.
        settings={'parabola': Setting(0.05, 0, 0.9), 'rosenbrock': Setting(5e-4, 0, 0.9)}),
}


CASE_NAMES = sorted(CASES)


def _bare(case: Case) -> optax.GradientTransformationExtraArgs:
  return optax.with_extra_args_support(case.factory(**case.kwargs(case.settings['parabola'])))


def _injected(case: Case, hyperparam_dtype=None) -> optax.GradientTransformationExtraArgs:
  return optax.inject_hyperparams(case.factory, static_args=case.static_args,
                                  hyperparam_dtype=hyperparam_dtype)(
                                      **case.kwargs(case.settings['parabola']))


# ------------------------------------------------------------------------------------------------
# The shared suite.


@pytest.mark.parametrize('name', CASE_NAMES)
def test_jit_matches_eager_and_does_not_recompile(name):
  opt = _bare(CASES[name])
  traces = []

  @jax.jit
  def step(params, state, grads):
    traces.append(None)  # Runs once per trace, not per call.
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params, state = tree(PARAMS), opt.init(tree(PARAMS))
  eager_params, eager_state = params, state
  for grads in GRADS[:3]:
    params, state = step(params, state, tree(grads))
    updates, eager_state = opt.update(tree(grads), eager_state, eager_params)
    eager_params = optax.apply_updates(eager_params, updates)
  assert len(traces) == 1
  assert_trees_close(params, eager_params, rtol=1e-5, atol=1e-6)
  assert_trees_close(state, eager_state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('problem_name', sorted(PROBLEMS))
@pytest.mark.parametrize('name', CASE_NAMES)
def test_converges(name, problem_name):
  case, problem = CASES[name], PROBLEMS[problem_name]
  opt = case.optimizer(case.settings[problem_name])
  gradient = jax.grad(problem.loss)
  history = trajectory(opt, lambda t, w: gradient(w), jnp.array(problem.start), problem.steps,
                       view=case.view)
  distance = float(jnp.linalg.norm(history[-1] - jnp.array(problem.optimum)))
  assert distance < problem.tolerance, (
      f'{name} ended {distance:.3g} from the optimum of {problem_name}')


@pytest.mark.parametrize('name', CASE_NAMES)
def test_inject_hyperparams(name):
  case = CASES[name]
  opt, reference = _injected(case), _bare(case)
  traces = []

  @jax.jit
  def step(params, state, grads):
    traces.append(None)
    return opt.update(grads, state, params)

  params = tree(PARAMS)
  state, reference_state = opt.init(params), reference.init(params)
  changed_state = state
  for i, grads in enumerate(GRADS[:3]):
    updates, state = step(params, state, tree(grads))
    reference_updates, reference_state = reference.update(tree(grads), reference_state, params)
    # Injected arrays and plain Python numbers give the same updates.
    assert_trees_close(updates, reference_updates, rtol=1e-5, atol=1e-6)
    if case.injected is not None:
      changed_updates, changed_state = step(params, changed_state, tree(grads))
      if i == 0:
        hyperparam, new_value = case.injected
        old = changed_state.hyperparams[hyperparam]
        # jit's cache keys on weak types too (inject_hyperparams leaves ints weakly typed), so
        # the new value keeps the old one's dtype and weak type: zeros_like + value does both.
        changed_state = changed_state._replace(hyperparams={
            **changed_state.hyperparams, hyperparam: jnp.zeros_like(old) + new_value})
  assert len(traces) == 1  # Changing a hyperparameter's value does not retrace.
  if case.injected is not None:
    assert trees_differ((changed_updates, changed_state.inner_state),
                        (updates, state.inner_state)), f'changing {case.injected} had no effect'


@pytest.mark.parametrize('injected', [False, True], ids=['plain', 'injected'])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16], ids=['float32', 'bfloat16'])
@pytest.mark.parametrize('name', CASE_NAMES)
def test_keeps_dtypes(name, dtype, injected):
  case = CASES[name]
  opt = _injected(case) if injected else _bare(case)
  params = tree(PARAMS, dtype)
  step = jax.jit(opt.update)
  state = opt.init(params)
  for grads in GRADS[:2]:
    updates, state = step(tree(grads, dtype), state, params)
    params = optax.apply_updates(params, updates)
  for leaf in jax.tree.leaves(updates) + jax.tree.leaves(params):
    assert leaf.dtype == dtype
  for path, leaf in jax.tree_util.tree_leaves_with_path(state):
    if jax.tree_util.keystr(path).endswith('.horizon'):  # a float32 scalar, like a step count
      chex.assert_shape(leaf, ())
    elif jnp.issubdtype(leaf.dtype, jnp.floating):
      assert leaf.dtype == dtype, jax.tree_util.keystr(path)
    else:
      assert leaf.dtype == jnp.int32, jax.tree_util.keystr(path)


@pytest.mark.parametrize('name', CASE_NAMES)
def test_accepts_extra_arguments(name):
  opt = _bare(CASES[name])
  params = tree(PARAMS)
  state = opt.init(params)
  updates, new_state = opt.update(tree(GRADS[0]), state, params, value=jnp.ones([]), key='x')
  expected_updates, expected_state = opt.update(tree(GRADS[0]), state, params)
  assert_trees_close((updates, new_state), (expected_updates, expected_state), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# Every transformation as a library: frozen parameters (chex.variants).


class LibraryTest(chex.TestCase):
  """The transformations as a library: frozen leaves."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      # Last: whether the state keeps its structure (optax.trace swaps a frozen leaf's for None).
      ('sgd_sc', lambda: sgd_sc(0.1, 2, 0.9, weight_decay=0.01), True),
      ('sgd_sc_nesterov', lambda: sgd_sc(0.1, 2, 0.9, nesterov=True), True),
      ('spike_compensation', lambda: spike_compensation(2, 0.9), True),
      ('adam_sc', lambda: adam_sc(0.1, 2), True),
      ('pipemare', lambda: pipemare(0.1, 2, 0.9, anneal_steps=10), False),
      ('pipemare_discrepancy', lambda: optax.chain(optax.sgd(0.1), pipemare_discrepancy()), True),
      ('delay_gradients', lambda: optax.chain(delay_gradients(2), optax.sgd(0.1)), True),
      ('lwp', lambda: linear_weight_prediction(sgd_sc(0.1, 2, 0.9), 2), True),
      ('lwp_outermost', lambda: linear_weight_prediction(sgd_sc(0.1, 2, 0.9), 2, outermost=True),
       True),
      ('lwp_next_velocity', lambda: linear_weight_prediction(
          lambda rate: sgd_sc(rate, 2, 0.9), 2, form='next_velocity', learning_rate=0.1,
          momentum=0.9), True),
  )
  def test_frozen_parameters_as_none_gradients(self, build, keeps_structure):
    """A None gradient leaf gives a None update; the other leaves move as without the leaf."""
    opt = build()
    params = tree(PARAMS)
    grads = [frozen(tree(g), 'b') for g in GRADS]
    update = self.variant(opt.update)
    state = opt.init(params)
    structure = jax.tree.structure(state)
    alone_params = {'w': params['w']}
    alone_state = opt.init(alone_params)
    for g in grads:
      updates, state = update(g, state, params)
      assert updates['b'] is None
      if keeps_structure:  # so that a lax.scan carry can hold it
        assert jax.tree.structure(state) == structure
      alone_updates, alone_state = opt.update({'w': g['w']}, alone_state, alone_params)
      chex.assert_trees_all_close(updates['w'], alone_updates['w'], rtol=1e-6, atol=1e-7)
      params = {**params, 'w': params['w'] + updates['w']}  # apply_updates refuses None updates
      alone_params = optax.apply_updates(alone_params, alone_updates)


# ------------------------------------------------------------------------------------------------
# Documentation.


# Every public module of pipejax.optim, so that a new one cannot be missed.
@pytest.mark.parametrize('module_name', sorted(
    m.name for m in pkgutil.iter_modules(optim.__path__) if not m.name.startswith('_')))
def test_docstring_examples_run(module_name):
  # By import path: the package re-exports a function named like its module (pipemare).
  module = importlib.import_module(f'pipejax.optim.{module_name}')
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert result.failed == 0
  # Every 'Example:' section holds examples doctest really ran (a missing '>>>' would skip one).
  with_examples = [t for t in doctest.DocTestFinder().find(module) if t.examples]
  assert result.attempted > 0
  assert len(with_examples) == inspect.getsource(module).count('Example:')


TRANSFORMATIONS = ('adam_sc', 'adam_weight_prediction', 'delay_compensation', 'delay_gradients',
                   'delayed_error_feedback', 'float32_state', 'linear_weight_prediction', 'muon_sc',
                   'nesterov_asyncpp', 'pipemare', 'pipemare_discrepancy', 'scale_by_adam_sc',
                   'scale_by_muon_sc', 'scale_by_torch_nadam', 'sgd_sc', 'spike_compensation')


@pytest.mark.parametrize('name', TRANSFORMATIONS + ('predicted_params', 'pipemare_backward_params',
                                                     'error_feedback_virtual_params'))
def test_docstring_examples_train_a_toy_problem(name):
  # A training step as optax's own docstrings show one: init, update, apply_updates.
  examples = [e.source for t in doctest.DocTestFinder().find(getattr(optim, name), name)
              for e in t.examples]
  for call in ('.init(', '.update(', 'optax.apply_updates('):
    assert any(call in source for source in examples), f'{name} shows no {call}'


def test_every_transformation_is_in_the_list_above():
  returns_one = [name for name in optim.__all__ if inspect.isfunction(getattr(optim, name)) and
                 'GradientTransformation' in str(inspect.signature(getattr(optim, name)))]
  assert sorted(returns_one) == sorted(TRANSFORMATIONS)


def test_public_api_is_reexported():
  for name in optim.__all__:
    assert hasattr(optim, name), name
