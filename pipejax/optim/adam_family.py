"""The Adam family of asynchronous-pipeline rules: PipeOptim's weight prediction, Nesterov AsyncPP,
and AdamW's weight-decay mask.

Each is built from optax's own Adam pieces (``optax.adamw``, ``optax.nadamw``), with the per-stage
quantities (horizon, delay) as numbers or jax arrays.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pipejax.optim import _checks

ASYNCPP_MOMENTUM_TARGET = 0.99  # the momentum the deepest delay approaches (AsyncPP)


def decay_mask(params: optax.Params) -> Any:
  """AdamW's weight-decay mask: decay matrices and embedding tables, not biases or norm scales.

  A leaf with two or more axes (dense kernels, embedding tables) is decayed; a vector (a bias, a
  LayerNorm scale or offset) is not, the rule of GPT-2-style training. Pass it as ``mask`` to
  ``optax.adamw``, ``optax.nadamw`` or ``optax.add_decayed_weights``.
  """
  return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


# ----------------------------------------------------------------------------- PipeOptim


class AdamPredictionState(NamedTuple):
  """State of :func:`adam_weight_prediction`."""

  count: jax.Array  # shape=(), dtype=int32: updates so far.
  inner_state: optax.OptState  # optax.adamw's, whose ScaleByAdamState the view reads
  step_size: jax.Array  # shape=(), float32: lr_t * s of the last update (0 before any)


def adam_weight_prediction(learning_rate: optax.ScalarOrSchedule, horizon: Any, b1: Any = 0.9,
                           b2: Any = 0.999, eps: Any = 1e-8, weight_decay: Any = 0.0,
                           mask: Any = None) -> optax.GradientTransformationExtraArgs:
  r"""AdamW whose forward pass runs on PipeOptim's prediction of the weights ``s`` steps ahead.

  The update is ``optax.adamw``'s. The forward weights (:func:`adam_predicted_params`) are

  .. math::

    \hat w_t = w_t - \eta_t\, s\, \frac{\hat m_t}{\sqrt{\hat v_t} + \epsilon}

  with :math:`\hat m_t, \hat v_t` Adam's bias-corrected moments after the last update,
  :math:`\eta_t` that update's learning rate and ``s`` the stage's horizon (its delay: the updates
  the weights will take before the gradient of this forward pass arrives). The decay term is not
  extrapolated, as in PipeOptim.

  Args:
    learning_rate: ``eta``, a float or an optax schedule of the step count.
    horizon: ``s >= 0``, usually the stage's delay ``D``; may be a jax array.
    b1, b2, eps: Adam's moment decays and epsilon.
    weight_decay: AdamW's decoupled weight decay.
    mask: the decay mask (e.g. :func:`decay_mask`), as ``optax.adamw`` takes it.

  Returns:
    A ``GradientTransformationExtraArgs`` with state :class:`AdamPredictionState`.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from pipejax.optim.adam_family import adam_predicted_params, adam_weight_prediction
    >>> tx = adam_weight_prediction(1e-2, horizon=4)
    >>> params = jnp.array([1.0, -2.0])
    >>> state = tx.init(params)
    >>> updates, state = tx.update(jnp.array([0.5, -0.5]), state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> [round(float(w), 4) for w in params]  # Adam's first step: lr in each coordinate
    [0.99, -1.99]
    >>> [round(float(w), 4) for w in adam_predicted_params(params, state)]  # four more steps
    [0.95, -1.95]

  References:
    Guan et al., `PipeOptim: Ensuring Effective 1F1B Schedule with Optimizer-Dependent Weight
    Prediction <https://arxiv.org/abs/2312.00839>`_ (code: guanleics/PipeOptim).
  """
  owner = "adam_weight_prediction"
  _checks.check_range(horizon, "horizon", owner, low=0)
  if not callable(learning_rate):
    _checks.check_range(learning_rate, "learning_rate", owner, low=0)
  _check_adam(b1, b2, eps, weight_decay, owner)
  inner = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=mask)

  def init_fn(params):
    return AdamPredictionState(count=jnp.zeros([], jnp.int32), inner_state=inner.init(params),
                               step_size=jnp.zeros([], jnp.float32))

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    moments = _checks.state_field("mu")(state.inner_state)
    _checks.check_gradients(updates, moments, owner)
    if params is not None:  # the decay would broadcast a parameter of shape () or (1,)
      _checks.check_params(params, moments, owner)
    updates, inner_state = inner.update(updates, state.inner_state, params)
    eta = learning_rate(state.count) if callable(learning_rate) else learning_rate
    step_size = _checks.at_least_float32(eta) * _checks.at_least_float32(horizon)
    return updates, AdamPredictionState(count=optax.safe_increment(state.count),
                                        inner_state=inner_state,
                                        step_size=jnp.asarray(step_size, jnp.float32))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _check_adam(b1: Any, b2: Any, eps: Any, weight_decay: Any, owner: str) -> None:
  """The ranges of AdamW's hyperparameters, as :func:`pipejax.optim.adam_sc` checks them: a decay
  of 1 divides by zero in the bias correction, a negative ``eps`` can too."""
  _checks.check_range(b1, "b1", owner, low=0, high=1, high_open=True)
  _checks.check_range(b2, "b2", owner, low=0, high=1, high_open=True)
  _checks.check_range(eps, "eps", owner, low=0)
  _checks.check_range(weight_decay, "weight_decay", owner, low=0)


def _find(tree: Any, kind: type, helper: str, provider: str):
  found = [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, kind))
           if isinstance(x, kind)]
  if len(found) != 1:
    raise ValueError(f"{helper}: the optimizer state must hold exactly one {kind.__name__} (from "
                     f"{provider}); found {len(found)}.")
  return found[0]


def adam_predicted_params(params: optax.Params, opt_state: optax.OptState, b1: Any = 0.9,
                          b2: Any = 0.999, eps: Any = 1e-8) -> optax.Params:
  """PipeOptim's forward weights ``w - eta s m_hat / (sqrt(v_hat) + eps)`` (see
  :func:`adam_weight_prediction`, whose ``b1``, ``b2``, ``eps`` must be given again here).

  ``params`` are the current weights and ``opt_state`` the state after the update that produced
  them; before any update the weights are returned unchanged.
  """
  helper, provider = "adam_predicted_params", "adam_weight_prediction"
  _check_adam(b1, b2, eps, 0.0, helper)
  state = _find(opt_state, AdamPredictionState, helper, provider)
  adam = _find(state.inner_state, optax.ScaleByAdamState, helper, provider)
  # Else a leaf of shape (1,) or () would broadcast into a prediction of the moments' shape.
  _checks.check_same_structure(params, adam.mu, "params", f"the weights {provider} was "
                               "initialised with", helper)
  count = jnp.maximum(adam.count, 1)  # before any update mu = nu = 0 and step_size = 0

  def predict(w, mu, nu):
    mu_hat = mu / (1 - jnp.asarray(b1, mu.dtype) ** count)
    nu_hat = nu / (1 - jnp.asarray(b2, nu.dtype) ** count)
    step = state.step_size.astype(w.dtype) * mu_hat / (jnp.sqrt(nu_hat) + eps)
    return (w - step).astype(w.dtype)

  return jax.tree.map(predict, params, adam.mu, adam.nu)


# ----------------------------------------------------------------------------- Nesterov AsyncPP


def asyncpp_momentum(b1: Any, delay: Any, max_delay: Any) -> Any:
  r"""AsyncPP's per-stage first-moment decay :math:`\beta_1 + \tau (0.99 - \beta_1) / S`.

  In the released code (PluralisResearch/AsyncPP, ``main_with_runtime.py``, ``--adaptive_momentum``)
  ``tau`` is the stage's number of weight versions minus one, its delay in a 1F1B pipeline, and
  ``S`` the number of stages, which there is the largest delay plus one. A fine-grained pipeline's
  delays are ``D_s = 2(S - 1 - s)``, so the same rule reads :math:`\tau = D_s` over
  ``max_delay + 1``: the deepest stage's momentum stays below 0.99, as in the original.
  """
  target = ASYNCPP_MOMENTUM_TARGET
  return b1 + delay * (target - b1) / (max_delay + 1)


def asyncpp_learning_rate(learning_rate: optax.ScalarOrSchedule, delay: Any,
                          anneal_steps: Any) -> optax.Schedule:
  r"""AsyncPP's delay correction of the learning rate: :math:`\eta_k / \tau^{1 - \min((k+1)/K, 1)}`.

  As ``adjust_learning_rate(..., lr_correction=True)`` of PluralisResearch/AsyncPP
  (``main_with_runtime.py``): the rate of the ``k``-th update (0-based) is divided by the stage's
  delay ``tau`` to a power that falls linearly from 1 to 0 over ``K`` updates; a stage without
  delay (``tau`` of 0 or 1, where the code skips the correction) keeps its rate.
  """
  tau = jnp.maximum(jnp.asarray(delay, jnp.float32), 1.0)

  def schedule(count):
    eta = learning_rate(count) if callable(learning_rate) else learning_rate
    progress = jnp.minimum((count + 1) / jnp.asarray(anneal_steps, jnp.float32), 1.0)
    return eta / tau ** (1.0 - progress)

  return schedule


def nesterov_asyncpp(learning_rate: optax.ScalarOrSchedule, delay: Any, max_delay: Any = None,
                     anneal_steps: Any = None, b1: Any = 0.9, b2: Any = 0.999, eps: Any = 1e-8,
                     weight_decay: Any = 0.0, mask: Any = None, *,
                     adaptive_momentum: bool = True, lr_correction: bool = True,
                     momentum_decay: Any = None) -> optax.GradientTransformationExtraArgs:
  r"""Nesterov-corrected asynchronous pipeline update (AsyncPP): NAdamW with per-stage settings.

  ``optax.nadamw`` with first-moment decay :func:`asyncpp_momentum` and learning rate
  :func:`asyncpp_learning_rate`; the pipeline pairs it with weight stashing (the backward uses
  the forward's weights), as the released code's ``NAdamWithWeightStashing`` does.

  **The two corrections are flags of the released code**, and its published run uses neither:
  ``run.bash`` of PluralisResearch/AsyncPP trains with ``--momentum 0.99`` (first-moment decay
  0.99 on every stage; ``--adaptive_momentum`` is commented out) and no ``--lr_correction``, with
  ``betas=(momentum, 0.999)``. ``adaptive_momentum=False`` uses ``b1`` on every stage as given
  (``max_delay`` is then not taken) and ``lr_correction=False`` the rate as given (no
  ``anneal_steps``); with both off this is ``optax.nadamw(learning_rate, b1, b2, eps,
  weight_decay=weight_decay, mask=mask)``, the stage's delay unused, so the released run is
  ``nesterov_asyncpp(lr, delay, b1=0.99, b2=0.999, adaptive_momentum=False,
  lr_correction=False)`` with weight stashing.

  The released code uses PyTorch's ``NAdam(decoupled_weight_decay=True, momentum_decay=0.004)``,
  whose momentum warms up as :math:`\beta_1 (1 - 0.5 \cdot 0.96^{0.004 t})` (0.57 after 1,000
  updates, 0.89 after 10,000 at :math:`\beta_1 = 0.99`); optax's NAdamW (Dozat's form), the
  default here, uses :math:`\beta_1` from the first step. ``momentum_decay=0.004`` gives
  PyTorch's rule instead (:func:`scale_by_torch_nadam`).

  Args:
    learning_rate: base ``eta``, a float or an optax schedule of the step count.
    delay: the stage's delay ``tau = D_s`` (int or jax array).
    max_delay: the pipeline's largest delay, ``2 (S - 1)``; required with ``adaptive_momentum``
      and refused without it.
    anneal_steps: ``K``, updates over which the learning-rate correction fades; required with
      ``lr_correction`` and refused without it.
    b1: first-moment decay: the base raised per stage toward 0.99 with ``adaptive_momentum``
      (then at most 0.99), every stage's otherwise.
    b2, eps: NAdamW's second-moment decay and epsilon.
    weight_decay: decoupled weight decay (scaled by the corrected rate, as in both codes).
    mask: the decay mask (e.g. :func:`decay_mask`).
    adaptive_momentum: raise ``b1`` with the stage's delay (a Python bool).
    lr_correction: divide the rate by a fading power of the delay (a Python bool).
    momentum_decay: None for optax's NAdamW, or PyTorch NAdam's ``momentum_decay >= 0``.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from pipejax.optim.adam_family import nesterov_asyncpp
    >>> tx = nesterov_asyncpp(1e-2, delay=4, max_delay=6, anneal_steps=100)
    >>> params = jnp.array([1.0, -2.0])
    >>> state = tx.init(params)
    >>> updates, state = tx.update(jnp.array([0.5, -0.5]), state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> bool(params[0] < 1.0 and params[1] > -2.0)  # a step against the gradient
    True

    As released (flat ``b1 = 0.99``, no rate correction, PyTorch's NAdam):

    >>> tx = nesterov_asyncpp(1e-2, delay=4, b1=0.99, adaptive_momentum=False,
    ...                       lr_correction=False, momentum_decay=0.004)

  References:
    Ajanthan et al., `Nesterov Method for Asynchronous Pipeline Parallel Optimization
    <https://arxiv.org/abs/2505.01099>`_, ICML 2025 (code: PluralisResearch/AsyncPP).
  """
  owner = "nesterov_asyncpp"
  for name, value in (("adaptive_momentum", adaptive_momentum),
                      ("lr_correction", lr_correction)):
    if not isinstance(value, bool):
      raise ValueError(f"{owner}: {name} must be a Python bool, got {value!r} "
                       f"({type(value).__name__}).")
  _checks.check_count(delay, "delay", owner)
  _check_adam(0.0, b2, eps, weight_decay, owner)
  _checks.check_learning_rate(learning_rate, owner)
  momentum = _checked_asyncpp_momentum(b1, delay, max_delay, adaptive_momentum, owner)
  if lr_correction:
    if anneal_steps is None:
      raise ValueError(f"{owner}: lr_correction=True needs anneal_steps, the updates over which "
                       "the rate correction fades; pass it, or lr_correction=False for the "
                       "released run's uncorrected rate.")
    _checks.check_range(anneal_steps, "anneal_steps", owner, low=1)
    learning_rate = asyncpp_learning_rate(learning_rate, delay, anneal_steps)
  elif anneal_steps is not None:
    raise ValueError(f"{owner}: anneal_steps ({anneal_steps!r}) only sets the rate correction, "
                     "which lr_correction=False turns off; leave it out.")
  if momentum_decay is None:
    nadamw = optax.nadamw(learning_rate, b1=momentum, b2=b2, eps=eps, weight_decay=weight_decay,
                          mask=mask)
  else:
    nadamw = optax.chain(scale_by_torch_nadam(momentum, b2, eps, momentum_decay),
                         optax.add_decayed_weights(weight_decay, mask),
                         optax.scale_by_learning_rate(learning_rate))
  return _checks.checking_gradients(nadamw, owner, _checks.state_field("mu"))


def _checked_asyncpp_momentum(b1: Any, delay: Any, max_delay: Any, adaptive_momentum: bool,
                              owner: str) -> Any:
  """The stage's first-moment decay of :func:`nesterov_asyncpp`, its arguments checked."""
  if not adaptive_momentum:
    if max_delay is not None:
      raise ValueError(f"{owner}: max_delay ({max_delay!r}) only sets the delay-dependent "
                       "momentum, which adaptive_momentum=False turns off; leave it out.")
    _checks.check_range(b1, "b1", owner, low=0, high=1, high_open=True)
    return b1
  if max_delay is None:
    raise ValueError(f"{owner}: adaptive_momentum=True raises each stage's b1 with its delay and "
                     "needs the pipeline's largest delay: pass max_delay=2 * (S - 1), or "
                     "adaptive_momentum=False for the released run's flat b1.")
  _checks.check_count(max_delay, "max_delay", owner)
  _checks.check_range(b1, "b1", owner, low=0, high=ASYNCPP_MOMENTUM_TARGET)
  # Arrays from optax.inject_hyperparams are compared too while concrete (at init).
  delay_value = _checks.scalar(delay, "delay", owner)
  max_delay_value = _checks.scalar(max_delay, "max_delay", owner)
  if delay_value is not None and max_delay_value is not None and delay_value > max_delay_value:
    raise ValueError(f"{owner}: delay ({delay_value}) cannot exceed the pipeline's largest delay "
                     f"max_delay ({max_delay_value}).")
  return asyncpp_momentum(b1, delay, max_delay)


class ScaleByTorchNAdamState(NamedTuple):
  """State of :func:`scale_by_torch_nadam`."""

  count: jax.Array  # shape=(), dtype=int32: updates so far.
  mu_product: jax.Array  # shape=(), float32: the product of the momenta used so far.
  mu: optax.Updates  # EMA of the gradients.
  nu: optax.Updates  # EMA of their squares.


def scale_by_torch_nadam(b1: Any = 0.9, b2: Any = 0.999, eps: Any = 1e-8,
                         momentum_decay: Any = 0.004) -> optax.GradientTransformationExtraArgs:
  r"""NAdam as PyTorch's ``torch.optim.NAdam`` computes it (no learning rate, no decay).

  At update :math:`t` (from 1), with :math:`\psi` the momentum decay:

  .. math::

    \mu_t = \beta_1 (1 - \tfrac12\, 0.96^{t\psi}), \quad
    m_t = \beta_1 m_{t-1} + (1 - \beta_1) g_t, \quad
    v_t = \beta_2 v_{t-1} + (1 - \beta_2) g_t^2,

    u_t = \Big(\frac{1 - \mu_t}{1 - \prod_{i \le t} \mu_i}\, g_t
    + \frac{\mu_{t+1}}{1 - \prod_{i \le t+1} \mu_i}\, m_t\Big)
    \Big/ \Big(\sqrt{v_t / (1 - \beta_2^t)} + \epsilon\Big)

  The momentum :math:`\mu_t` warms up from :math:`\beta_1 / 2` toward :math:`\beta_1` over about
  :math:`1 / \psi` updates (Dozat, 2016, as PyTorch has it). Chain it with
  ``optax.add_decayed_weights`` and ``optax.scale_by_learning_rate`` for PyTorch's
  ``NAdam(decoupled_weight_decay=True)``. A ``None`` gradient leaf gives a ``None`` update.

  Args:
    b1: the EMA's decay :math:`\beta_1`, in ``[0, 1)``.
    b2: the second moment's decay, in ``[0, 1)``.
    eps: added to the denominator, ``>= 0``.
    momentum_decay: :math:`\psi \ge 0`; PyTorch's default is 0.004.

  Returns:
    A ``GradientTransformationExtraArgs`` whose state is a :class:`ScaleByTorchNAdamState`.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from pipejax.optim.adam_family import scale_by_torch_nadam
    >>> tx = optax.chain(scale_by_torch_nadam(b1=0.99), optax.scale_by_learning_rate(0.1))
    >>> params = jnp.array([1.0, -1.0])
    >>> state = tx.init(params)
    >>> updates, state = tx.update(jnp.array([2.0, -2.0]), state, params)
    >>> optax.apply_updates(params, updates)  # 0.1 (1 + mu_2 / (1 - mu_1 mu_2) 0.01) sign(g)
    Array([ 0.8993447, -0.8993447], dtype=float32)

  References:
    Dozat, `Incorporating Nesterov Momentum into Adam
    <https://openreview.net/forum?id=OM0jvwB8jIp57ZJjtNEZ>`_, ICLR 2016 workshop;
    PyTorch's ``torch.optim.NAdam``.
  """
  owner = "scale_by_torch_nadam"
  _check_adam(b1, b2, eps, 0.0, owner)
  _checks.check_range(momentum_decay, "momentum_decay", owner, low=0)

  def init_fn(params):
    return ScaleByTorchNAdamState(count=jnp.zeros([], jnp.int32),
                                  mu_product=jnp.ones([], jnp.float32),
                                  mu=optax.tree_utils.tree_zeros_like(params),
                                  nu=optax.tree_utils.tree_zeros_like(params))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    _checks.check_gradients(updates, state.mu, owner)
    count = optax.safe_increment(state.count)
    t, beta, psi = (jnp.asarray(count, jnp.float32), _checks.at_least_float32(b1),
                    _checks.at_least_float32(momentum_decay))
    momentum = beta * (1 - 0.5 * 0.96**(t * psi))
    momentum_next = beta * (1 - 0.5 * 0.96**((t + 1) * psi))
    product = state.mu_product * momentum
    gradient_scale = (1 - momentum) / (1 - product)
    moment_scale = momentum_next / (1 - product * momentum_next)
    second_correction = 1 - _checks.at_least_float32(b2)**t
    mu = optax.tree_utils.tree_update_moment(updates, state.mu, b1, 1)
    nu = optax.tree_utils.tree_update_moment_per_elem_norm(updates, state.nu, b2, 2)

    def step(g, m, v):
      scale = lambda x: jnp.asarray(x, v.dtype)
      return ((scale(gradient_scale) * g + scale(moment_scale) * m)
              / (jnp.sqrt(v / scale(second_correction)) + eps)).astype(g.dtype)

    keep = lambda new, old: optax.tree_utils.tree_cast_like(
        _checks.keep_where_no_gradient(updates, new, old), old)
    return _checks.map_gradients(step, updates, mu, nu), ScaleByTorchNAdamState(
        count=count, mu_product=jnp.asarray(product, jnp.float32), mu=keep(mu, state.mu),
        nu=keep(nu, state.nu))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
