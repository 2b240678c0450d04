r"""Batch-size scaling rules: carry a recipe tuned at batch ``B`` over to batch ``b``.

Fine-grained Pipelined Backpropagation trains with tiny batches (often one sample), while the
published hyperparameters were tuned for batches of hundreds. Kosson et al. (2021) convert them by
keeping what each *sample* does to the weights fixed (docs/design.md §4):

* the momentum's half-life in samples: :math:`m_b = m_B^{\,b/B}` (``B/b`` steps of ``m_b`` decay the
  trace as much as one step of ``m_B``), and likewise Adam's second-moment decay
  :math:`\beta_{2,b} = \beta_{2,B}^{\,b/B}`;
* each sample's total displacement. In the heavy-ball form (``v <- m v + g``, ``w <- w - eta v``) a
  gradient moves the weights by :math:`\eta/(1-m)` in total, and one step's gradient is the mean
  over ``b`` samples, so a sample moves them by :math:`\eta/(b(1-m))`:

  .. math::  \frac{\eta_b}{b(1-m_b)} = \frac{\eta_B}{B(1-m_B)}
             \quad\Longrightarrow\quad \eta_b = \eta_B\,\frac{b}{B}\,\frac{1-m_b}{1-m_B}

  In the EMA form (``v <- m v + (1-m) g``) the total is :math:`\eta` per step and
  :math:`\eta/b` per sample, so :math:`\eta_b = \eta_B\,b/B`.

**Weight decay.** Keep each sample's total shrinkage. In the library's conventions the decay always
rides on the same learning rate that carries the displacement rule, and so it stays unchanged:

* heavy-ball form, *coupled* decay (``g <- g + lambda w`` before the momentum, as in
  :func:`~pipejax.optim.sgd_sc` and ``optax.sgd`` with ``add_decayed_weights``): the term goes
  through the momentum like a gradient, so a step shrinks ``w`` by a fraction
  :math:`\eta\lambda/(1-m)` and a sample by :math:`\eta\lambda/(b(1-m))`. Keeping this with the
  displacement rule gives :math:`\lambda_b = \lambda_B`. (It is an L2 term of the loss, and the
  loss's gradients scale correctly by construction.)
* EMA form, *decoupled* decay scaled by the learning rate (``w <- w - eta (u + lambda w)``, as in
  ``optax.adamw`` and :func:`~pipejax.optim.adam_sc`): a step shrinks by :math:`\eta\lambda`, a
  sample by :math:`\eta\lambda/b`; with :math:`\eta_b = \eta_B b/B` this again gives
  :math:`\lambda_b = \lambda_B`.

(Other conventions would change: decay decoupled from the momentum but multiplied by ``eta`` in
the heavy-ball form needs :math:`\lambda_b = \lambda_B (1-m_B)/(1-m_b)`, and decay not multiplied by
any learning rate needs :math:`\lambda_b = \lambda_B\, b/B`. These rules hold to first order in
:math:`\eta\lambda`, which is tiny in practice.)

Schedules must be kept in samples (or epochs), not steps: convert their lengths with
:func:`steps_for_samples`.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Literal

from pipejax.optim import _checks

_FORMS = ('heavy_ball', 'ema')


def _check_batch_size(batch_size, owner: str) -> int:
  return _checks.check_static_int(batch_size, 'batch_size', owner, minimum=1)


@dataclasses.dataclass(frozen=True)
class Recipe:
  """Hyperparameters of momentum training at one batch size.

  Attributes:
    batch_size: samples per step, ``>= 1``.
    learning_rate: ``eta > 0``.
    momentum: ``m`` in ``[0, 1)``.
    weight_decay: ``lambda >= 0`` (coupled for heavy-ball, decoupled lr-scaled for EMA form; see
      the module docstring).
    form: ``'heavy_ball'`` (``v <- m v + g``, optax.sgd) or ``'ema'``
      (``v <- m v + (1 - m) g``, Adam's first moment).
    b2: Adam's second-moment decay in ``[0, 1)`` (optax's ``b2``), kept in samples like the
      momentum; a heavy-ball recipe carries it unused.
  """

  batch_size: int
  learning_rate: float
  momentum: float
  weight_decay: float = 0.0
  form: Literal['heavy_ball', 'ema'] = 'heavy_ball'
  b2: float = 0.999

  def __post_init__(self):
    _check_batch_size(self.batch_size, 'Recipe')
    for name in ('learning_rate', 'momentum', 'weight_decay', 'b2'):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f'Recipe: {name} must be a Python number, got {value!r}.')
    _checks.check_range(self.learning_rate, 'learning_rate', 'Recipe', low=0, low_open=True)
    _checks.check_range(self.momentum, 'momentum', 'Recipe', low=0, high=1, high_open=True)
    _checks.check_range(self.weight_decay, 'weight_decay', 'Recipe', low=0)
    _checks.check_range(self.b2, 'b2', 'Recipe', low=0, high=1, high_open=True)
    if self.form not in _FORMS:
      raise ValueError(f'Recipe: form must be one of {_FORMS}, got {self.form!r}.')


def scale_recipe(recipe: Recipe, batch_size: int) -> Recipe:
  r"""The recipe at ``batch_size`` that trains like ``recipe`` per sample.

  .. math::

    m_b = m_B^{\,b/B}, \qquad \beta_{2,b} = \beta_{2,B}^{\,b/B}, \qquad
    \eta_b = \eta_B\,\frac{b}{B}\,\frac{1 - m_b}{1 - m_B}\ \text{(heavy ball)}, \qquad
    \eta_b = \eta_B\,\frac{b}{B}\ \text{(EMA)}, \qquad \lambda_b = \lambda_B

  (derivations in the module docstring). Scaling to ``b`` and back to ``B`` returns the recipe up
  to rounding.

  Args:
    recipe: the reference recipe at batch ``B``.
    batch_size: the new batch size ``b >= 1``.

  Returns:
    The scaled :class:`Recipe`.

  Raises:
    ValueError: if ``batch_size`` is not a positive int.

  Example:
    >>> from pipejax.optim import Recipe, scale_recipe
    >>> small = scale_recipe(Recipe(batch_size=128, learning_rate=0.1, momentum=0.9), 1)
    >>> print(f'{small.momentum:.5f} {small.learning_rate:.3g}')
    0.99918 6.43e-06

  References:
    Kosson et al., `Pipelined Backpropagation at Scale: Training Large Models without Batches
    <https://arxiv.org/abs/2003.11666>`_, MLSys 2021.
  """
  batch_size = _check_batch_size(batch_size, 'scale_recipe')
  ratio = batch_size / recipe.batch_size
  momentum = recipe.momentum**ratio
  learning_rate = recipe.learning_rate * ratio
  if recipe.form == 'heavy_ball':
    learning_rate *= (1 - momentum) / (1 - recipe.momentum)
  return dataclasses.replace(recipe, batch_size=batch_size, learning_rate=learning_rate,
                             momentum=momentum, b2=recipe.b2**ratio)


def steps_for_samples(num_samples: int, batch_size: int) -> int:
  """Steps needed to process ``num_samples`` at ``batch_size`` (a last partial batch counts).

  Keep schedule lengths (warm-up, decay boundaries, PipeMare's annealing) in samples and convert
  them with this, so that they mean the same at every batch size.

  Args:
    num_samples: samples, an int ``>= 0``.
    batch_size: samples per step, an int ``>= 1``.

  Returns:
    ``ceil(num_samples / batch_size)``.

  Example:
    >>> from pipejax.optim import steps_for_samples
    >>> steps_for_samples(50_000, 128)
    391
  """
  num_samples = _checks.check_static_int(num_samples, 'num_samples', 'steps_for_samples')
  batch_size = _check_batch_size(batch_size, 'steps_for_samples')
  return -(-num_samples // batch_size)  # Integer ceiling: exact for any size.
