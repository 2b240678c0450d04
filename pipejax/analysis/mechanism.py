"""The delay's mechanism, measured per stage while a pipeline trains.

At the ticks asked for, for each stage ``s`` whose backward that tick works on a real sample ``n``
(``n = t - 2(S-1) + s``, docs/design.md §2.1), :func:`measure` records:

* ``mismatch``: ``|w_fwd - w_bwd| / |w_bwd|`` between the weights the forward of ``n`` used and the
  weights its backward uses: the engine's own ``weight_discrepancy`` diagnostic of that tick
  (``Pipeline(track_weight_discrepancy=True)``);
* ``cosine``: between the **delayed gradient**, the one stage ``s`` applies that tick (the VJP the
  engine takes: ``n``'s stashed input, which upstream weights of earlier ticks made, at the
  weights the method gives the backward, times the cotangent stage ``s+1`` sent back last tick),
  and the **current gradient**, the gradient of ``n``'s loss with respect to stage ``s``'s weights
  when the whole network runs on ``n`` at every stage's current weights (plain backprop through
  ``Model`` at ``w_t``, the same randomness per stage);
* ``delayed_norm`` and ``current_norm``: the two gradients' norms.

"Current" is every stage's weights ``w_t`` as they stand before the tick, not the method's views
of them (a prediction is a view). So the two numbers separate two causes: the mismatch is the
stage's own inconsistency, and the cosine also carries the staleness of the input and of the
cotangent. The last stage has no mismatch, yet its cosine is below 1 as soon as the stages
upstream move: its input was made with their weights of a tick before (it is 1 when they stand
still, and for a single stage). In the synchronous mode the stages downstream of ``s`` have
already taken the step of the sample that ``s`` backwards, so there too the cosine falls below 1
upstream of the last stage; the mismatch is 0.

The delayed gradient is recomputed here, from what the state holds before the tick, with the
engine's timing and views; nothing the engine computes changes (``tests/analysis/
test_mechanism.py`` checks it against the update plain SGD applies). Between measurements the
pipeline runs as in training, in scans of ``chunk`` ticks, the measured tick alone by
:meth:`Pipeline.tick`, so a measured run follows the trajectory of an unmeasured one up to float
rounding (the programs fuse differently).

On one device, for stateless stages (the LM's and the MLP's). Each measured tick costs one
backward of every stage and one full forward and backward of the network per stage, batched over
the stages (memory: one full gradient per stage).
"""

from __future__ import annotations

import functools
import math
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from pipejax import plotting
from pipejax.core.engine import Pipeline
from pipejax.core.stage_maths import stage_key
from pipejax.core.state import Packet, PipelineState

PyTree = Any

FIELDS = ("tick", "stage", "sample", "delay", "mismatch", "cosine", "delayed_norm", "current_norm")


class MechanismError(ValueError):
  """A pipeline, a stream or ticks the measurement cannot take; the message says what to do."""


def check_pipeline(pipe: Pipeline) -> None:
  """Refuses a pipeline :func:`measure` cannot measure (the message says how to build one)."""
  if not isinstance(pipe, Pipeline):
    raise MechanismError(f"The mechanism is measured on a single-device pipejax Pipeline; got "
                         f"{type(pipe).__name__}. Pass its .pipeline (Setup.pipeline), and the "
                         "state in the logical layout (runner.to_logical(state)).")
  if not pipe.spec.track_weight_discrepancy:
    raise MechanismError("The mechanism reads the forward's weights from the delay lines: build "
                         "the Pipeline with track_weight_discrepancy=True (in a config, "
                         "config.diagnostics=True).")
  if any(st.variables is not None for st in pipe.state_spec.stages):
    raise MechanismError("The mechanism is measured for stateless stages only; this model has "
                         "stages with variables (normalization statistics). Measure a model "
                         "without them.")


