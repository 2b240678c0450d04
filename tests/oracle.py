"""A deliberately naive reference for the pipeline (docs/design.md §2): the tests' ground truth.

Python loops over ticks and stages; a dict per stage from sample index to stashed input; the full
history of each stage's weights; no ring buffers, no scan, no optax. Update rules and weight views
are written out in numpy from the formulas of docs/design.md §3, so the engine and its optax
transformations are checked against an independent statement of the same mathematics.

Stages with state: a dict per stage from sample index to the forward variables its forward saw
(what the recompute uses), and the live variables: the forward updates the forward variables, the
backward adds the increment its VJP returns to the backward variables, both at the end of the tick.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pipejax.core.stages import Variables

# ----------------------------------------------------------------------------- update rules


@dataclasses.dataclass
class Momentum:
  """Heavy ball v <- m v + g, w <- w - lr * u with u = a v + b g (Spike Compensation when sc)."""

  lr: float
  momentum: float
  delay: int = 0
  spike_compensation: bool = False

  def init(self, w):
    self.v = [np.zeros_like(x) for x in w]
    self.count = 0

  def step(self, w, g):
    m, d = self.momentum, self.delay
    a, b = (m ** d, (1 - m ** d) / (1 - m)) if self.spike_compensation else (1.0, 0.0)
    self.v = [m * v + gi for v, gi in zip(self.v, g)]
    self.last_gradient = g
    self.count += 1
    return [wi - self.lr * (a * v + b * gi) for wi, v, gi in zip(w, self.v, g)]


@dataclasses.dataclass
class DelayCompensated(Momentum):
  """DC-ASGD: g <- g + lam g*g*(w_now - w_then), then heavy-ball momentum."""

  strength: float = 0.04
  needs_gradient_weights = True

  def step(self, w, g, gradient_weights):
    g = [gi + self.strength * gi * gi * (wi - wt) for gi, wi, wt in zip(g, w, gradient_weights)]
    return super().step(w, g)


@dataclasses.dataclass
class Adam:
  """AdamW written out (bias-corrected moments, decoupled decay); Spike Compensation on the
  bias-corrected first moment when sc: u = b1^D mu_hat + (1 - b1^D) g.

  ``lr``: a number, or a function of the step's index from 0 (a schedule): the k-th update
  (k = 1, 2, ...) takes lr(k - 1), the decay term as well as the Adam step.
  """

  lr: float | Callable[[int], float]
  b1: float
  b2: float
  delay: int = 0
  spike_compensation: bool = False
  eps: float = 1e-8
  weight_decay: float = 0.0
  decay_mask: bool = False  # decay only leaves of 2+ axes (no biases, no norm scales)

  def init(self, w):
    self.mu = [np.zeros_like(x) for x in w]
    self.nu = [np.zeros_like(x) for x in w]
    self.count = 0

  def step(self, w, g):
    self.count += 1
    b1, b2, k = self.b1, self.b2, self.count
    self.mu = [b1 * m + (1 - b1) * gi for m, gi in zip(self.mu, g)]
    self.nu = [b2 * n + (1 - b2) * gi * gi for n, gi in zip(self.nu, g)]
    a = b1 ** self.delay if self.spike_compensation else 1.0
    first = [a * m / (1 - b1 ** k) + (1 - a) * gi for m, gi in zip(self.mu, g)]
    return [wi - self.rate() * (f / (np.sqrt(n / (1 - b2 ** k)) + self.eps)
                                + decay_of(wi, self.weight_decay, self.decay_mask))
            for wi, f, n in zip(w, first, self.nu)]

  def rate(self):
    """The learning rate of the last update counted."""
    return rate_at(self.lr, self.count - 1)

  def forward_view(self, w, horizon):
    """PipeOptim's prediction w - lr s m_hat / (sqrt(v_hat) + eps) after the last step."""
    if not self.count:
      return w
    b1, b2, k = self.b1, self.b2, self.count
    return [wi - self.rate() * horizon * (m / (1 - b1 ** k)) / (np.sqrt(n / (1 - b2 ** k))
                                                                + self.eps)
            for wi, m, n in zip(w, self.mu, self.nu)]


def rate_at(lr, index):
  """``lr`` at the update of index ``index`` from 0: a number, or a schedule of that index."""
  return lr(index) if callable(lr) else lr


