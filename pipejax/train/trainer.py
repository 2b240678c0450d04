"""``train_and_evaluate(config, workdir)``: train a model with any method, stop anywhere, resume.

The config is resolved once into a :class:`~pipejax.train.plan.RunPlan` (:func:`train` takes
one). The loop feeds the pipeline in chunks of ``config.ticks_per_chunk`` ticks (one
``lax.scan`` each), and does everything else between chunks: progress lines, metrics, test
evaluation with the current weights, checkpoints, and the finite check. Checkpoints are taken only
between chunks and the chunk length is fixed by the config, so a resumed run replays exactly the
computation of a run that never stopped (bit-identical on CPU).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import time

from absl import logging
import jax
import numpy as np

from pipejax import files
from pipejax.train import plan as plan_lib
from pipejax.train import resume
from pipejax.train import run_checks
from pipejax import data as data_lib
from pipejax.train import divergence
from pipejax.train import evaluation
from pipejax.train import experiment
from pipejax.train import interruption
from pipejax.train import metrics as metrics_lib
from pipejax.train import workdir as workdir_lib
from pipejax.train.checkpoint import Checkpointer, CheckpointError
from pipejax.train.checkpoint import weights_digest
from pipejax.core.checks import PipelineError
from pipejax.train.config_checks import ConfigError
from pipejax.train.plan import RunPlan
from pipejax.data import DataError
from pipejax.train.divergence import TrainingDiverged
from pipejax.methods import MethodError
from pipejax.core.stages import ModelError
from pipejax.train.workdir import StorageError, storage_error


def train_and_evaluate(config, workdir: str) -> dict:
  """Trains ``config`` in ``workdir``: :func:`train` of its plan
  (:func:`pipejax.train.plan.resolve`, which checks every field)."""
  return train(plan_lib.resolve(config), workdir)


def train(plan: RunPlan, workdir: str) -> dict:
  """Trains ``plan`` in ``workdir`` (resuming from its latest checkpoint) and evaluates it.

  The workdir is checked usable (creating nothing), the data loaded and
  the model built (abstractly), and the run checked against them (its length, the devices, the
  memory); only then is the workdir made, probed and locked (one run at a time), so that a
  refused config leaves no directory behind. Returns
  the final summary (also written to ``workdir/summary.json``); a run stopped by SIGTERM/SIGINT
  returns early with ``summary['stopped_by']`` set, after saving a checkpoint. A finished workdir
  is reported again, not retrained or re-evaluated.
  """
  workdir_lib.check_usable(workdir)  # creates nothing: claim() below makes and locks it
  # In a multi-host run every process computes the same metrics; one writes them.
  primary = jax.process_index() == 0
  try:
    with interruption.SetupPhases() as phases:
      # Every check of the config, those that need the data's size or the devices too, before
      # the workdir is claimed: a refused run leaves no directory behind (a mistyped --workdir).
      phases.enter("loading the data and building the model")
      setup = experiment.build(plan)
      total_ticks = experiment.run_ticks(plan, len(setup.train_source))
      run_checks.check_pipeline_fills(plan, setup.pipeline, total_ticks)
      run_checks.check_memory(plan, setup, min(plan.ticks_per_chunk, total_ticks))
      with workdir_lib.claim(workdir, lock=primary):
        finished = _earlier_run_without_checkpoints(plan, workdir)
        if finished is not None:
          return finished
        return _train(plan, workdir, primary, phases, setup, total_ticks)
  except OSError as e:  # data, metrics, plots, summary: a disk that filled up or turned read-only
    problem = _storage_problem(workdir, e)
    if problem is None:
      raise
    raise problem from None


def _storage_problem(workdir: str, error: OSError) -> StorageError | None:
  """The one-paragraph error for an ``OSError`` of a run (no space, no permission), else None.

  An error that names a file outside the workdir (a data file, a cache) says so, not that the
  workdir cannot be written.
  """
  root = os.path.abspath(workdir)
  path = error.filename
  if isinstance(path, (str, bytes)) and not _within(os.fsdecode(path), root):
    path = os.fsdecode(path)
    if storage_error("", path, error) is None:
      return None
    return StorageError(
        f"{path} cannot be used ({workdir_lib.first_line(error)}); it lies outside the workdir "
        f"{root}, whose files are intact. Give this user access to it (or free space on its "
        "disk, if that is full) and rerun the same command.")
  return storage_error("Writing to the workdir", root, error)


def _within(path: str, root: str) -> bool:
  """Whether ``path`` lies in the directory ``root``, as written or with links resolved."""
  return any(os.path.commonpath([p, r]) == r for p, r in (
      (os.path.abspath(path), root), (os.path.realpath(path), os.path.realpath(root))))


def _train(plan: RunPlan, workdir: str, primary: bool, phases: interruption.SetupPhases,
           setup: experiment.Setup, total_ticks: int) -> dict:
  pipe, runner = setup.pipeline, setup.runner
  b = plan.micro_batch_size
  augment = setup.train_source.default_augment if plan.data.augment else None
  stream = data_lib.DataStream(setup.train_source, b, plan.seed, augment=augment)

  data_fingerprint = data_lib.fingerprint.fingerprint(setup.train_source, setup.test_source)
  if jax.process_count() > 1:
    from pipejax.parallel import distributed  # pylint: disable=g-import-not-at-top
    distributed.agree_on_data(data_fingerprint)
  total_samples = total_ticks * b

  feed = placement = None
  if jax.process_count() > 1:  # each process feeds and saves its own devices' part
    from pipejax.parallel import distributed  # pylint: disable=g-import-not-at-top
    feed, placement = distributed.trainer_parts(setup.sharded)
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), plan.output.keep_checkpoints,
                              primary=primary, placement=placement)
  phases.enter(f"initialising the pipeline state ({pipe.num_stages} stages)")
  state = setup.init(jax.random.PRNGKey(plan.seed))
  init_digest = weights_digest(runner.host_params(state))
  phases.enter("looking for a checkpoint to resume")
  state, samples, seconds_before, meta = _resume(plan, checkpointer, runner, stream, state,
                                                 data_fingerprint)
  if meta is not None:
    finished = _finished_summary(workdir, samples, total_samples)
    if finished is not None:
      checkpointer.close()
      return finished
    if primary:
      resume.record_changes(plan, workdir, meta, samples, data=data_fingerprint)

  writer = metrics_lib.MetricsWriter(workdir, resume_samples=samples if meta is not None else None,
                                     enabled=primary)
  _log_start(plan, workdir, primary, setup, total_samples, init_digest)
  run = _Run(plan, setup, stream, checkpointer, writer, samples, seconds_before,
             data_fingerprint)
  # The test loss at the initial weights: a study counts a run whose final loss is above it as
  # diverged, however finite its numbers.
  if samples == 0 and not writer.has_record("test", 0):
    phases.enter("evaluating the initial weights on the test split")
    run.evaluate(state)
  phases.enter(f"compiling the chunk (a scan over ticks of {pipe.num_stages} stages) and "
               "running the first one")
  with interruption.StopRequest() as stop:
    state, stopped_by, test_result = _train_chunks(run, state, feed, total_samples, primary,
                                                   phases, stop)
    if stopped_by is None:
      if checkpointer.latest_samples() != run.samples:
        run.save(state)
      test_result = run.evaluate(state)
      resolved = experiment.resolved_optimizer(plan)
      writer.write_hparams(
          {**resume.flat_given(plan), "num_stages": pipe.num_stages,
           **{f"resolved.{'lr' if k == 'learning_rate' else k}": v
              for k, v in resolved.items() if v is not None}},
          {"test_accuracy": test_result["accuracy"], "test_loss": test_result["loss"]})
    # Still under the stop request: a SIGTERM while the run writes its last files must not kill
    # it between its final checkpoint and summary.json (the run has finished; it exits 0).
    writer.close()
    if primary and stopped_by is None and plan.output.plot_curves:
      # Once, at the end: TensorBoard and scripts/plot.py show a run in progress.
      metrics_lib.plot_runs({plan.method: metrics_lib.read_records(workdir)},
                            os.path.join(workdir, "curves.png"),
                            title=f"{plan.model.name} on {plan.data.dataset}, {plan.method}, "
                            f"b={b}")
    checkpointer.close()
    summary = _summary(plan, workdir, run, total_samples, stopped_by, test_result, init_digest)
    if primary:
      files.write_json(os.path.join(workdir, "summary.json"), summary, indent=2)
  return summary


def _resume(plan: RunPlan, checkpointer: Checkpointer, runner, stream: data_lib.DataStream, state,
            data_fingerprint: dict):
  """The state, samples seen, training seconds and checkpoint metadata of the newest checkpoint
  (``state``, 0, 0.0 and None when there is none)."""
  restored = checkpointer.restore_newest(
      runner.to_logical(state),
      lambda samples, meta: resume.check_resumable(plan, checkpointer, samples, meta,
                                                   data=data_fingerprint))
  if restored is None:
    return state, 0, 0.0, None
  saved_at, logical_state, meta = restored
  state = runner.from_logical(logical_state)
  stream.set_state(meta["data_position"])
  samples = int(meta["samples"])
  seconds_before = float(meta.get("train_seconds", 0.0))
  logging.info("Resumed from the checkpoint at %d samples in %s.", saved_at,
               checkpointer.directory)
  return state, samples, seconds_before, meta


def _log_start(plan: RunPlan, workdir: str, primary: bool, setup: experiment.Setup,
               total_samples: int, init_digest: str) -> None:
  """Writes the run's config.json and logs what it trains."""
  pipe, recipe, train_source = setup.pipeline, setup.recipe, setup.train_source
  if primary:
    files.write_json(os.path.join(workdir, "config.json"), dict(plan.given), indent=2,
                     default=str)
  logging.info("Initial weights: sha256 %s (the same for every method at this seed and split).",
               init_digest)
  logging.info("Model: %d stage%s; method %s; micro-batch %d; lr %.3g, momentum %.5f, weight decay "
               "%.3g; %d optimizer steps per stage (%d of warm-up); delays %s; %d training "
               "samples.", pipe.num_stages, "" if pipe.num_stages == 1 else "s", plan.method,
               plan.micro_batch_size, recipe.learning_rate, recipe.momentum,
               recipe.weight_decay, *experiment.optimizer_steps(plan, len(train_source)),
               pipe.delays, total_samples)
  warning = experiment.delay_memory_warning(plan, pipe.delays)
  if warning is not None:
    logging.warning(warning)


