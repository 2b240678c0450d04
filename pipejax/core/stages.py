"""Stages: the pure (init, apply) pairs a pipeline is made of, and the model that chains them.

A stage is ``init(rng, x) -> params`` and ``apply(params, x, rng) -> y`` with pytree ``x`` and
``y``. ``rng`` is derived by the engine from (sample index, stage index), so a stage that draws
randomness (dropout) draws the same numbers in its forward pass and in the backward's recompute.

Flax modules become stages with :func:`from_flax`. We use **linen** rather than nnx: a linen
module's ``init``/``apply`` already *are* the pure pair the engine needs, so a stage is a thin
closure with no split/merge of object state on every tick.

**Stages with state.** A stage may also keep non-trainable :class:`Variables` (running statistics,
as Online Normalization's), in two parts by who updates them:

* ``forward`` variables are updated by the forward pass. The backward's recompute of a sample sees
  the values its forward saw (the engine stashes them with the input in the delay line), so forward
  and recompute compute the same function, as for weight stashing;
* ``backward`` variables are updated by the backward pass. The stage reads them as an extra input,
  and the cotangent the VJP returns for them is their *increment*: a ``jax.custom_vjp`` writes
  state in its backward by returning ``new - old`` as that input's cotangent. The engine adds it.

Such a stage has ``init_variables(rng, x) -> Variables`` and ``apply(params, x, rng, variables) ->
(y, forward variables after this micro-batch)``; ``infer(params, x, variables)`` evaluates it with
the variables read-only. A stage whose ``init_variables`` is None or returns None is stateless and
costs the engine nothing extra.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import optax

PyTree = Any
LossFn = Callable[[PyTree, PyTree], tuple[jax.Array, dict[str, jax.Array]]]

# The flax collection a stage's backward pass updates (see the module docstring). Every other
# collection besides "params" is updated by the forward pass.
BACKWARD_COLLECTION = "backward_state"


class Variables(NamedTuple):
  """A stateful stage's non-trainable variables, split by the pass that updates them."""

  forward: PyTree  # e.g. running mean and variance
  backward: PyTree  # e.g. Online Normalization's gradient control processes


class ModelError(ValueError):
  """A model or its stages do not fit together; the message says how to fix it."""


# A runner's run() donates the state it is given (XLA reuses its buffers for the new state), so
# every array of it is freed, also one a caller kept a reference to.
DONATED_MESSAGE = (
    "An array passed in was donated to an earlier run() call, which freed its buffers: run() "
    "consumes the state it is given, and with it every part of that state kept from before the "
    "call (e.g. params = state.stages[0].params). Use the state that call returned (state, "
    "metrics = pipe.run(state, ...)) and take its parts after the call, or keep a copy "
    "(jax.tree.map(jnp.copy, state)) before running if you need the old one.")


def donated(tree: PyTree) -> bool:
  """Whether an array of ``tree`` was freed by a donation (traced values never are)."""
  return any(isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) and a.is_deleted()
             for a in jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True)
