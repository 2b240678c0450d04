"""The pipeline's boundary: every error a user can cause is refused here, before anything runs.

:class:`pipejax.core.engine.Pipeline` calls these when it is built (model, method, micro-batch,
loss) and on every call (state, stream, labels); the runners over a mesh or with stacked parts reuse
them. Each check reads shapes and dtypes, or host arrays, never device results, so it costs
nothing per tick.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pipejax.core import accounting
from pipejax.methods import Method
from pipejax.core.stages import DONATED_MESSAGE, Model, donated

PyTree = Any


class PipelineError(ValueError):
  """Bad input at the pipeline's boundary; the message says what is wrong and how to fix it."""


DONATED_STATE_MESSAGE = DONATED_MESSAGE


def check_not_donated(tree: PyTree) -> None:
  """Refuses a tree any of whose arrays an earlier run() donated, before JAX reads a freed
  buffer."""
  if donated(tree):
    raise PipelineError(DONATED_MESSAGE)


def traced(tree: PyTree) -> bool:
  """Whether a leaf of ``tree`` is traced: the call runs inside the caller's ``jax.jit``,
  ``jax.vmap``, ``jax.grad`` or another transform, and becomes part of its program."""
  return any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(tree))


def check_on_host(what: str, tree: PyTree) -> None:
  """Refuses traced arguments to a call that reads their values on the host."""
  if traced(tree):
    raise PipelineError(
        f"{what} reads the values of its arguments on the host, so it cannot run inside "
        "jax.jit, jax.vmap, jax.grad or another JAX transform (its arguments are traced here). "
        "Call it outside the transform.")


def refuse_traced(runner: str, tree: PyTree) -> None:
  """Refuses a call of a runner that cannot become part of another JAX transform's program."""
  if traced(tree):
    raise PipelineError(
        f"{runner}.run and tick cannot run inside jax.jit, jax.vmap, jax.grad or another JAX "
        "transform (its arguments are traced here): they are compiled programs over a device "
        "mesh already. Call them outside the transform, or transform a Pipeline on one device "
        "(with or without stacked parts), whose run and tick become part of the caller's "
        "program.")


def spec(tree) -> PyTree:
  """Shapes and dtypes of a tree of arrays, ShapeDtypeStructs or Python/numpy values.

  The array's own dtype, not JAX's canonical one: a float64 batch must not pass silently as the
  float32 the pipeline was built for.
  """
  def leaf(a):
    dtype = a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype
    return jax.ShapeDtypeStruct(np.shape(a), dtype)
  return jax.tree.map(leaf, tree)


def canonical(tree_spec) -> PyTree:
  """``tree_spec`` with the dtypes JAX keeps (64-bit types as 32-bit ones unless x64 is on)."""
  return jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, jax.dtypes.canonicalize_dtype(a.dtype)), tree_spec)


def describe(tree) -> str:
  return str(jax.tree.map(lambda a: f"{tuple(a.shape)} {jnp.dtype(a.dtype).name}", tree))


def check_model_and_method(model, method) -> None:
  if not isinstance(model, Model):
    raise PipelineError(f"model must be a pipejax.Model (pipejax.Model([stage, ...])); got "
                        f"{type(model).__name__}.")
  if not isinstance(method, Method):
    raise PipelineError(
        f"method must be a pipejax Method, e.g. methods.make_method('pb', learning_rate=0.01) or "
        f"methods.pb(optax.sgd(0.01, momentum=0.9)); got {type(method).__name__}.")


def micro_batch_specs(example_inputs, example_labels) -> tuple[PyTree, PyTree]:
  """The canonical specs of one micro-batch, which must share a leading axis of size b >= 1."""
  inputs, labels = canonical(spec(example_inputs)), canonical(spec(example_labels))
  batch_sizes = {a.shape[0] if a.shape else None for a in jax.tree.leaves((inputs, labels))}
  if len(batch_sizes) != 1 or None in batch_sizes:
    raise PipelineError(
        f"Inputs {describe(inputs)} and labels {describe(labels)} must share one leading "
        "micro-batch axis of size b >= 1. Give one micro-batch, e.g. inputs of shape (b, 784) "
        "and labels of shape (b,).")
  (b,) = batch_sizes
  if b < 1:
    raise PipelineError("The micro-batch size b must be at least 1 (got b = 0). PB trains with "
                        "b = 1 and up; give example inputs with a non-empty leading axis.")
  return inputs, labels


