r"""Muon with Spike Compensation: Muon's momentum applies a late gradient as if it had been on time.

Muon (Jordan, 2024) keeps an EMA momentum of each matrix's gradients, in Nesterov's form, and steps
along its orthogonalised direction (a Newton-Schulz iteration toward :math:`UV^\top` of the
momentum's SVD). Spike Compensation (Kosson et al., 2021) is a rule for the momentum, so it goes
where the momentum is formed, before the orthogonalisation: ``optax.contrib.muon`` offers no
place there, hence :func:`scale_by_muon_sc`, which forms the compensated moment and
orthogonalises it, and :func:`muon_sc`, the whole rule with ``optax.contrib.muon``'s split (Muon on
every matrix, NAdamW on every other leaf, the latter's first moment compensated too).

Linear Weight Prediction along the applied step needs nothing new:
``linear_weight_prediction(muon_sc(...), horizon=D, outermost=True)``, with
:func:`~pipejax.optim.predicted_params` as the forward's weights.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pipejax.optim import _checks
from pipejax.optim.spike import compensated_first_moment, scale_by_adam_sc

# Jordan's quintic: the coefficients of optax.contrib.muon's default ('standard').
DEFAULT_NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
_MUON, _ADAM = 'muon', 'adam'


class ScaleByMuonSCState(NamedTuple):
  """State of :func:`scale_by_muon_sc`."""

  count: jax.Array  # shape=(), dtype=int32: updates so far.
  mu: optax.Updates  # Muon's EMA momentum, before bias correction.


def newton_schulz(x: jax.Array, coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
                  steps: int = 5, eps: Any = 1e-8) -> jax.Array:
  r"""Muon's quintic Newton-Schulz map of a matrix toward the orthogonal factor of its SVD.

  .. math::

    X_0 = \frac{X}{\lVert X \rVert_F + \epsilon}, \qquad
    X_{k+1} = a X_k + (b A_k + c A_k^2) X_k, \quad A_k = X_k X_k^\top

  on the wide orientation (a tall matrix is transposed and back), as ``optax.contrib.muon`` with
  its default Frobenius preconditioning.

  Args:
    x: a matrix.
    coefficients: ``(a, b, c)``.
    steps: the number of iterations (an int or a jax array).
    eps: added to the norm.

  Returns:
    A matrix of ``x``'s shape whose singular values lie near 1.

  Example:
    >>> import jax.numpy as jnp
    >>> from pipejax.optim.muon_sc import newton_schulz
    >>> x = newton_schulz(jnp.array([[3.0, 0.0], [0.0, 0.5]]))
    >>> bool(jnp.all(jnp.abs(jnp.diag(x) - 1) < 0.35))  # both singular values pulled near 1
    True
  """
  dtype = x.dtype
  transposed = x.shape[0] > x.shape[1]
  if transposed:
    x = x.T
  x = (x / (jnp.linalg.norm(x) + eps)).astype(dtype)  # an injected eps is a float32 array
  a, b, c = (jnp.asarray(k, dtype) for k in coefficients)

  def step(_, x):
    gram = x @ x.T
    return a * x + (b * gram + c * gram @ gram) @ x

  # A loop, not unrolled Python: under optax.inject_hyperparams the number of steps is traced.
  steps = int(steps) if _checks.is_concrete_number(steps) else jnp.asarray(steps, jnp.int32)
  x = jax.lax.fori_loop(0, steps, step, x)
  return x.T if transposed else x


def _check_coefficients(ns_coeffs: Any, owner: str) -> tuple[float, float, float]:
  if (not isinstance(ns_coeffs, (tuple, list)) or len(ns_coeffs) != 3 or
      not all(isinstance(k, numbers.Real) and not isinstance(k, bool) for k in ns_coeffs)):
    raise ValueError(f'{owner}: ns_coeffs must be a tuple of three Python numbers (a, b, c) of '
                     f'the quintic Newton-Schulz step, got {ns_coeffs!r}.')
  return tuple(float(k) for k in ns_coeffs)


def _check_muon(delay: Any, beta: Any, eps: Any, nesterov: Any, owner: str) -> None:
  _checks.check_count(delay, 'delay', owner)
  _checks.check_range(beta, 'beta', owner, low=0, high=1, high_open=True)
  _checks.check_range(eps, 'eps', owner, low=0)
  if not isinstance(nesterov, bool):
    raise ValueError(f'{owner}: nesterov must be a Python bool, got {nesterov!r} '
                     f'({type(nesterov).__name__}).')


def scale_by_muon_sc(delay: Any, beta: Any = 0.95, eps: Any = 1e-8,
                     ns_coeffs: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
                     ns_steps: int = 5, nesterov: bool = True,
                     mu_dtype: Any = None) -> optax.GradientTransformationExtraArgs:
  r"""Muon's orthogonalised momentum, the momentum spike-compensated for a delay of ``D``.

  .. math::

    \mu_t = \beta\,\mu_{t-1} + (1 - \beta)\,g_t, \qquad
    u_t = \mathrm{NS}\Big(\beta^{D+1}\,\frac{\mu_t}{1 - \beta^{t+D+1}}
    + (1 - \beta^{D+1})\,\frac{g_t}{1 - \beta^{t+D}}\Big)

  in Nesterov's form (the default, as ``optax.contrib.muon``), or
  :math:`\mathrm{NS}(\beta^D \mu_t / (1 - \beta^t) + (1 - \beta^D) g_t)` without it
  (:func:`~pipejax.optim.spike.compensated_first_moment`), with :func:`newton_schulz` as NS.
  Compensation is the EMA form of the paper's rule for momentum SGD (:func:`~pipejax.optim.sgd_sc`)
  as :func:`~pipejax.optim.scale_by_adam_sc` states it, a step further ahead for Nesterov: from
  its arrival on, a late gradient's share of the momentum is what undelayed momentum would have
  given it, and on arrival it also pays what it missed. The orthogonalisation is not linear, so
  the steps follow undelayed Muon's only as far as the momentum they are made from does.

  With ``delay=0`` this is ``optax.contrib.scale_by_muon(ns_coeffs, ns_steps, beta, eps,
  mu_dtype, nesterov=nesterov)``. Every leaf must be a matrix (:func:`muon_sc` routes the others
  to NAdamW). A ``None`` gradient leaf gives a ``None`` update and keeps its momentum.

  Args:
    delay: gradient delay ``D >= 0`` of the stage, a whole number (may be a jax array).
    beta: the momentum's decay, in ``[0, 1)``.
    eps: added to the Frobenius norm before the iteration, ``>= 0``.
    ns_coeffs: the quintic's ``(a, b, c)``.
    ns_steps: Newton-Schulz iterations, a whole number ``>= 1`` (may be a jax array).
    nesterov: Nesterov's form of the momentum (a Python bool).
    mu_dtype: dtype of the momentum (None: the params').

  Returns:
    A ``GradientTransformationExtraArgs`` whose state is a :class:`ScaleByMuonSCState`.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from pipejax.optim import scale_by_muon_sc
    >>> opt = optax.chain(scale_by_muon_sc(delay=2), optax.scale_by_learning_rate(0.1))
    >>> params = jnp.zeros((2, 2))
    >>> state = opt.init(params)
    >>> updates, state = opt.update(jnp.array([[1.0, 0.0], [0.0, 1.0]]), state, params)
    >>> params = optax.apply_updates(params, updates)  # -0.1 times a matrix close to orthogonal
    >>> bool(jnp.all(jnp.abs(jnp.diag(params) + 0.1) < 0.035))
    True

  References:
    Jordan, `Muon: An optimizer for hidden layers in neural networks
    <https://kellerjordan.github.io/posts/muon/>`_, 2024;
    Kosson et al., `Pipelined Backpropagation at Scale: Training Large Models without Batches
    <https://arxiv.org/abs/2003.11666>`_, MLSys 2021.
  """
  owner = 'scale_by_muon_sc'
  _check_muon(delay, beta, eps, nesterov, owner)
  coefficients = _check_coefficients(ns_coeffs, owner)
  _checks.check_count(ns_steps, 'ns_steps', owner)
  _checks.check_range(ns_steps, 'ns_steps', owner, low=1)
  mu_dtype = _checks.canonicalize_dtype(mu_dtype, 'mu_dtype', owner)

  def init_fn(params):
    shapes = [jnp.shape(p) for p in jax.tree.leaves(params)]
    if any(len(shape) != 2 for shape in shapes):
      raise ValueError(f'{owner}: every parameter must be a matrix (Muon orthogonalises 2-D '
                       f'leaves), got the shapes {shapes}. Use muon_sc, which gives every other '
                       'leaf NAdamW.')
    return ScaleByMuonSCState(count=jnp.zeros([], jnp.int32),
                              mu=optax.tree_utils.tree_zeros_like(params, dtype=mu_dtype))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    _checks.check_gradients(updates, state.mu, owner)
    mu = optax.tree_utils.tree_update_moment(updates, state.mu, beta, 1)
    count = optax.safe_increment(state.count)
    mu_hat = compensated_first_moment(updates, mu, beta, count, delay, nesterov)
    orthogonal = _checks.map_gradients(
        lambda g, m: newton_schulz(m, coefficients, ns_steps, eps), updates, mu_hat)
    return orthogonal, ScaleByMuonSCState(
        count=count, mu=optax.tree_utils.tree_cast_like(
            _checks.keep_where_no_gradient(updates, mu, state.mu), state.mu))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _scale_by_shape(consistent_rms: Any) -> optax.GradientTransformation:
  """``optax.contrib.muon``'s scaling of a matrix's step: ``sqrt(max(rows, cols)) * rms``, or,
  without ``consistent_rms``, ``sqrt(max(1, cols / rows))``."""

  def scale(u):
    rows, cols = u.shape
    factor = (jnp.sqrt(max(rows, cols)) * consistent_rms if consistent_rms is not None
              else jnp.sqrt(max(1.0, cols / rows)))
    return (factor * u).astype(u.dtype)

  def update_fn(updates, state, params=None):
    del params
    return _checks.map_gradients(scale, updates), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def _labels(params: optax.Params) -> Any:
  return jax.tree.map(lambda p: _MUON if jnp.ndim(p) == 2 else _ADAM, params)


def _first_moments(state: optax.OptState) -> Any:
  """From :func:`muon_sc`'s state, a tree with the params' structure and shapes."""
  inner = state.inner_states
  muon_mu = inner[_MUON].inner_state[0].mu
  adam_mu = inner[_ADAM].inner_state[0].mu
  masked = lambda x: isinstance(x, optax.MaskedNode)
  return jax.tree.map(lambda m, a: a if masked(m) else m, muon_mu, adam_mu, is_leaf=masked)


def muon_sc(learning_rate: optax.ScalarOrSchedule, delay: Any, beta: Any = 0.95, eps: Any = 1e-8,
            weight_decay: Any = 0.0, mu_dtype: Any = None, *, nesterov: bool = True,
            adam_b1: Any = 0.9, adam_b2: Any = 0.999, adam_weight_decay: Any = 0.0,
            consistent_rms: Any = None,
            ns_coeffs: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
            ns_steps: int = 5) -> optax.GradientTransformationExtraArgs:
  r"""Muon with Spike Compensation on both of its momenta: the per-stage rule of PB + Muon + SC.

  Every matrix (a leaf of two axes) takes :func:`scale_by_muon_sc`, its step scaled by the shape
  rule of ``optax.contrib.muon`` (``sqrt(max(rows, cols)) * consistent_rms``, or
  ``sqrt(max(1, cols / rows))`` without ``consistent_rms``), decoupled weight decay and the
  learning rate:

  .. math::

    w \leftarrow w - \eta\,\big(s\,u_t + \lambda w\big)

  Every other leaf takes NAdamW whose first moment is compensated the same way
  (:func:`~pipejax.optim.scale_by_adam_sc` with ``nesterov``), with ``adam_b1``, ``adam_b2``,
  ``eps``, ``adam_weight_decay`` and the same learning rate. Both are the EMA form of the
  paper's Spike Compensation, ``D + 1`` steps ahead for Nesterov's momentum. With ``delay=0`` it is
  ``optax.contrib.muon`` with the same arguments; the split is its default one. Like it, it takes
  no ``None`` gradient leaves (frozen parameters), and says so.

  Args:
    learning_rate: ``eta``, a float or an optax schedule of the step count.
    delay: gradient delay ``D >= 0`` of the stage, a whole number (may be a jax array).
    beta: Muon's momentum decay, in ``[0, 1)``.
    eps: Newton-Schulz's and NAdamW's epsilon, ``>= 0``.
    weight_decay: the matrices' decoupled weight decay, ``>= 0``.
    mu_dtype: dtype of both first moments (None: the params').
    nesterov: Nesterov's form of both momenta (a Python bool).
    adam_b1: NAdamW's first-moment decay, in ``[0, 1)``.
    adam_b2: NAdamW's second-moment decay, in ``[0, 1)``.
    adam_weight_decay: the other leaves' decoupled weight decay, ``>= 0``.
    consistent_rms: the RMS a matrix's step is scaled to (0.2 matches AdamW's; Liu et al., 2025),
      or None for Muon's width scaling.
    ns_coeffs: the quintic Newton-Schulz step's ``(a, b, c)``.
    ns_steps: Newton-Schulz iterations, a whole number ``>= 1``.

  Returns:
    ``optax.partition`` of the two chains (its state too), whose ``update`` first checks that the
    gradients and params fit the params of ``init``.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from pipejax.optim import muon_sc
    >>> opt = muon_sc(1e-2, delay=4, beta=0.9, adam_b1=0.9, consistent_rms=0.2)
    >>> params = {'kernel': jnp.zeros((3, 3)), 'bias': jnp.zeros(3)}
    >>> state = opt.init(params)
    >>> grads = {'kernel': jnp.eye(3), 'bias': jnp.ones(3)}
    >>> updates, state = opt.update(grads, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> # NAdam's first step against the gradient, 1.13 lr here (optax's NAdam: 1.47 lr, D = 0)
    >>> [round(float(b), 4) for b in params['bias']]
    [-0.0113, -0.0113, -0.0113]

  References:
    Jordan, `Muon: An optimizer for hidden layers in neural networks
    <https://kellerjordan.github.io/posts/muon/>`_, 2024;
    Liu et al., `Muon is Scalable for LLM Training <https://arxiv.org/abs/2502.16982>`_, 2025;
    Kosson et al., `Pipelined Backpropagation at Scale: Training Large Models without Batches
    <https://arxiv.org/abs/2003.11666>`_, MLSys 2021.
  """
  owner = 'muon_sc'
  _check_muon(delay, beta, eps, nesterov, owner)
  _checks.check_learning_rate(learning_rate, owner)
  _checks.check_range(weight_decay, 'weight_decay', owner, low=0)
  _checks.check_range(adam_b1, 'adam_b1', owner, low=0, high=1, high_open=True)
  _checks.check_range(adam_b2, 'adam_b2', owner, low=0, high=1, high_open=True)
  _checks.check_range(adam_weight_decay, 'adam_weight_decay', owner, low=0)
  if consistent_rms is not None:
    _checks.check_range(consistent_rms, 'consistent_rms', owner, low=0, low_open=True)
  muon = optax.chain(
      scale_by_muon_sc(delay, beta, eps, ns_coeffs, ns_steps, nesterov, mu_dtype),
      _scale_by_shape(consistent_rms),
      optax.add_decayed_weights(weight_decay),
      optax.scale_by_learning_rate(learning_rate))
  adam = optax.chain(
      scale_by_adam_sc(delay, adam_b1, adam_b2, eps, mu_dtype=mu_dtype, nesterov=nesterov),
      optax.add_decayed_weights(adam_weight_decay),
      optax.scale_by_learning_rate(learning_rate))
  partition = optax.partition({_MUON: muon, _ADAM: adam}, _labels)
  # optax.add_decayed_weights would broadcast a parameter of shape () or (1,) into the update.
  checked = _checks.checking_gradients(partition, owner, _first_moments)

  def update_fn(updates, state, params=None, **extra_args):
    if any(g is None for g in jax.tree.leaves(updates, is_leaf=_checks.is_none)):
      raise ValueError(f'{owner}: a None gradient (a frozen parameter) cannot be split between '
                       'Muon and NAdamW (optax.partition, as in optax.contrib.muon, needs every '
                       'leaf); give frozen parameters zero gradients, or leave them out of the '
                       'params this optimizer sees.')
    return checked.update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(checked.init, update_fn)