class Stage:
  """One pipeline stage: pure ``init(rng, x) -> params`` and ``apply(params, x, rng) -> y``.

  ``input_shape``, when given, is the per-sample shape (no batch axis) the stage insists on; the
  pipeline checks it when it is built. Without it the stage takes whatever its ``init`` accepts.
  A stage with state (module docstring) also has ``init_variables`` and ``infer``, and its
  ``apply`` takes the variables as a fourth argument. ``init_with_variables``, when given, makes
  both in one call (:meth:`initial`): a flax module's init makes them together, and building a
  deep pipeline traces every stage's initialization, so one trace where two would do matters.
  ``infer_differs`` says that ``infer_with`` computes other than ``apply`` without randomness
  for a stateless stage too (:func:`from_flax`'s ``eval_kwargs``); without it such a stage
  evaluates with ``apply(params, x, None)``.
  """

  init: Callable[[jax.Array, PyTree], PyTree]
  apply: Callable[..., PyTree]
  name: str = "stage"
  input_shape: tuple[int, ...] | None = None
  init_variables: Callable[[jax.Array, PyTree], Variables | None] | None = None
  infer_with: Callable[[PyTree, PyTree, Variables], PyTree] | None = None
  init_with_variables: Callable[[jax.Array, PyTree], tuple[PyTree, Variables | None]] | None = None
  infer_differs: bool = False

  def initial(self, rng: jax.Array, x: PyTree) -> tuple[PyTree, Variables | None]:
    """``(init(rng, x), variables(rng, x))``, from one call where the stage has one."""
    if self.init_with_variables is not None:
      return self.init_with_variables(rng, x)
    return self.init(rng, x), self.variables(rng, x)

  def variables(self, rng: jax.Array, x: PyTree) -> Variables | None:
    """The initial variables for input ``x``; None for a stateless stage."""
    return None if self.init_variables is None else self.init_variables(rng, x)

  def forward(self, params: PyTree, x: PyTree, rng: jax.Array,
              variables: Variables | None) -> tuple[PyTree, PyTree]:
    """``(y, forward variables after x)``; ``(apply(params, x, rng), None)`` when stateless."""
    if variables is None:
      return self.apply(params, x, rng), None
    return self.apply(params, x, rng, variables)

  def infer(self, params: PyTree, x: PyTree, variables: Variables | None = None) -> PyTree:
    """Evaluation: the output with the variables read-only (None for a stateless stage), without
    randomness."""
    if self.infer_with is None or variables is None and not self.infer_differs:
      return self.apply(params, x, None)
    return self.infer_with(params, x, variables)


def from_flax(module, *, name: str | None = None, input_shape: Sequence[int] | None = None,
              train_kwargs: dict[str, Any] | None = None,
              eval_kwargs: dict[str, Any] | None = None, **unknown) -> Stage:
  """Makes a :class:`Stage` from a flax linen module (one line per stage).

  The module's call arguments come in two sets, as flax modules take them:

  * ``train_kwargs`` for training: ``init``, the forward and the backward's recompute, with the
    stage's ``'dropout'`` key. E.g. ``{'use_running_average': False}`` for a
    ``nn.BatchNorm(use_running_average=None)``, ``{'deterministic': False}`` for a
    ``nn.Dropout(rate)``, ``{'train': True}`` for a module of your own;
  * ``eval_kwargs`` for evaluation (:meth:`Stage.infer`), without randomness and with the
    collections passed immutable: ``{'use_running_average': True}``,
    ``{'deterministic': True}``, ``{'train': False}``.

  A module that keeps mutable collections (running statistics) becomes a stage with state: the
  collection named :data:`BACKWARD_COLLECTION` holds its backward variables, every other one its
  forward variables (module docstring), which its training call must update: building a
  pipeline refuses a stage whose forward variables its training forward leaves unchanged, and
  one that cannot evaluate, naming the argument to give.
  """
  from flax import linen as nn  # pylint: disable=import-outside-toplevel  # only here
  if isinstance(module, type) and issubclass(module, nn.Module):
    raise ModelError(f"from_flax takes a module instance, e.g. from_flax({module.__name__}(...)) "
                     f"with its arguments; got the class {module.__name__} itself.")
  if not isinstance(module, nn.Module):
    raise ModelError(f"from_flax takes a flax linen module (e.g. nn.Dense(10)); got "
                     f"{type(module).__name__}. Wrap a plain function as pipejax.Stage(init, "
                     "forward).")
  stage_name = name or type(module).__name__
  train_kwargs = _call_kwargs(train_kwargs, "train_kwargs", stage_name)
  eval_kwargs = _call_kwargs(eval_kwargs, "eval_kwargs", stage_name)
  if unknown:
    given = ", ".join(f"{k}={v!r}" for k, v in unknown.items())
    raise ModelError(
        f"from_flax('{stage_name}') takes the module's call arguments in two sets, "
        "train_kwargs for training (init, forward and recompute) and eval_kwargs for "
        f"evaluation; got {given} on its own, which would serve both (a BatchNorm's statistics "
        "would then never move, or evaluation would try to update them). Pass e.g. "
        f"from_flax(module, train_kwargs={dict(unknown)!r}, eval_kwargs={{...}}) with the "
        "values for inference.")
  if isinstance(input_shape, int):
    input_shape = (input_shape,)

  def init_all(rng, x):
    return module.init({"params": rng, "dropout": rng}, x, **train_kwargs)

  def init(rng, x):
    return init_all(rng, x).get("params", {})

  def init_variables(rng, x):
    return _as_variables(init_all(rng, x), x)

  def init_with_variables(rng, x):
    everything = init_all(rng, x)
    return everything.get("params", {}), _as_variables(everything, x)

  def _as_variables(everything, x):
    collections = {k: v for k, v in everything.items() if k != "params"}
    if not collections:
      return None
    if "batch_stats" in collections and {a.shape[0] for a in jax.tree.leaves(x)} == {1}:
      raise ModelError(
          f"Stage '{stage_name}' keeps BatchNorm statistics ('batch_stats') at micro-batch size "
          "1, where batch statistics are degenerate (a dense layer's normalized output is "
          "identically zero). Use Online Normalization (pipejax.models.online_norm.OnlineNorm, "
          "normalization='online' in the model builders), made for batch 1, or GroupNorm or "
          "LayerNorm; or train with a larger micro-batch.")
    backward = collections.pop(BACKWARD_COLLECTION, {})
    return Variables(collections, backward)

  def rngs_for(rng):
    return None if rng is None else {"dropout": rng}

  def apply(params, x, rng, variables=None):
    if variables is None:
      return module.apply({"params": params}, x, rngs=rngs_for(rng), **train_kwargs)
    y, forward = module.apply(_all_collections(params, variables), x, rngs=rngs_for(rng),
                              mutable=list(variables.forward), **train_kwargs)
    return y, {k: forward[k] for k in variables.forward}

  def infer_with(params, x, variables):
    collections = {"params": params} if variables is None else _all_collections(params, variables)
    return module.apply(collections, x, **eval_kwargs)

  return Stage(init=init, apply=apply, name=stage_name,
               input_shape=tuple(input_shape) if input_shape is not None else None,
               init_variables=init_variables, infer_with=infer_with,
               init_with_variables=init_with_variables,
               infer_differs=_differ(train_kwargs, eval_kwargs))


