"""The one pipeline runner, :class:`Runner`: what training code calls, whatever the layout.

A layout keeps the state its own way and gives the runner a small protocol: make, check and
translate a state, say whether every slot is full, and advance one tick. Two runners give it:
:class:`pipejax.core.engine.Pipeline` on one device (stage by stage, the logical layout, or with
stacked parts) and :class:`pipejax.parallel.sharding.ShardedPipeline` over a device mesh.
:meth:`Runner.to_logical` gives the device-independent
:class:`~pipejax.core.state.PipelineState` that checkpoints hold, so any layout resumes any other's.
:func:`jit` is how every pipeline program is compiled.
"""

from __future__ import annotations

import abc
import functools
from typing import Any

import jax
import numpy as np

from pipejax.core import accounting, checks
from pipejax.core.spec import PipelineSpec
from pipejax.core.state import Batch, PipelineState

PyTree = Any
State = Any  # a runner's state in its own layout


class Runner(abc.ABC):
  """The one pipeline runner: ``tick``, ``run``, ``drain`` and ``to_ticks`` over a state layout.

  ``spec`` is the :class:`~pipejax.core.spec.PipelineSpec` with the model, the method and the
  micro-batch shape. A runner is a subclass that gives the small protocol below (the abstract
  methods, and ``_tick``); everything a user calls to advance a pipeline is written here once.
  The runners are :class:`~pipejax.core.engine.Pipeline` on one device (stage by stage, or with
  stacked parts) and :class:`~pipejax.parallel.sharding.ShardedPipeline` over a device mesh.

  Metrics (of :meth:`tick`, and of :meth:`run` stacked along the time axis): ``loss`` and the
  loss's own metrics (e.g. ``accuracy``) of the sample that met the loss this tick, ``valid``
  (False while the pipeline fills), ``sample`` (its index) and ``finite`` (one flag per stage).
  """

  spec: PipelineSpec
  # Whether run and tick may be traced into a caller's jit, vmap or grad (a mesh's may not: they
  # are programs over the mesh already).
  traceable: bool = True

  # ---------------------------------------------------------------- the layout protocol

  @abc.abstractmethod
  def init(self, rng: jax.Array, fill_value: float = 0.0) -> State:
    """A fresh state in the runner's layout: the logical init's numbers
    (:class:`~pipejax.core.initial.StateInit`)."""

  @abc.abstractmethod
  def check_state(self, state: State) -> None:
    """Refuses a state of another layout or pipeline, or one whose buffers a run consumed."""

  @abc.abstractmethod
  def to_logical(self, state: State) -> PipelineState:
    """The device-independent :class:`~pipejax.core.state.PipelineState` (what checkpoints hold)."""

  @abc.abstractmethod
  def from_logical(self, logical_state: PipelineState) -> State:
    """A logical state laid out in the runner's layout."""

  @abc.abstractmethod
  def every_slot_full(self, state: State) -> bool:
    """True when every delay-line slot and forward register holds a real micro-batch.

    Then, if every micro-batch fed next is real too, every backward of the coming ticks is real:
    it reads either a slot that is full now or one written from the new micro-batches.
    """

  @abc.abstractmethod
  def host_params(self, state: State) -> list[PyTree]:
    """Each logical stage's parameters as numpy arrays (what a weights digest reads), brought to
    the host without making the logical state on the device."""

  @abc.abstractmethod
  def weights_finite(self, state: State) -> np.ndarray:
    """One flag per logical stage: are its weights and optimizer state finite.

    Computed where the state lives (on a mesh, each device checks its own stages); only the
    flags come to the host, never the state.
    """

  @abc.abstractmethod
  def _tick(self, state: State, batch: Batch, every_slot_full: bool = False):
    """One tick of a checked (and placed) :class:`Batch`: ``(state, metrics)``, traceable."""

  def _run(self, state: State, batches: Batch, every_slot_full: bool = False):
    """``T`` ticks of a :class:`Batch` with a leading time axis, traceable. A layout whose ticks
    are not a scan of its ``_tick`` overrides it."""
    return jax.lax.scan(functools.partial(self._tick, every_slot_full=every_slot_full), state,
                        batches)

  def _stream(self, inputs, labels, valid, ticks) -> tuple[Batch, bool]:
    """The checked :class:`Batch` in the layout's placement (a time axis when ``ticks``), and
    whether every micro-batch in it is real."""
    batch = self.spec.checked_batch(inputs, labels, valid, ticks=ticks)
    return batch, not checks.traced(batch.valid) and bool(np.all(np.asarray(batch.valid)))

  def _compile(self, **jit_kwargs):
    """The runner's three programs: one tick, a stream, and a stream of a full pipeline."""
    return (jit(self._tick, **jit_kwargs), jit(self._run, donate_argnums=0, **jit_kwargs),
            jit(functools.partial(self._run, every_slot_full=True), donate_argnums=0,
                **jit_kwargs))

  # ---------------------------------------------------------------- written once

  def tick(self, state: State, inputs, labels, valid=True) -> tuple[State, dict]:
    """One tick: stage 0 takes micro-batch ``(inputs, labels)``; metrics without a time axis.

    The state is not donated. Inside ``jax.jit``, ``jax.vmap`` or ``jax.grad`` the tick is traced
    into the caller's program (not on a mesh, whose tick is a program over the mesh already).
    """
    self._refuse_traced((state, inputs, labels, valid))
    self.check_state(state)
    batch, _ = self._stream(inputs, labels, valid, ticks=None)
    if checks.traced((state, batch)):  # inside the caller's jit, vmap or grad: its program's part
      return self._tick(state, _varying_like(batch, state))
    return self._jit_tick(state, batch)

  def run(self, state: State, inputs, labels, valid=None) -> tuple[State, dict]:
    """Advances ``T`` ticks; inputs and labels have a leading time axis of size T.

    ``valid`` (bool per tick; default all True) feeds empty slots where False (drain, synchronous
    bubbles). The state is donated: do not use the ``state`` passed in afterwards, nor any part of
    it kept from before the call (the message of an attempt says so). Metrics come back stacked
    along T. Inside ``jax.jit``, ``jax.vmap``, ``jax.grad`` or ``jax.checkpoint`` it is traced
    into the caller's program, which donates nothing (not on a mesh).

    Once the pipeline is full and stays full (every slot in flight and every micro-batch fed is
    real: PB after its fill), a second compiled version runs without the per-stage guard against
    empty slots (faster: the guard is one more pass over every weight per tick). It computes the
    same numbers up to float rounding (the two programs fuse differently); which one runs depends
    only on the state and the stream, so a resumed run still repeats the original bit for bit.
    """
    self._refuse_traced((state, inputs, labels, valid))
    self.check_state(state)
    batch, all_valid = self._stream(inputs, labels, valid, ticks=True)
    if checks.traced((state, batch)):
      # Inside the caller's jit, vmap or grad: the guarded program, traced into the caller's
      # (which donates nothing and compiles with the caller's options); whether every slot is
      # full is not known there.
      return self._run(state, _varying_like(batch, state))
    if all_valid and self.every_slot_full(state):
      return self._jit_run_full(state, batch)
    return self._jit_run(state, batch)

  @property
  def programs(self) -> tuple:
    """The two jitted programs ``run`` chooses between: ``(filling, full)``, each taking the
    runner's state and a :class:`Batch` in its own layout (profilers read their HLO and caches)."""
    return self._jit_run, self._jit_run_full

  def lower(self, state: State, inputs, labels, valid=None, every_slot_full: bool = True):
    """The program ``run`` calls on this stream, lowered (``.compile()``, ``.as_text()``):
    the full pipeline's by default, the filling one's with ``every_slot_full=False``."""
    batch, _ = self._stream(inputs, labels, valid, ticks=True)
    program = self._jit_run_full if every_slot_full else self._jit_run
    return program.lower(state, batch)

  def _refuse_traced(self, tree) -> None:
    if not self.traceable:
      checks.refuse_traced(type(self).__name__, tree)

  def drain(self, state: State) -> tuple[State, dict | None]:
    """Finishes every backward in flight by feeding 2(S-1) empty ticks; ``(state, metrics)``."""
    spec = self.spec
    ticks = accounting.fill_ticks(spec.num_stages)
    if ticks == 0:
      return state, None
    empty = lambda spec: np.zeros((ticks,) + spec.shape, spec.dtype)
    return self.run(state, jax.tree.map(empty, spec.example_inputs),
                    jax.tree.map(empty, spec.example_labels), np.zeros((ticks,), bool))

  def to_ticks(self, inputs, labels) -> tuple[PyTree, PyTree, np.ndarray]:
    """Lays a stream of K micro-batches (leading axis K) onto ticks for this method.

    Asynchronous methods take one micro-batch per tick. The synchronous mode feeds each step's M
    micro-batches followed by 2(S-1) empty ticks (fill and drain): returns (inputs, labels, valid)
    per tick.
    """
    if checks.traced((inputs, labels)):
      raise checks.PipelineError(
          "to_ticks lays a stream out on the host, with numpy, so it cannot run inside jax.jit, "
          "jax.vmap, jax.grad or another JAX transform. Call it on the data outside the "
          "transform, and pass the (inputs, labels, valid) it returns to run, which may run "
          "inside one.")
    count = checks.stream_length(inputs, labels)
    m = self.spec.method.micro_batches_per_flush
    if m is None:
      return inputs, labels, np.ones((count,), bool)
    checks.check_whole_steps(count, m)
    gap = accounting.bubble_ticks(self.spec.num_stages, m)
    steps = count // m

    def spread(a):
      a = np.asarray(a).reshape((steps, m) + a.shape[1:])
      pad = np.zeros((steps, gap) + a.shape[2:], a.dtype)
      return np.concatenate([a, pad], axis=1).reshape((steps * (m + gap),) + a.shape[2:])

    valid = spread(np.ones((count,), bool))
    return jax.tree.map(spread, inputs), jax.tree.map(spread, labels), valid