def measured_ticks(num_ticks: int, fill: int, points: int) -> list[int]:
  """``points`` ticks spread evenly over ``[fill, num_ticks)``, the ticks after the pipeline's
  fill of a stream of ``num_ticks``; refused when fewer than ``points`` ticks follow the fill,
  since the records would then hold fewer points than asked."""
  if num_ticks - fill < points:
    raise MechanismError(
        f"{points} ticks to measure, but the stream's {num_ticks} ticks leave "
        f"{max(num_ticks - fill, 0)} after the pipeline's fill of {fill} (2 (S - 1) for its "
        f"{fill // 2 + 1} stages): measure at most that many (--points), or train on at least "
        f"{fill + points} micro-batches (--sequences).")
  return sorted({int(t) for t in np.linspace(fill, num_ticks - 1, points).round()})


def backward_sample(pipe: Pipeline, tick: int, s: int) -> int:
  """The index of the sample stage ``s`` backwards at ``tick`` (negative: none yet)."""
  return tick - 2 * (pipe.num_stages - 1) + s


def _sample_loss(pipe: Pipeline, params: Sequence[PyTree], x: PyTree, labels: PyTree, rng,
                 index) -> jax.Array:
  """One sample's loss through every stage at ``params``, with the pipeline's keys for it."""
  for s, stage in enumerate(pipe.model.stages):
    x = stage.apply(params[s], x, stage_key(rng, index, s))
  loss, _ = pipe.model.loss(x, labels)
  return loss


def delayed_gradient(pipe: Pipeline, state: PipelineState, inbound: Packet, s: int):
  """What stage ``s`` backwards in the tick that ``state`` is about to take.

  Args:
    pipe: the pipeline (weights stashed in its delay lines).
    state: the state before the tick.
    inbound: the tick's new micro-batch as stage 0 takes it.
    s: the stage.

  Returns:
    ``(gradient, index, valid)``: the weight gradient the engine's backward computes, the index
    of its sample and whether the slot holds one.
  """
  st, method, delay = state.stages[s], pipe.method, pipe.delays[s]
  stage, last = pipe.model.stages[s], s == pipe.num_stages - 1
  packet = inbound if s == 0 else state.stages[s - 1].forward_out
  forward_params = method.forward_weights(st.params, st.opt_state, delay)
  oldest = st.delay_line.read(state.tick, st.delay_line.entry(packet, forward_params))
  backward_params = (oldest.weights if method.stash_forward_weights
                     else method.backward_weights(st.params, st.opt_state, delay))
  key = stage_key(state.rng, oldest.index, s)
  if last:
    grads = jax.grad(lambda w: pipe.model.loss(stage.apply(w, oldest.x, key), packet.labels)[0])(
        backward_params)
  else:
    _, vjp = jax.vjp(lambda w: stage.apply(w, oldest.x, key), backward_params)
    (grads,) = vjp(state.stages[s + 1].backward_out)
  return grads, oldest.index, oldest.valid