def check_floating_params(model: Model, params: list[PyTree]) -> None:
  """Gradients and updates need floating weights."""
  for s, stage_params in enumerate(params):
    for path, leaf in jax.tree_util.tree_leaves_with_path(stage_params):
      if not jnp.issubdtype(leaf.dtype, jnp.inexact):
        raise PipelineError(
            f"{model.stage_label(s)} has a trainable parameter "
            f"{jax.tree_util.keystr(path)} of dtype {jnp.dtype(leaf.dtype).name}; gradients "
            "and updates need floating weights. Keep integer constants out of the params: in "
            "the stage's closure, or as a stateful stage's variables.")


def check_loss(loss, last_out, example_labels) -> None:
  """The loss takes the last stage's output and the labels, and returns (scalar, dict)."""
  try:
    result = jax.eval_shape(loss, last_out, example_labels)
  except Exception as e:  # pylint: disable=broad-except  # any failure of a user's loss
    raise PipelineError(
        f"The loss cannot take the last stage's output {describe(last_out)} with labels "
        f"{describe(example_labels)}: {str(e).strip().splitlines()[0]}. Check the "
        "number of classes of the last stage and the labels' shape.") from None
  if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)):
    raise PipelineError(
        "The loss must return a pair (scalar loss, dict of scalar metrics), e.g. "
        "(jnp.mean(nll), {'accuracy': accuracy}) or (loss, {}); it returned "
        f"{describe(result)}.")
  scalar, _ = result
  if scalar.shape != ():
    raise PipelineError(f"The loss must return a scalar (mean over the micro-batch); it "
                        f"returned shape {scalar.shape}.")


def check_state(state, want, num_stages: int) -> None:
  """Refuses a state of another pipeline, or one whose buffers an earlier run() consumed.

  ``want`` is the abstract state the pipeline's ``init`` makes. Structure, shapes and dtypes
  only: no device work.
  """
  leaves = jax.tree.leaves(state)
  check_not_donated(leaves)
  if jax.tree.structure(state) != jax.tree.structure(want) or any(
      np.shape(a) != w.shape or jnp.result_type(a) != w.dtype
      for a, w in zip(leaves, jax.tree.leaves(want))):
    raise PipelineError(
        "The state does not belong to this pipeline: its structure, shapes or dtypes differ "
        f"from what this pipeline's init() makes ({num_stages} stages of this model and "
        "method). Create the state with this pipeline's init(), or restore a checkpoint "
        "written by the same model and method.")


def check_state_fits(state_bytes: int, num_stages: int) -> None:
  """Refuses, before anything is allocated, a state larger than the device's memory (the memory
  the trainer checks against too: :func:`pipejax.core.accounting.memory_available`)."""
  available, where = accounting.memory_available()
  if state_bytes > available:
    raise PipelineError(
        f"init() would allocate a state of about {accounting.gib(state_bytes)} (weights, "
        f"optimizer states and the delay lines of {num_stages} stages, which grow with the "
        f"square of the stage count), more than {where} ({accounting.gib(available)}). Use "
        "fewer stages, narrower layers or a smaller micro-batch, or a ShardedPipeline over more "
        "devices (each holds its own stages' share). The state's shapes are pipe.state_spec, "
        "and jax.eval_shape(pipe.init, key) traces init without allocating.")


def stream_length(inputs, labels) -> int:
  """K, the leading axis that every leaf of a stream of micro-batches shares."""
  counts = {np.shape(a)[0] if np.ndim(a) else None for a in jax.tree.leaves((inputs, labels))}
  if len(counts) != 1 or None in counts:
    raise PipelineError(f"to_ticks() takes inputs and labels with one leading axis of K "
                        f"micro-batches each; their leading axes are {sorted(counts, key=str)}.")
  (count,) = counts
  return count


def check_whole_steps(count: int, micro_batches: int) -> None:
  if count % micro_batches:
    raise PipelineError(f"The synchronous mode steps every M = {micro_batches} micro-batches; got "
                        f"{count}, which is not a multiple of {micro_batches}. Feed whole steps.")


def _stream_ticks(inputs, labels, valid, micro_batches: int | None) -> tuple[int]:
  """The leading time axis of a stream fed to run(), checked."""
  leaves = jax.tree.leaves((inputs, labels))
  if not leaves or any(np.ndim(a) == 0 for a in leaves):
    raise PipelineError("run() takes inputs and labels with a leading time axis (ticks, b, "
                        "...); use tick() for a single micro-batch.")
  lead = (np.shape(leaves[0])[0],)
  counts = {what: {np.shape(a)[0] for a in jax.tree.leaves(tree)}
            for what, tree in (("inputs", inputs), ("labels", labels))}
  if counts["inputs"] | counts["labels"] != set(lead):
    raise PipelineError(
        f"The inputs have {sorted(counts['inputs'])} ticks and the labels "
        f"{sorted(counts['labels'])} (the leading axis): run() takes one micro-batch of "
        "each per tick. Give both the same number of ticks.")
  if valid is None and micro_batches is not None:
    raise PipelineError(
        f"The synchronous method steps every M = {micro_batches} "
        "micro-batches with the pipeline's fill and drain in between; a stream fed tick by "
        "tick without them trains asynchronously instead. Lay the stream out first: "
        "inputs, labels, valid = pipe.to_ticks(inputs, labels); pipe.run(state, inputs, "
        "labels, valid).")
  return lead