def decay_of(w, weight_decay, masked):
  """AdamW's decoupled decay term of one leaf; a masked decay spares vectors."""
  return 0.0 if masked and w.ndim < 2 else weight_decay * w


@dataclasses.dataclass
class NAdam:
  """NAdamW (Dozat's Nesterov Adam as optax.nadamw has it), with AsyncPP's per-stage settings.

  m <- b1 m + (1 - b1) g, v <- b2 v + (1 - b2) g^2 at step k;
  m_hat = b1 m / (1 - b1^(k+1)) + (1 - b1) g / (1 - b1^k), v_hat = v / (1 - b2^k);
  w <- w - lr_k (m_hat / (sqrt(v_hat) + eps) + decay).
  asyncpp: b1 <- b1 + D (0.99 - b1) / (D_max + 1), lr_k = lr / max(D, 1)^(1 - min(k/K, 1)).
  spike_compensation: Dozat's m_hat D + 1 steps ahead, a = b1^(D+1):
  m_hat = a m / (1 - b1^(k+D+1)) + (1 - a) g / (1 - b1^(k+D)).
  """

  lr: float | Callable[[int], float]  # a schedule of the step's index from 0, or a number
  b1: float
  b2: float
  delay: int = 0
  max_delay: int = 0
  anneal_steps: int | None = None  # None: no AsyncPP correction (plain NAdamW)
  eps: float = 1e-8
  weight_decay: float = 0.0
  decay_mask: bool = False
  spike_compensation: bool = False

  def init(self, w):
    if self.anneal_steps is not None:
      self.b1 = self.b1 + self.delay * (0.99 - self.b1) / (self.max_delay + 1)
    self.mu = [np.zeros_like(x) for x in w]
    self.nu = [np.zeros_like(x) for x in w]
    self.count = 0

  def direction(self, g):
    """Advances the moments by gradient ``g``; returns m_hat / (sqrt(v_hat) + eps)."""
    self.count += 1
    b1, b2, k = self.b1, self.b2, self.count
    self.mu = [b1 * m + (1 - b1) * gi for m, gi in zip(self.mu, g)]
    self.nu = [b2 * n + (1 - b2) * gi * gi for n, gi in zip(self.nu, g)]
    first = [nesterov_moment(m, gi, b1, k, self.delay if self.spike_compensation else 0)
             for m, gi in zip(self.mu, g)]
    return [f / (np.sqrt(n / (1 - b2 ** k)) + self.eps) for f, n in zip(first, self.nu)]

  def step(self, w, g):
    lr = rate_at(self.lr, self.count)
    if self.anneal_steps is not None:
      lr /= max(self.delay, 1) ** (1 - min((self.count + 1) / self.anneal_steps, 1.0))
    return [wi - lr * (d + decay_of(wi, self.weight_decay, self.decay_mask))
            for wi, d in zip(w, self.direction(g))]


@dataclasses.dataclass
class TorchNAdam:
  """PyTorch's NAdam, decoupled decay: mu_k = b1 (1 - 0.96^(k psi) / 2), p_k = prod mu_i;
  w <- w (1 - lr wd) - lr ((1 - mu_k) g / (1 - p_k) + mu_{k+1} m / (1 - p_k mu_{k+1}))
  / (sqrt(v / (1 - b2^k)) + eps)."""

  lr: float
  b1: float
  b2: float
  momentum_decay: float = 0.004
  eps: float = 1e-8
  weight_decay: float = 0.0

  def init(self, w):
    self.m = [np.zeros_like(x) for x in w]
    self.v = [np.zeros_like(x) for x in w]
    self.product, self.count = 1.0, 0

  def step(self, w, g):
    self.count += 1
    k, b1, b2, psi = self.count, self.b1, self.b2, self.momentum_decay
    mu, mu_next = (b1 * (1 - 0.5 * 0.96 ** (i * psi)) for i in (k, k + 1))
    self.product *= mu
    self.m = [b1 * m + (1 - b1) * gi for m, gi in zip(self.m, g)]
    self.v = [b2 * v + (1 - b2) * gi * gi for v, gi in zip(self.v, g)]
    out = []
    for x, m, v, gi in zip(w, self.m, self.v, g):
      denominator = np.sqrt(v / (1 - b2 ** k)) + self.eps
      x = x * (1 - self.lr * self.weight_decay)
      out.append(x - self.lr * ((1 - mu) / (1 - self.product) * gi
                                + mu_next / (1 - self.product * mu_next) * m) / denominator)
    return out