def _varying_like(batch: Batch, state) -> Batch:
  """``batch`` varying over the mesh axes the state varies over, inside the caller's
  ``shard_map``: what the tick writes from the batch into the state (the labels and flags a
  packet carries) must have the state's type, or ``lax.scan`` refuses its carry."""
  def vma(a):  # the aval's varying manual axes: `.mat.varying` in this JAX, `.vma` before
    aval = jax.typeof(a)
    return frozenset(getattr(getattr(aval, "mat", None), "varying", None) or
                     getattr(aval, "vma", None) or ())
  axes = frozenset().union(*map(vma, jax.tree.leaves(state)))
  if not axes:
    return batch
  return jax.tree.map(
      lambda a: jax.lax.pcast(a, tuple(sorted(axes - vma(a))), to="varying")
      if axes - vma(a) else a, batch)


def jit(fn, **kwargs):
  """``jax.jit`` with the compiler options every pipeline program is built with.

  On a CPU and a GPU, XLA's default copy insertion copies every loop-carried weight whose old
  value is read by work the update does not depend on (the forward, the input gradient, a weight
  stash). Region-based copy insertion sees that those reads end before the in-place update and
  keeps no copy. It changes which buffers are copied, never a value.
  """
  option = REGION_ANALYSIS_OPTION.get(jax.default_backend())
  if option:
    kwargs.setdefault("compiler_options", {option: True})
  return jax.jit(fn, **kwargs)


# Per backend, the XLA option that :func:`jit` turns on: region-based copy insertion.
REGION_ANALYSIS_OPTION = {"cpu": "xla_cpu_copy_insertion_use_region_analysis",
                           "gpu": "xla_gpu_copy_insertion_use_region_analysis"}