def _dot(a: PyTree, b: PyTree) -> jax.Array:
  return sum(jnp.vdot(x.astype(jnp.float32), y.astype(jnp.float32))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _measure_tick(pipe: Pipeline, state: PipelineState, inbound: Packet, xs: PyTree, ys: PyTree,
                  indices: jax.Array) -> dict:
  """Per stage (leading axis S): the cosine, both norms, and the sample index and valid flag of
  the backward. ``xs``, ``ys`` and ``indices`` hold each stage's sample (leading axis S)."""
  params = [st.params for st in state.stages]
  current = jax.vmap(jax.grad(functools.partial(_sample_loss, pipe)),
                     in_axes=(None, 0, 0, None, 0))(params, xs, ys, state.rng, indices)
  rows = {"cosine": [], "delayed_norm": [], "current_norm": [], "index": [], "valid": []}
  for s in range(pipe.num_stages):
    delayed, index, valid = delayed_gradient(pipe, state, inbound, s)
    now = jax.tree.map(lambda a, s=s: a[s], current[s])
    norm_delayed, norm_now = jnp.sqrt(_dot(delayed, delayed)), jnp.sqrt(_dot(now, now))
    product = norm_delayed * norm_now
    rows["cosine"].append(jnp.where(product > 0, _dot(delayed, now) / product, jnp.nan))
    rows["delayed_norm"].append(norm_delayed)
    rows["current_norm"].append(norm_now)
    rows["index"].append(index)
    rows["valid"].append(valid)
  return {k: jnp.stack(v) for k, v in rows.items()}


def measure(pipe: Pipeline, state: PipelineState, inputs: PyTree, labels: PyTree,
            valid: np.ndarray | None = None, at: Sequence[int] = (), chunk: int = 100
            ) -> tuple[PipelineState, list[dict]]:
  """Trains through a stream, measuring the mechanism at the ticks ``at``.

  Args:
    pipe: a single-device pipeline built with ``track_weight_discrepancy=True``.
    state: its state (logical layout); the stream's first micro-batch enters at ``state.tick``.
      Samples in flight from before the stream cannot be measured, so start from a fresh state.
    inputs: micro-batches, one per tick (leading axis T), laid out by ``pipe.to_ticks``.
    labels: their labels.
    valid: per tick whether the micro-batch is real (default all True).
    at: the ticks to measure, each within ``[state.tick, state.tick + T)``.
    chunk: the scan length between measurements (ticks left over run one by one).

  Returns:
    The state after the stream, and one record per measured tick and stage whose backward that
    tick worked on a real sample: the fields of :data:`FIELDS`.

  Raises:
    MechanismError: a pipeline :func:`check_pipeline` refuses, or a tick outside the stream.
  """
  check_pipeline(pipe)
  num_ticks = len(jax.tree.leaves(inputs)[0])
  valid = np.ones((num_ticks,), bool) if valid is None else np.asarray(valid, bool)
  first = int(state.tick)
  at = sorted({int(t) for t in at})
  outside = [t for t in at if not first <= t < first + num_ticks]
  if outside:
    raise MechanismError(f"Ticks {outside} lie outside the stream, which covers ticks "
                         f"[{first}, {first + num_ticks}); measure within it.")
  if chunk < 1:
    raise MechanismError(f"chunk is the number of ticks a scan runs, at least 1; got {chunk}.")
  inputs, labels = jax.tree.map(np.asarray, (inputs, labels))
  take = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
  started = time.perf_counter()
  program, records, tick = jax.jit(functools.partial(_measure_tick, pipe)), [], first
  for t in at + [first + num_ticks]:
    while t - tick >= chunk:
      span = slice(tick - first, tick - first + chunk)
      state, _ = pipe.run(state, take(inputs, span), take(labels, span), valid[span])
      tick += chunk
    while tick < t:
      i = tick - first
      state, _ = pipe.tick(state, take(inputs, i), take(labels, i), valid[i])
      tick += 1
    if t == first + num_ticks:
      break
    records_tick = _measured(pipe, program, state, take(inputs, t - first),
                             take(labels, t - first), valid[t - first], inputs, labels, first)
    state, metrics = pipe.tick(state, take(inputs, t - first), take(labels, t - first),
                               valid[t - first])
    # The engine's own discrepancy of the tick just taken: the same forward and backward weights.
    discrepancy = np.asarray(metrics["weight_discrepancy"])
    for r in records_tick:
      r["mismatch"] = float(discrepancy[r["stage"]])
    records.extend(records_tick)
    logging.info("Measured tick %d (%d of %d) after %.0f s.", t, at.index(t) + 1, len(at),
                 time.perf_counter() - started)
    tick += 1
  return state, records


def _measured(pipe, program, state, x, y, valid, inputs, labels, first) -> list[dict]:
  """The records of the tick ``state`` is about to take (their mismatch filled in later)."""
  t, num_ticks = int(state.tick), len(jax.tree.leaves(inputs)[0])
  samples = [backward_sample(pipe, t, s) for s in range(pipe.num_stages)]
  positions = [min(max(n - first, 0), num_ticks - 1) for n in samples]
  inbound = Packet(x, y, jnp.asarray(valid), state.tick)
  xs = jax.tree.map(lambda a: a[np.asarray(positions)], inputs)
  ys = jax.tree.map(lambda a: a[np.asarray(positions)], labels)
  out = jax.device_get(program(state, inbound, xs, ys, jnp.asarray(samples, jnp.int32)))
  records = []
  for s, n in enumerate(samples):
    if not out["valid"][s]:
      continue
    if int(out["index"][s]) != n or n < first:
      raise MechanismError(
          f"At tick {t} stage {s} backwards sample {int(out['index'][s])}, which entered "
          f"{'before the stream began' if n < first else f'where the timing expects {n}'}: "
          "measure a stream fed from a fresh state (pipe.init), one micro-batch per tick.")
    records.append({"tick": t, "stage": s, "sample": n, "delay": pipe.delays[s],
                    "mismatch": math.nan, "cosine": float(out["cosine"][s]),
                    "delayed_norm": float(out["delayed_norm"][s]),
                    "current_norm": float(out["current_norm"][s])})
  return records


def plot_stage(records: Sequence[dict], stage: int, path: str, title: str = "") -> None:
  """Stage ``stage``'s mismatch and cosine against the tick, one panel each, saved to ``path``."""
  rows = sorted((r for r in records if r["stage"] == stage), key=lambda r: r["tick"])
  if not rows:
    raise MechanismError(f"No record of stage {stage} to draw: its backward saw no sample at the "
                         "measured ticks (measure after the pipeline has filled).")
  plt = plotting.pyplot()
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 5), sharex=True)
  ticks = [r["tick"] for r in rows]
  top.plot(ticks, [r["mismatch"] for r in rows], marker="o", ms=3, color="tab:red")
  top.set_ylabel("‖w_fwd − w_bwd‖ / ‖w_bwd‖")
  bottom.plot(ticks, [r["cosine"] for r in rows], marker="o", ms=3, color="tab:blue")
  bottom.axhline(1.0, color="0.6", lw=0.8, ls=":")
  bottom.set_ylabel("cos(delayed, current gradient)")
  bottom.set_xlabel("tick (micro-batches fed)")
  top.set_title(f"{title + ', ' if title else ''}stage {stage}, delay {rows[0]['delay']}")
  plotting.save(fig, path)