def _differ(train_kwargs: dict, eval_kwargs: dict) -> bool:
  """Whether the two sets may call the module differently. By identity: values may be arrays (an
  attention mask), whose ``==`` is elementwise; equal values that are not the same object only
  cost a trace of the stage's evaluation."""
  return train_kwargs.keys() != eval_kwargs.keys() or any(
      train_kwargs[k] is not eval_kwargs[k] for k in train_kwargs)


def _call_kwargs(kwargs, what: str, stage_name: str) -> dict[str, Any]:
  if kwargs is None:
    return {}
  if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
    raise ModelError(f"from_flax('{stage_name}'): {what} must be a dict of the module's keyword "
                     f"arguments, e.g. {{'train': True}}; got {kwargs!r}.")
  return dict(kwargs)


def _all_collections(params, variables: Variables) -> dict:
  return {"params": params, **variables.forward, BACKWARD_COLLECTION: variables.backward}


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array):
  """Mean cross-entropy over the micro-batch, with accuracy as a metric.

  ``labels`` holds one class per row of ``logits`` but the last axis: ``(b,)`` for ``(b, C)``
  logits, ``(b, T)`` for per-token ``(b, T, C)`` ones; both are averaged over every label.
  """
  logits = logits.astype(jnp.float32)
  log_probs = jax.nn.log_softmax(logits)
  nll = -jnp.take_along_axis(log_probs, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
  accuracy = jnp.mean((jnp.argmax(logits, -1) == labels).astype(jnp.float32))
  return jnp.mean(nll), {"accuracy": accuracy}


@dataclasses.dataclass(frozen=True)
class Model:
  """A sequence of stages whose last output goes into ``loss(outputs, labels)``.

  ``loss`` returns ``(scalar_loss, metrics_dict)``; metrics are scalars averaged over the
  micro-batch.

  One :class:`Stage` object at consecutive places, ``[stem] + [block] * n + [head]``, *declares*
  a stack: its stages are one module whose weights each stage draws from its own key (a layer
  axis, as scanned layers have). The model traces it once, not once per stage, and a stacked
  runner (``pipejax.parallel.stacking``) takes the run as a stack without comparing its stages'
  programs, so building a deep pipeline costs about what a shallow one does.
  """

  stages: tuple[Stage, ...]
  loss: LossFn = softmax_cross_entropy

  def __post_init__(self):
    if isinstance(self.stages, Stage):
      raise ModelError("Model takes a list of stages, e.g. Model([stage]) for a single one; got "
                       "one Stage.")
    object.__setattr__(self, "stages", tuple(self.stages))
    if not self.stages:
      raise ModelError("A model needs at least one stage (got S = 0). Pass a non-empty list of "
                       "stages, e.g. Model([from_flax(nn.Dense(10))]).")
    for i, stage in enumerate(self.stages):
      if not isinstance(stage, Stage):
        raise ModelError(f"Stage {i} is a {type(stage).__name__}, not a pipejax Stage; wrap flax "
                         "modules with pipejax.from_flax(module).")
    # Model.trace's results by the abstract signature of its arguments (see there).
    object.__setattr__(self, "_traces", {})

  @property
  def num_stages(self) -> int:
    return len(self.stages)

  def stage_label(self, s: int) -> str:
    return f"stage {s} ('{self.stages[s].name}')"

  def repeats(self, s: int) -> bool:
    """Whether stage ``s`` is the same :class:`Stage` object as stage ``s - 1``: the two belong to
    a declared stack (class docstring)."""
    return s > 0 and self.stages[s] is self.stages[s - 1]

  def apply(self, params: Sequence[PyTree], x: PyTree, rng: jax.Array | None = None,
            variables: Sequence[Variables | None] | None = None) -> PyTree:
    """The whole network as one function, unpipelined: every stage in order on ``x``.

    Args:
      params: one params tree per stage.
      x: a batch of inputs.
      rng: None for no randomness; else stage ``s`` draws from ``jax.random.fold_in(rng, s)``.
      variables: one :class:`Variables` (or None, for a stateless stage) per stage: given, the
        stages evaluate (:meth:`Stage.infer`: the variables read-only, :func:`from_flax`'s
        ``eval_kwargs``, no randomness); without them they run their training ``apply``.

    Returns:
      The last stage's output (what ``loss`` takes).

    Raises:
      ModelError: ``params`` or ``variables`` is not one entry per stage, ``rng`` is given
        together with variables, or an array of them was donated to a runner's ``run()``.
    """
    if donated((params, variables)):
      raise ModelError(DONATED_MESSAGE)
    if len(params) != self.num_stages:
      raise ModelError(f"Model.apply takes one params tree per stage: {len(params)} for "
                       f"{self.num_stages} stages.")
    if variables is not None and len(variables) != self.num_stages:
      raise ModelError(f"Model.apply takes one Variables (or None) per stage: {len(variables)} "
                       f"for {self.num_stages} stages.")
    if rng is not None and any(v is not None for v in variables or ()):
      raise ModelError("Model.apply evaluates stages with variables read-only, without "
                       "randomness; pass rng=None with variables.")
    evaluate = variables is not None and rng is None
    for s, (stage, p, v) in enumerate(zip(self.stages, params, variables or [None] * len(params))):
      if evaluate:
        x = stage.infer(p, x, v)
      else:
        x = stage.apply(p, x, None if rng is None else jax.random.fold_in(rng, s))
    return x

  def trace_shapes(self, rng: jax.Array, x: PyTree) -> tuple[list[PyTree], list[PyTree]]:
    """Abstractly runs init and apply of every stage on a micro-batch ``x``.

    Returns (params shapes, input shapes) per stage, as ``jax.ShapeDtypeStruct`` trees, without
    any computation. A stage that cannot take its predecessor's output is a :class:`ModelError`
    naming both stages and both shapes.
    """
    traced = self.trace(rng, x)
    return list(traced.params), list(traced.inputs)

  def trace(self, rng: jax.Array, x: PyTree) -> ModelTrace:
    """:meth:`trace_shapes`, with each stage's ``initial`` and ``forward`` as programs.

    A deep pipeline is built from these: ``pipejax.parallel.stacking`` compares the forwards to
    find identical stages, and the engine initializes each stage by running its ``initial``
    program, so that building traces each stage's initialization and forward once.

    The result depends on the shapes and dtypes of ``rng`` and ``x`` alone (the programs take the
    key and the input as arguments), so a model traces once per such signature, for every
    pipeline and check built on it: the pipelines of several methods over one model share it.
    """
    leaves, structure = jax.tree.flatten((rng, x))
    signature = (structure, tuple((jnp.shape(a), jnp.result_type(a)) for a in leaves))
    if signature not in self._traces:
      self._traces[signature] = self._trace(rng, x)
    return self._traces[signature]

  def _trace(self, rng: jax.Array, x: PyTree) -> ModelTrace:
    params_shapes, input_shapes, forwards, initials = [], [], [], []
    keys = jax.random.split(rng, self.num_stages)
    x = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), x)
    for s, stage in enumerate(self.stages):
      if s and self.repeats(s) and _fmt(x) == _fmt(input_shapes[-1]):
        # A declared stack (class docstring): the programs take the key and the input as
        # arguments, so the previous stage's serve this one; its output is its input's shape.
        for found in (params_shapes, input_shapes, forwards, initials):
          found.append(found[-1])
        continue
      source = "the input batch" if s == 0 else self.stage_label(s - 1)
      if stage.input_shape is not None:
        got = jax.tree.map(lambda a: tuple(a.shape[1:]), x)
        if got != stage.input_shape:
          raise ModelError(
              f"{source} produces per-sample shape {_fmt(x)} but {self.stage_label(s)} expects "
              f"per-sample shape {stage.input_shape}. Change one of the two stages so they agree.")
      try:
        initial, (p, v) = jax.make_jaxpr(stage.initial, return_shape=True)(keys[s], x)
        forward, (y, _) = jax.make_jaxpr(stage.forward, return_shape=True)(p, x, keys[s], v)
      except ModelError:
        raise
      except Exception as e:  # flax/XLA shape errors are long; keep the first line.
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(
            f"{source} produces {_fmt(x)}, which {self.stage_label(s)} cannot take: {first_line}. "
            "Change one of the two stages so the output of the first fits the input of the "
            "second.") from None
      # The engine moves each micro-batch's samples through the delay lines together, and the
      # loss averages over them: a stage that merges or splits samples would train silently wrong.
      batch = jax.tree.leaves(input_shapes[0] if input_shapes else x)[0].shape[0]
      changed = [tuple(a.shape) for a in jax.tree.leaves(y) if a.shape[:1] != (batch,)]
      if changed:
        raise ModelError(
            f"{self.stage_label(s)} turns a micro-batch of {batch} into outputs of shape "
            f"{changed[0]}: every output of a stage must keep the leading micro-batch axis "
            f"({batch}), one row per sample. Reshape within each sample, e.g. "
            "x.reshape(x.shape[0], -1).")
      _check_variables_move(self.stage_label(s), forward, (p, x, keys[s]), v)
      _check_evaluates(self.stage_label(s), stage, forward, (p, x, keys[s]), v, y)
      params_shapes.append(p)
      input_shapes.append(x)
      forwards.append(forward)
      initials.append(InitialProgram(initial, jax.tree.structure((p, v))))
      x = y
    return ModelTrace(tuple(params_shapes), tuple(input_shapes), tuple(forwards), tuple(initials),
                      {})