def nesterov_moment(m, g, b1, k, delay=0):
  """Dozat's bias-corrected Nesterov moment after step k, spike-compensated ``delay`` steps:
  the moment ``delay + 1`` steps ahead if every gradient until then were ``g``."""
  ahead = delay + 1
  kept = b1 ** ahead
  return kept * m / (1 - b1 ** (k + ahead)) + (1 - kept) * g / (1 - b1 ** (k + ahead - 1))


def newton_schulz(x, steps=5, coefficients=(3.4445, -4.775, 2.0315), eps=1e-8):
  """Muon's quintic Newton-Schulz map of a matrix toward its orthogonal factor (Jordan, 2024)."""
  transposed = x.shape[0] > x.shape[1]
  if transposed:
    x = x.T
  x = x / (np.linalg.norm(x) + eps)
  a, b, c = coefficients
  for _ in range(steps):
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x.T if transposed else x


@dataclasses.dataclass
class Muon:
  """Muon on matrices (Nesterov EMA momentum, Newton-Schulz, RMS matched to Adam's: the update is
  rescaled by rms sqrt(max(rows, cols))), NAdamW on every other leaf; decoupled decay on both.
  spike_compensation: both momenta compensated for ``delay`` as :func:`nesterov_moment` says.
  ``lr``: a number, or a function of the step's index from 0 (a schedule)."""

  lr: float | Callable[[int], float]
  beta: float
  b2: float
  weight_decay: float = 0.0
  rms: float = 0.2
  eps: float = 1e-8
  delay: int = 0
  spike_compensation: bool = False

  def init(self, w):
    self.adam = NAdam(self.lr, self.beta, self.b2, delay=self.delay, eps=self.eps,
                      weight_decay=self.weight_decay,
                      spike_compensation=self.spike_compensation)
    self.adam.init(w)
    self.mu = [np.zeros_like(x) for x in w]
    self.count = 0

  def step(self, w, g):
    self.count += 1
    beta, k = self.beta, self.count
    self.mu = [beta * m + (1 - beta) * gi for m, gi in zip(self.mu, g)]
    adam_step = self.adam.step(w, g)
    new_w = []
    for wi, m, gi, ai in zip(w, self.mu, g, adam_step):
      if wi.ndim != 2:
        new_w.append(ai)
        continue
      m_hat = nesterov_moment(m, gi, beta, k, self.delay if self.spike_compensation else 0)
      update = newton_schulz(m_hat, eps=self.eps) * self.rms * np.sqrt(max(wi.shape))
      lr = rate_at(self.lr, k - 1)
      new_w.append(wi - lr * (update + self.weight_decay * wi))
    return new_w


@dataclasses.dataclass
class ErrorFeedback:
  """Error feedback around ``inner``: with u the inner rule's step, trend <- s trend + (1 - s) u,
  e' = D trend, w <- w + u + e' - e; the virtual iterate is w - e."""

  inner: object
  delay: int
  smoothing: float = 0.0

  def init(self, w):
    self.inner.init(w)
    self.error = [np.zeros_like(x) for x in w]
    self.trend = [np.zeros_like(x) for x in w]
    self.count = 0

  def step(self, w, g):
    self.count += 1
    steps = [n - x for n, x in zip(self.inner.step(w, g), w)]
    self.trend = [self.smoothing * m + (1 - self.smoothing) * u
                  for m, u in zip(self.trend, steps)]
    error = [self.delay * m for m in self.trend]
    new_w = [x + u + e - old for x, u, e, old in zip(w, steps, error, self.error)]
    self.error = error
    return new_w

  def virtual_view(self, w):
    return [x - e for x, e in zip(w, self.error)]