def plot_stages(records: Sequence[dict], path: str, title: str = "") -> None:
  """Every stage's mean mismatch and mean cosine over the measured ticks, against its delay."""
  by_stage = {}
  for r in records:
    by_stage.setdefault(r["stage"], []).append(r)
  if not by_stage:
    raise MechanismError("No records to draw: no measured tick saw a backward on a real sample.")
  stages = sorted(by_stage)
  delays = [by_stage[s][0]["delay"] for s in stages]
  mean = lambda s, key: float(np.nanmean([r[key] for r in by_stage[s]]))
  plt = plotting.pyplot()
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
  left.plot(delays, [mean(s, "mismatch") for s in stages], marker="o", ms=3, color="tab:red")
  left.set_ylabel("mean ‖w_fwd − w_bwd‖ / ‖w_bwd‖")
  right.plot(delays, [mean(s, "cosine") for s in stages], marker="o", ms=3, color="tab:blue")
  right.axhline(1.0, color="0.6", lw=0.8, ls=":")
  right.set_ylabel("mean cos(delayed, current gradient)")
  for ax in (left, right):
    ax.set_xlabel("stage delay D_s = 2(S − 1 − s)")
  if title:
    fig.suptitle(title)
  plotting.save(fig, path)


def write_figures(records: Sequence[dict], directory: str, title: str = "") -> list[str]:
  """``stage_NNN.png`` for every stage with records, and ``stages.png`` over all of them."""
  os.makedirs(directory, exist_ok=True)
  paths = []
  for s in sorted({r["stage"] for r in records}):
    paths.append(os.path.join(directory, f"stage_{s:03d}.png"))
    plot_stage(records, s, paths[-1], title)
  paths.append(os.path.join(directory, "stages.png"))
  plot_stages(records, paths[-1], title)
  return paths