class _Run:
  """What the chunks of one run share: where it stands, and how it saves and evaluates."""

  def __init__(self, plan: RunPlan, setup: experiment.Setup, stream: data_lib.DataStream,
               checkpointer: Checkpointer, writer: metrics_lib.MetricsWriter, samples: int,
               seconds_before: float, data_fingerprint: dict):
    self.plan, self.setup, self.stream = plan, setup, stream
    self.data_fingerprint = data_fingerprint
    self.checkpointer, self.writer = checkpointer, writer
    self.samples, self.seconds_before = samples, seconds_before
    self.start_time = time.perf_counter()
    self.evaluator = evaluation.make_evaluator(
        setup.model, run_checks.eval_batch_size(plan, len(setup.test_source)))
    # The base rate, logged beside the loss: one compiled program, where the schedule's eager
    # operations would each compile on their first use in a process.
    self.learning_rate = jax.jit(experiment.learning_rate_schedule(plan,
                                                                   len(setup.train_source)))

  def train_seconds(self) -> float:
    return self.seconds_before + time.perf_counter() - self.start_time

  def save(self, state) -> None:
    self.checkpointer.save(self.samples, self.setup.runner.to_logical(state), {
        "samples": self.samples, "data_position": self.stream.get_state(),
        **resume.meta(self.plan), "data": self.data_fingerprint,
        "train_seconds": self.train_seconds()})
    self.writer.flush()

  def evaluate(self, state) -> dict:
    samples, writer = self.samples, self.writer
    stages = self.setup.runner.to_logical(state).stages
    result = self.evaluator([st.params for st in stages], self.setup.test_source,
                            [st.variables for st in stages])
    # A rerun of a run killed after its final evaluation (and before summary.json) evaluates the
    # same state again: its record is already there, kept by the resume.
    if not writer.has_record("test", samples):
      writer.write("test", samples, **result)
    logging.info("[%d samples] test loss %.4f, test accuracy %.4f", samples, result["loss"],
                 result["accuracy"])
    return result

  def record_chunk(self, chunk_metrics: dict, first_tick: int, rate: float, total_samples: int,
                   primary: bool) -> None:
    """Writes a chunk's training metrics and logs its progress line."""
    samples, writer, pipe = self.samples, self.writer, self.setup.pipeline
    seen = np.asarray(chunk_metrics["valid"])
    if seen.any():
      writer.write("train", samples, loss=float(np.mean(chunk_metrics["loss"][seen])),
                   accuracy=float(np.mean(chunk_metrics["accuracy"][seen])),
                   learning_rate=float(self.learning_rate(samples // self.setup.recipe.batch_size)),
                   samples_per_second=rate)
    if "weight_discrepancy" in chunk_metrics:
      writer.write("diagnostics", samples, weight_discrepancy=_mean_over_backwards(
          np.asarray(chunk_metrics["weight_discrepancy"]), pipe.delays, first_tick))
    # A chunk inside the fill has no sample at the loss yet: said so, not a loss of nan that
    # reads as a divergence.
    what = (f"loss {np.mean(chunk_metrics['loss'][seen]):.4f}, accuracy "
            f"{np.mean(chunk_metrics['accuracy'][seen]):.3f}" if seen.any() else
            "filling the pipeline: no sample has reached the loss yet")
    # Every process computes the same numbers; the others' lines are for --verbosity=1.
    logging.log(logging.INFO if primary else logging.DEBUG,
                "[%d/%d samples, epoch %.2f] %s, %.0f samples/s, ETA %s",
                samples, total_samples, samples / len(self.setup.train_source), what,
                rate, metrics_lib.format_duration((total_samples - samples) / max(rate, 1e-9)))


def _train_chunks(run: _Run, state, feed, total_samples: int, primary: bool,
                  phases: interruption.SetupPhases, stop: interruption.StopRequest):
  """Trains chunk after chunk until the run's end or a stop request; returns the state, the
  signal that stopped it (None at the end) and the last test result (None if none)."""
  plan, runner, b = run.plan, run.setup.runner, run.plan.micro_batch_size
  interval_start = (time.perf_counter(), run.samples)
  stopped_by = None
  test_result = None
  while run.samples < total_samples:
    # The last chunk is shorter when the run is not a whole number of chunks: the run's length
    # and its schedule follow from the config alone.
    ticks = min(plan.ticks_per_chunk, (total_samples - run.samples) // b)
    if feed is None:
      x, y = run.stream.next_chunk(ticks)
      x, y, valid = runner.to_ticks(x, y)
    else:
      x, y, valid = feed.next_chunk(run.stream, ticks)
    first_tick = int(state.tick)
    state, chunk_metrics = runner.run(state, x, y, valid)
    chunk_metrics = jax.device_get(chunk_metrics)
    stop.training_started()
    phases.done()
    divergence.raise_if_diverged(plan, run.setup.model, runner.weights_finite(state),
                                 chunk_metrics["finite"], valid, first_tick, run.samples,
                                 run.checkpointer)
    previous, run.samples = run.samples, run.samples + ticks * b
    samples = run.samples
    # The rate of this interval alone: a running average would count compile time forever.
    now = time.perf_counter()
    rate = (samples - interval_start[1]) / max(now - interval_start[0], 1e-9)
    interval_start = (now, samples)
    run.record_chunk(chunk_metrics, first_tick, rate, total_samples, primary)
    crossed = lambda every: samples // every != previous // every
    if crossed(plan.output.eval_every_samples) and samples < total_samples:
      test_result = run.evaluate(state)
    if interruption.agree_to_stop(stop.signal_name is not None):
      stopped_by = stop.signal_name or "a signal to another process"
      logging.warning("Stop requested by %s after %d samples: saving a checkpoint.", stopped_by,
                      samples)
    if crossed(plan.output.checkpoint_every_samples) or stopped_by:
      run.save(state)
    if stopped_by:
      logging.warning("Stopped by %s after %d samples; checkpoint saved in %s. Rerun the same "
                      "command to resume.", stopped_by, samples, run.checkpointer.directory)
      break
  return state, stopped_by, test_result


def _summary(plan: RunPlan, workdir: str, run: _Run, total_samples: int, stopped_by: str | None,
             test_result: dict | None, init_digest: str) -> dict:
  """The run's summary.json."""
  return {
      "samples": run.samples, "total_samples": total_samples, "stopped_by": stopped_by,
      "method": plan.method, "model": plan.model.name, "dataset": plan.data.dataset,
      "micro_batch_size": plan.micro_batch_size, "num_stages": run.setup.pipeline.num_stages,
      "mesh": {"data": plan.mesh.data, "stage": plan.mesh.stage},
      **experiment.resolved_optimizer(plan),
      "train_seconds": run.train_seconds(),
      "test_accuracy": None if test_result is None else test_result["accuracy"],
      "test_loss": None if test_result is None else test_result["loss"],
      "init_digest": init_digest,
      **_run_facts(workdir),
      "plan": plan.to_json(),
  }


def _finished_summary(workdir: str, samples: int, total_samples: int) -> dict | None:
  """The summary of a run that already finished at ``samples``, or None."""
  try:
    with open(os.path.join(workdir, "summary.json")) as f:
      summary = json.load(f)
  except (OSError, ValueError):
    return None
  if not isinstance(summary, dict):  # damaged: the run writes it again when it finishes
    return None
  if (samples >= total_samples and summary.get("stopped_by") is None
      and summary.get("samples") == samples and summary.get("test_accuracy") is not None):
    logging.info("This run finished before (%d samples); reporting its summary, nothing is "
                 "retrained or re-evaluated.", samples)
    return summary
  return None


def _earlier_run_without_checkpoints(plan: RunPlan, workdir: str) -> dict | None:
  """Decides, before anything is written, over a workdir without checkpoints that holds the
  results of an earlier run: a summary.json in whatever state (a finished run's, a stopped run's,
  left empty by a kill or a full disk), or metrics.jsonl records of training (past the initial
  evaluation, which any run makes again), with or without a summary.

  Rerun with the earlier run's settings, a finished run (a whole summary) is reported again, and
  any other one trains again from the start, which writes the same records. With other settings,
  or settings that cannot be read back, it is refused: a fresh start would truncate metrics.jsonl,
  the record of truth, and replace config.json, the summary and the curves. None when the workdir
  holds checkpoints (the resume decides), holds no earlier run, or the run trains again.
  """
  directory = os.path.join(workdir, "checkpoints")
  if os.path.lexists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
    return None
  summary_path = os.path.join(workdir, "summary.json")
  summary = None
  try:
    with open(summary_path) as f:
      summary = json.load(f)
  except (OSError, ValueError):  # missing, or left empty or cut short by a kill or a full disk
    pass
  records = metrics_lib.read_records(workdir)
  trained = any(isinstance(r.get("samples"), int) and r["samples"] > 0 for r in records)
  if not (trained or os.path.exists(summary_path)):
    return None
  config_path = os.path.join(workdir, "config.json")
  try:
    with open(config_path) as f:
      changes = resume.recipe_changes(plan, json.load(f))
  except (OSError, ValueError, AttributeError) as e:
    changes = f"its config.json cannot be read ({workdir_lib.first_line(e)})"
  finished = (isinstance(summary, dict) and summary.get("stopped_by") is None
              and summary.get("test_accuracy") is not None)
  if not changes:
    if not finished:
      logging.info("The workdir holds an earlier run of these settings without checkpoints; "
                   "training again from the start (it writes the same records).")
      return None
    logging.info("This run finished before (%s samples) and its checkpoints have been deleted; "
                 "reporting its summary, nothing is retrained or re-evaluated.",
                 summary.get("samples"))
    return summary
  raise ConfigError(
      f"The workdir {os.path.abspath(workdir)} holds the results of "
      f"{_describe_earlier_run(summary, records, finished)} but no checkpoints, trained with "
      f"other settings than this run: {changes}. Training here would overwrite "
      "its summary, metrics and curves. Choose another --workdir for the new settings, or move "
      "that run's files away first.")


def _describe_earlier_run(summary, records: list[dict], finished: bool) -> str:
  """'a finished run (method 'pb', 240 samples, test accuracy 0.9)', 'a run stopped by SIGTERM
  (...)', or 'an earlier run (its metrics reach 160 samples; no readable summary.json)'."""
  if isinstance(summary, dict) and (finished or summary.get("stopped_by")):
    what = "a finished run" if finished else f"a run stopped by {summary['stopped_by']}"
    accuracy = f", test accuracy {summary['test_accuracy']}" if finished else ""
    return (f"{what} (method {summary.get('method')!r}, {summary.get('samples')} "
            f"samples{accuracy})")
  reach = max((r.get("samples", 0) for r in records if isinstance(r.get("samples"), int)),
              default=None)
  metrics = f"its metrics reach {reach} samples" if reach is not None else "no metrics"
  return f"an earlier run ({metrics}; no readable summary.json)"


def _run_facts(workdir: str) -> dict:
  """The summary's record of the run's best test accuracy and of what it ran on."""
  import jaxlib  # pylint: disable=g-import-not-at-top
  tests = [r for r in metrics_lib.read_records(workdir) if r.get("split") == "test"]
  accuracies = [r["accuracy"] for r in tests if "accuracy" in r]
  initial = [r["loss"] for r in tests if r.get("samples") == 0 and "loss" in r]
  try:
    version = importlib.metadata.version("pipejax")
  except importlib.metadata.PackageNotFoundError:
    version = "unknown (not installed)"
  device = jax.devices()[0]
  return {"best_test_accuracy": max(accuracies) if accuracies else None,
          "initial_test_loss": initial[0] if initial else None,
          "versions": {"pipejax": version, "jax": jax.__version__, "jaxlib": jaxlib.__version__},
          "device": f"{jax.device_count()} x {device.platform} ({device.device_kind})",
          "processes": jax.process_count()}


def _mean_over_backwards(per_tick: np.ndarray, delays: list[int], first_tick: int) -> list[float]:
  """Per stage, the mean of a (ticks, stages) metric over the ticks where the stage backwarded.

  Stage s backwards its first sample at tick D_s; before that its metric is a placeholder 0.
  """
  ticks = first_tick + np.arange(per_tick.shape[0])
  means = []
  for s, delay in enumerate(delays):
    active = ticks >= delay
    means.append(float(per_tick[active, s].mean()) if active.any() else 0.0)
  return means


# Every error a user can cause; the binary prints these as one paragraph, without a traceback.
USER_ERRORS = (ConfigError, TrainingDiverged, CheckpointError, DataError, PipelineError,
               MethodError, ModelError, StorageError, workdir_lib.WorkdirBusy)