@dataclasses.dataclass
class PipeMareRule:
  """Momentum with lr * tau^-(1 - min(k/K, 1)), tau = max(D, 1); tracks delta = EMA of updates."""

  lr: float
  momentum: float
  delay: int
  anneal_steps: int
  gamma: float

  def init(self, w):
    self.v = [np.zeros_like(x) for x in w]
    self.delta = [np.zeros_like(x) for x in w]
    self.count = 0

  def step(self, w, g):
    tau = max(self.delay, 1)
    lr = self.lr * tau ** (-(1 - min(self.count / self.anneal_steps, 1.0)))
    self.v = [self.momentum * v + gi for v, gi in zip(self.v, g)]
    new_w = [wi - lr * v for wi, v in zip(w, self.v)]
    self.delta = [self.gamma * d + (1 - self.gamma) * (nw - wi)
                  for d, nw, wi in zip(self.delta, new_w, w)]
    self.count += 1
    return new_w


@dataclasses.dataclass
class Accumulate:
  """Synchronous mode: average M gradients, then one step of the inner rule."""

  inner: Momentum
  micro_batches: int

  def init(self, w):
    self.inner.init(w)
    self.pending = []

  def step(self, w, g):
    self.pending.append(g)
    if len(self.pending) < self.micro_batches:
      return w
    mean = [np.mean(np.stack(parts), axis=0) for parts in zip(*self.pending)]
    self.pending = []
    return self.inner.step(w, mean)


# ----------------------------------------------------------------------------- the oracle


@dataclasses.dataclass
class OracleMethod:
  """forward / backward: 'current', 'stashed' (PipeDream), 'predicted_update',
  'predicted_velocity', 'predicted_next_velocity' (SpecTrain), 'pipemare'."""

  make_rule: callable  # delay -> rule
  forward: str = "current"
  backward: str = "current"
  horizon: int | None = None  # LWP horizon; None: the stage's delay