def checked_stream(inputs, labels, valid, *, example_inputs, example_labels,
                   micro_batches: int | None, ticks: bool):
  """Validates a micro-batch (``ticks=False``) or a stream of them: ``(valid as a bool array)``.

  ``micro_batches`` is the synchronous method's M (None: asynchronous).
  """
  lead = _stream_ticks(inputs, labels, valid, micro_batches) if ticks else ()
  for what, got, want in (("inputs", inputs, example_inputs),
                          ("labels", labels, example_labels)):
    got_spec = spec(got)
    if jax.tree.structure(got_spec) != jax.tree.structure(want):
      raise PipelineError(f"The {what} have structure {jax.tree.structure(got_spec)} but the "
                          f"pipeline was built for {jax.tree.structure(want)}.")
    for g, w in zip(jax.tree.leaves(got_spec), jax.tree.leaves(want)):
      if tuple(g.shape) != lead + tuple(w.shape) or g.dtype != w.dtype:
        expected = f"{lead + tuple(w.shape)} {jnp.dtype(w.dtype).name}"
        raise PipelineError(
            f"The {what} have shape {tuple(g.shape)} {jnp.dtype(g.dtype).name} but the pipeline "
            f"was built for {expected}"
            + (" (ticks, micro-batch, ...)" if ticks else " (micro-batch, ...)")
            + f". Reshape or cast the {what} (e.g. .astype(np.{jnp.dtype(w.dtype).name})), or "
            "build the pipeline for this shape. Example inputs and labels of 64-bit types are "
            "recorded as 32-bit ones, as JAX keeps them.")
  if valid is None:
    valid = np.ones(lead, bool)
  valid = jnp.asarray(valid, bool)
  if valid.shape != lead:
    raise PipelineError(f"valid must have shape {lead} (one flag per tick); got {valid.shape}.")
  return valid


def check_class_labels(labels, valid, num_classes: int | None) -> None:
  """Class labels must be integers in [0, classes): JAX would clamp -1 or 50 silently.

  ``num_classes`` is None when the loss is the user's own (it defines what its labels are). The
  range is checked on host arrays (what a data loader gives); labels already on a device are
  checked only for a stream, once per call, so a tick never waits for a device transfer. Traced
  labels (inside the caller's ``jax.jit``) have no values to check.
  """
  if num_classes is None:
    return
  if traced(valid):  # inside the caller's transform: which labels count is not known here
    return
  for leaf in jax.tree.leaves(labels):
    if not jnp.issubdtype(leaf.dtype, jnp.integer):
      raise PipelineError(
          f"The labels are {jnp.dtype(leaf.dtype).name}, but the softmax cross-entropy takes "
          "integer class indices (floats would be truncated). Build the pipeline with integer "
          "example labels and feed labels.astype(np.int32).")
    if isinstance(leaf, jax.core.Tracer) or isinstance(leaf, jax.Array) and np.ndim(valid) == 0:
      continue
    values = np.asarray(leaf)
    if np.ndim(valid):
      values = values[np.asarray(valid)]
    elif not bool(valid):
      continue
    if values.size and (values.min() < 0 or values.max() >= num_classes):
      raise PipelineError(
          f"Labels must be class indices in [0, {num_classes}) for this model's "
          f"{num_classes} outputs; got values from {values.min()} to {values.max()}. Map the "
          "labels to 0..classes-1, or build the model with more classes.")


def check_part_spans(part_spans, num_stages: int) -> None:
  """Refuses parts that are not contiguous ``(start, stop)`` stages covering every stage."""
  starts = [a for a, _ in part_spans]
  if (not part_spans or starts != [0] + [z for _, z in part_spans[:-1]]
      or part_spans[-1][1] != num_stages or any(z <= a for a, z in part_spans)):
    raise PipelineError(
        f"stack takes True, False or each part's (start, stop) stages, in order, contiguous and "
        f"covering stages 0 .. {num_stages - 1}, e.g. ((0, 1), (1, {num_stages})); got "
        f"{tuple(part_spans)}.")

