"""Training under a schedule's gradient delays, in a plain optax loop.

:func:`pipejax.schedules.delay_profile` gives each stage's delay D_s; :func:`stale_optimizer`
puts :func:`pipejax.optim.delay_gradients` with D_s in front of the optimizer of stage s
(``optax.multi_transform`` over the list of per-stage weights), and :func:`train` runs momentum
SGD with it on a pipejax model.

This emulates **staleness only**: every gradient is computed on one set of weights and then
applied D_s updates late. That is exactly what PipeDream's weight stashing gives (forward and
backward use the same, stashed, weights); fine-grained PB also has weight inconsistency (its
backward uses newer weights than its forward), which this loop does not model; the engine
(``pipejax.core.engine.Pipeline``) runs PB itself.

Example:
  >>> import optax
  >>> from pipejax import schedules
  >>> from pipejax.analysis import staleness
  >>> delays = schedules.delay_profile('pipedream', num_stages=3)
  >>> delays
  [2, 1, 0]
  >>> tx = staleness.stale_optimizer(delays, lambda: optax.sgd(0.01, momentum=0.9))
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipejax import models, optim, schedules
from pipejax.core import stages
from pipejax.data import fashion_mnist
from pipejax.core.stages import Model


def stale_optimizer(delays: Sequence[int],
                    make_optimizer: Callable[[], optax.GradientTransformation]
                    ) -> optax.GradientTransformation:
  """An optimizer for a list of per-stage weights whose stage s sees gradients D_s steps late."""
  transforms = {f"stage{s}": optax.chain(optim.delay_gradients(int(d)), make_optimizer())
                for s, d in enumerate(delays)}

  def labels(params):
    if len(params) != len(delays):
      raise ValueError(f"{len(delays)} delays for {len(params)} stages of weights; pass one "
                       "delay per stage (schedules.delay_profile(name, num_stages=...)).")
    return [jax.tree.map(lambda _, s=s: f"stage{s}", p) for s, p in enumerate(params)]

  return optax.multi_transform(transforms, labels)


def train(model: Model, delays: Sequence[int], train_data: tuple[np.ndarray, np.ndarray],
          test_data: tuple[np.ndarray, np.ndarray], *, learning_rate: float, momentum: float,
          micro_batch: int, epochs: int = 1, seed: int = 0) -> float:
  """Trains ``model`` with per-stage gradient delays; returns the test accuracy.

  One update per micro-batch, as in the pipelines; ``seed`` sets the initial weights and the
  order of the training examples.
  """
  images, labels = train_data
  steps = epochs * (len(images) // micro_batch)
  rng = np.random.default_rng(seed)
  order = np.concatenate([rng.permutation(len(images)) for _ in range(epochs)])
  order = order[:steps * micro_batch].reshape(steps, micro_batch)
  xs = jnp.asarray(images[order])
  ys = jnp.asarray(labels[order])

  key = jax.random.key(seed)
  params, x = [], xs[0]
  for stage, k in zip(model.stages, jax.random.split(key, model.num_stages)):
    params.append(stage.init(k, x))
    x = stage.apply(params[-1], x, None)
  tx = stale_optimizer(delays, lambda: optax.sgd(learning_rate, momentum=momentum))
  step = stages.plain_step(model, tx)
  (params, _), _ = jax.jit(lambda c, xs, ys: jax.lax.scan(step, c, (xs, ys)))(
      (params, tx.init(params)), xs, ys)
  test_images, test_labels = test_data
  logits = jax.jit(model.apply)(params, jnp.asarray(test_images))
  return float(jnp.mean(jnp.argmax(logits, -1) == jnp.asarray(test_labels)))


class StalenessError(ValueError):
  """Settings under which the staleness table cannot train as asked; the message says why."""


def check_settings(num_stages: int, *, train_samples: int, seeds: Sequence[int],
                   learning_rate: float, momentum: float, micro_batch: int, epochs: int) -> int:
  """Refuses settings that would train nothing or no stage of the pipeline; returns the run's
  updates. Checked before a schedule is simulated (which takes minutes for a hundred stages) or
  the data are loaded."""
  for name, value in (("train_micro_batch", micro_batch), ("epochs", epochs),
                      ("num_stages", num_stages)):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
      raise StalenessError(f"--{name} must be an integer >= 1; got {value!r}.")
  updates = epochs * (train_samples // micro_batch)
  if updates < 1:
    raise StalenessError(f"--train_samples={train_samples} with --train_micro_batch="
                         f"{micro_batch} makes no update: give at least {micro_batch} training "
                         "samples.")
  if num_stages > updates:
    raise StalenessError(f"--num_stages={num_stages} is more stages than the run's {updates} "
                         f"updates (--epochs x --train_samples / --train_micro_batch): a "
                         "schedule's deepest stage would receive none of its delayed gradients. "
                         "Give fewer stages or a longer run.")
  if not seeds or any(isinstance(s, bool) or not isinstance(s, numbers.Integral) or
                      not 0 <= s < 2**32 for s in seeds):
    raise StalenessError(f"--seeds must be one or more integers in [0, 2**32); got {seeds!r}.")
  if not (math.isfinite(learning_rate) and learning_rate >= 0 and 0 <= momentum < 1):
    raise StalenessError(f"--learning_rate must be a finite number >= 0 and --momentum in [0, 1); "
                         f"got {learning_rate!r} and {momentum!r}.")
  return updates


def check_delays(schedule: str, delays: Sequence[int], updates: int) -> None:
  """Refuses a schedule whose longest delay reaches the run's end: that stage would never be
  updated, and its accuracy would say nothing of staleness."""
  if max(delays) >= updates:
    raise StalenessError(f"Schedule {schedule!r} delays stage {list(delays).index(max(delays))}'s "
                         f"gradients by {max(delays)} updates, but the run makes only {updates}: "
                         "that stage would never be updated. Give a longer run (--epochs, "
                         "--train_samples) or fewer stages.")


def schedule_accuracies(schedules_: Sequence[str], num_stages: int, micro_batches: int, *,
                        train_samples: int, seeds: Sequence[int], learning_rate: float,
                        momentum: float, micro_batch: int, epochs: int) -> list[dict]:
  """Fashion-MNIST test accuracy of an MLP (one dense layer + LayerNorm + ReLU per stage)
  trained under each schedule's delays (:func:`pipejax.schedules.delay_profile`), per seed.

  Returns one row per schedule: ``schedule``, ``delays`` and ``test_accuracy`` (one per seed).
  """
  check_settings(num_stages, train_samples=train_samples, seeds=seeds, learning_rate=learning_rate,
                 momentum=momentum, micro_batch=micro_batch, epochs=epochs)
  if not schedules_:
    raise StalenessError(f"--schedules names no schedule; give one or more of "
                         f"{', '.join(schedules.NAMES)}.")
  delays_of = {name: schedules.delay_profile(name, num_stages, micro_batches)
               for name in schedules_}
  train_source, test_source = fashion_mnist.load_fashion_mnist_idx()
  mean, std = fashion_mnist.NORMALIZATION.mean[0], fashion_mnist.NORMALIZATION.std[0]

  def prepare(source, n):
    images, labels = source.take(np.arange(min(n, len(source))))
    return (images.astype(np.float32) - mean) / std, labels

  train_data = prepare(train_source, train_samples)
  test_data = prepare(test_source, len(test_source))
  updates = epochs * (len(train_data[0]) // micro_batch)  # the split may hold fewer samples
  for name, delays in delays_of.items():
    check_delays(name, delays, updates)
  rows = []
  for name, delays in delays_of.items():
    accuracies = [
        train(models.build("mlp", hidden=(128,) * (num_stages - 1), normalization="layer"),
              delays, train_data, test_data, learning_rate=learning_rate, momentum=momentum,
              micro_batch=micro_batch, epochs=epochs, seed=seed)
        for seed in seeds]
    rows.append({"schedule": name, "delays": delays, "test_accuracy": accuracies})
  return rows