def _check_variables_move(label: str, forward: jax_core.ClosedJaxpr, before: tuple,
                          variables: Variables | None) -> None:
  """Refuses forward variables that the traced training forward returns as it took them: they
  would keep their initial values for ever (``before``: the forward's arguments before them)."""
  if variables is None or not jax.tree.leaves(variables.forward):
    return
  paths = jax.tree_util.tree_leaves_with_path(variables.forward)
  start = len(jax.tree.leaves(before))
  taken = forward.jaxpr.invars[start:start + len(paths)]
  returned = forward.jaxpr.outvars[len(forward.jaxpr.outvars) - len(paths):]
  frozen = [jax.tree_util.keystr(path) for (path, _), a, b in zip(paths, taken, returned)
            if a is b]
  if frozen:
    raise ModelError(
        f"{label} keeps forward variables that its training forward returns unchanged "
        f"({', '.join(frozen[:3])}{', ...' if len(frozen) > 3 else ''}), so they would keep "
        "their initial values for ever (a BatchNorm's running mean 0 and variance 1) and "
        "evaluation would read those. Update them in training: flax's BatchNorm needs "
        "use_running_average=False there and True in evaluation, e.g. "
        "from_flax(nn.BatchNorm(use_running_average=None), train_kwargs={'use_running_average': "
        "False}, eval_kwargs={'use_running_average': True}). A value that never changes "
        "belongs in the stage's closure, not in its variables.")