def run_oracle(model, method: OracleMethod, init_params, inputs, labels, valid=None,
               init_variables=None):
  """Runs the pipeline naively; returns (final params per stage, metrics per tick).

  ``init_params``: per-stage param pytrees; ``inputs``/``labels``: per-tick arrays (T, b, ...).
  ``init_variables``: per-stage :class:`Variables` (None for stateless stages); when given, the
  final variables per stage are returned third.
  """
  num_stages = model.num_stages
  num_ticks = len(inputs)
  valid = np.ones(num_ticks, bool) if valid is None else np.asarray(valid)
  treedefs = [jax.tree.structure(p) for p in init_params]
  weights = [[np.asarray(x, np.float64) for x in jax.tree.leaves(p)] for p in init_params]
  history = [[w] for w in weights]  # history[s][t]: weights at the start of tick t
  applied = [[] for _ in range(num_stages)]  # the updates actually applied, in order
  rules = []
  for s in range(num_stages):
    rule = method.make_rule(2 * (num_stages - 1 - s))
    rule.init(weights[s])
    rules.append(rule)
  stashed = [dict() for _ in range(num_stages)]  # sample -> input
  forward_weights_used = [dict() for _ in range(num_stages)]  # sample -> weights (PipeDream)
  variables = list(init_variables or [None] * num_stages)  # live, as the last tick left them
  forward_variables_seen = [dict() for _ in range(num_stages)]  # sample -> forward variables
  outputs = {}  # (stage, sample) -> output
  cotangents = {}  # (stage, sample) -> d loss / d input of that stage
  metrics = []

  def as_tree(s, leaves):
    return jax.tree.unflatten(treedefs[s], [jnp.asarray(x, jnp.float32) for x in leaves])

  def view(s, kind, t):
    w = history[s][t]
    delay = 2 * (num_stages - 1 - s)
    horizon = delay if method.horizon is None else method.horizon
    if kind == "current":
      return w
    if kind == "predicted_update":
      last = applied[s][-1] if applied[s] else [np.zeros_like(x) for x in w]
      return [x + horizon * u for x, u in zip(w, last)]
    if kind == "predicted_velocity":
      rule = rules[s]
      return [x - rule.lr * horizon * v for x, v in zip(w, rule.v)]
    if kind == "predicted_next_velocity":  # SpecTrain's reference code: m v + g
      rule = rules[s]
      if not rule.count:
        return w
      return [x - rule.lr * horizon * (rule.momentum * v + g)
              for x, v, g in zip(w, rule.v, rule.last_gradient)]
    if kind == "pipemare":
      return [x - delay * d for x, d in zip(w, rules[s].delta)]
    if kind == "rule":  # the rule's own view of the weights ``horizon`` steps ahead
      return rules[s].forward_view(w, horizon)
    raise ValueError(kind)

  for t in range(num_ticks):
    tick_metrics = {"valid": False, "loss": 0.0}
    new_weights = list(weights)
    new_variables = list(variables)
    for s in range(num_stages):
      stage = model.stages[s]
      # The test models draw no randomness, so any key will do (the engine folds its own).
      key = functools.partial(_key, s=s)
      n = t - s  # forwarded this tick
      if 0 <= n < num_ticks and valid[n]:
        x = jnp.asarray(inputs[n]) if s == 0 else outputs[(s - 1, n)]
        w_f = view(s, method.forward, t)
        forward_weights_used[s][n] = w_f
        stashed[s][n] = x
        if variables[s] is None:
          if s < num_stages - 1:
            outputs[(s, n)] = _forward(model, s, key(n), as_tree(s, w_f), x)
        else:
          forward_variables_seen[s][n] = variables[s].forward
          y, forward = jax.jit(stage.apply)(as_tree(s, w_f), x, key(n), variables[s])
          outputs[(s, n)] = y
          new_variables[s] = Variables(forward, new_variables[s].backward)
      m = t - 2 * (num_stages - 1) + s  # backwarded this tick
      if 0 <= m < num_ticks and valid[m]:
        x = stashed[s].pop(m)
        w_b = forward_weights_used[s].pop(m) if method.backward == "stashed" else \
            view(s, method.backward, t)
        w_tree = as_tree(s, w_b)
        # A stateful stage is differentiated with respect to its backward variables too: the VJP's
        # cotangent for them is their increment. ``seen``: the forward variables of sample m's
        # forward. (Compiled only because eager flax is slow; None for a stateless stage.)
        trainable = w_tree if variables[s] is None else (w_tree, variables[s].backward)
        seen = None if variables[s] is None else forward_variables_seen[s].pop(m)
        if s == num_stages - 1:
          (loss, aux), (g_w, g_x) = _loss_grads(model, s, key(m), seen, trainable, x,
                                                jnp.asarray(labels[m]))
          tick_metrics = {"valid": True, "loss": float(loss), "sample": m,
                          **{k: float(v) for k, v in aux.items()}}
        else:
          g_w, g_x = _vjp(model, s, key(m), seen, trainable, x, cotangents.pop((s + 1, m)))
        if variables[s] is not None:
          g_w, increment = g_w
          backward = jax.tree.map(lambda v, i: v + i, variables[s].backward, increment)
          new_variables[s] = Variables(new_variables[s].forward, backward)
        if s > 0:
          cotangents[(s, m)] = g_x
        g = [np.asarray(x, np.float64) for x in jax.tree.leaves(g_w)]
        if getattr(rules[s], "needs_gradient_weights", False):
          new_weights[s] = rules[s].step(weights[s], g, w_b)
        else:
          new_weights[s] = rules[s].step(weights[s], g)
        applied[s].append([a - b for a, b in zip(new_weights[s], weights[s])])
    weights, variables = new_weights, new_variables
    for s in range(num_stages):
      history[s].append(weights[s])
    metrics.append(tick_metrics)
  final_params = [as_tree(s, w) for s, w in enumerate(weights)]
  if init_variables is not None:
    return final_params, metrics, variables
  return final_params, metrics



# The stages' functions are compiled once per process and shape, as the engine's are: run op by
# op, a stage's forward and its keys cost more than the engine they check.
@jax.jit
def _key(n, s):
  return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(0), n), s)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _forward(model, s, key, w, x):
  return model.stages[s].apply(w, x, key)


def _apply(stage, key, seen_forward, w, x):
  if seen_forward is None:
    return stage.apply(w, x, key)
  params, backward = w
  return stage.apply(params, x, key, Variables(seen_forward, backward))[0]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _loss_grads(model, s, key, seen_forward, w, x, labels):
  f = lambda w, x: model.loss(_apply(model.stages[s], key, seen_forward, w, x), labels)
  return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(w, x)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _vjp(model, s, key, seen_forward, w, x, cotangent):
  f = lambda w, x: _apply(model.stages[s], key, seen_forward, w, x)
  return jax.vjp(f, w, x)[1](cotangent)