def _check_evaluates(label: str, stage: Stage, forward: jax_core.ClosedJaxpr, before: tuple,
                     variables: Variables | None, trained) -> None:
  """Traces the stage's evaluation (:meth:`Stage.infer`) where it is not its training forward
  without randomness, and refuses one that fails or gives another shape than training."""
  key = forward.jaxpr.invars[len(jax.tree.leaves(before[:2]))]
  draws = any(key is a for eqn in forward.jaxpr.eqns for a in eqn.invars)
  if variables is None and not stage.infer_differs and not draws:
    return
  params, x, _ = before
  try:
    evaluated = jax.eval_shape(stage.infer, params, x, variables)
  except ModelError:
    raise
  except Exception as e:  # pylint: disable=broad-except  # flax's errors are long
    first_line = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else \
        type(e).__name__
    raise ModelError(
        f"{label} cannot evaluate: {first_line}. Evaluation (Stage.infer: Model.apply with "
        "variables, the trainer's test) reads the variables without updating them and draws "
        "no randomness; give from_flax the module's arguments for it as eval_kwargs, e.g. "
        "{'use_running_average': True} for a BatchNorm, {'deterministic': True} for a Dropout, "
        "{'train': False} for a module of your own (and the training ones as "
        "train_kwargs).") from None
  if _fmt(evaluated) != _fmt(trained):
    raise ModelError(f"{label} evaluates to {_fmt(evaluated)} but trains to {_fmt(trained)}; "
                     "the next stage takes one shape. Make its eval_kwargs give the training "
                     "output's shape.")


class InitialProgram(NamedTuple):
  """A stage's ``initial(rng, x)`` as a closed jaxpr of the key and the input's leaves."""

  closed: jax_core.ClosedJaxpr
  out_tree: Any  # the structure of (params, variables)

  def __call__(self, rng: jax.Array, x: PyTree) -> tuple[PyTree, Variables | None]:
    leaves = jax_core.jaxpr_as_fun(self.closed)(rng, *jax.tree.leaves(x))
    return jax.tree.unflatten(self.out_tree, leaves)


class ModelTrace(NamedTuple):
  """What :meth:`Model.trace` finds, one entry per stage."""

  params: tuple  # ShapeDtypeStruct trees of the parameters
  inputs: tuple  # ShapeDtypeStruct trees of the input micro-batch
  forwards: tuple  # closed jaxprs of forward(params, x, rng, variables)
  initials: tuple  # InitialProgram of initial(rng, x)
  # Programs compiled from the trace, kept with it for every pipeline built on it (the initial
  # weights: pipejax.core.initial.CompiledInit), by the signature of their arguments.
  compiled: dict


def plain_step(model: Model, tx):
  """One optax step of the whole network, unpipelined (:meth:`Model.apply`), for ``lax.scan``:
  ``(params, opt_state), (x, y) -> ((params, opt_state), loss)``, ``tx`` an optax
  transformation. The baseline the pipeline is measured against."""
  def loss_fn(params, x, y):
    return model.loss(model.apply(params, x), y)[0]

  def step(carry, batch):
    params, opt_state = carry
    loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  return step


def _fmt(tree: PyTree) -> str:
  leaves = jax.tree.leaves(tree)
  if len(leaves) == 1:
    a = leaves[0]
    return f"{tuple(a.shape)} {jnp.dtype(a.dtype).name}"
  return str(jax.tree.map(lambda a: f"{tuple(a.shape)} {jnp.dtype(a.dtype).name}", tree))
