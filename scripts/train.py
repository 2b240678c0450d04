r"""Trains a network with pipelined backpropagation (or a rival method) and evaluates it.

    python scripts/train.py --config=configs/default.py --workdir=runs/default
    python scripts/train.py --config=configs/default.py --config.method=pb --workdir=runs/pb
    python scripts/train.py --config=configs/default.py:smoke --workdir=/tmp/smoke

    python scripts/train.py --config=configs/default.py --workdir=runs/mesh \
        --config.mesh.stage=2 --config.mesh.data=1          # stages over 2 devices
    # (on a CPU, fake the devices: XLA_FLAGS=--xla_force_host_platform_device_count=2 python ...)

A workdir that holds a checkpoint is resumed. SIGTERM, Ctrl-C or SIGHUP (a closed terminal) saves
a checkpoint and exits; rerunning the same command continues bit-exactly where it stopped. A
finished workdir is reported again, not retrained. One run at a time holds a workdir (a second one
is refused).

Exit codes (for job schedulers and study runners):

    0   the run finished (or had finished before); summary.json holds its result.
    1   an error the message explains: config, data, a damaged or incompatible checkpoint, a
        divergence, a full or read-only disk, a workdir held by another run, another process of
        a multi-host run that died (rerun all of them to resume).
    2   bad command line: an unknown flag or config field, a config file that cannot be loaded.
    75  stopped by SIGTERM/SIGINT/SIGHUP after saving a checkpoint, or during set-up before there
        was anything to save (EX_TEMPFAIL: not finished, rerun the same command to resume). A run
        killed with SIGKILL gets the shell's 137 and also resumes.
"""

import os
import sys
import traceback

from pipejax import cli

if __name__ == "__main__":
  # Before JAX and the coordination service start threads (they inherit the blocked signals), so
  # that a signal in any phase, set-up and compile included, ends the run with a message.
  cli.watch_signals()

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app, flags, logging
import jax
from ml_collections import config_flags

from pipejax import config as configlib
from pipejax.train import interruption
from pipejax.train import plan as plan_lib
from pipejax.train import resume
from pipejax.train import trainer

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and plots.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0 for multi-host runs (jax.distributed); "
    "leave unset on one host, and on TPU pods / SLURM where JAX detects it.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in a multi-host run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in [0, N).")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Initialize jax.distributed even without the three flags above, letting "
    "JAX detect the process layout (Cloud TPU pod slices, SLURM, Open MPI).")
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer(
    "heartbeat_timeout", 30, "Multi-host runs: seconds without a heartbeat after which a process "
    "counts as dead and every other process exits (JAX's coordination service; see "
    "docs/distributed.md).")
_STARTUP_TIMEOUT = flags.DEFINE_integer(
    "startup_timeout", 300, "Multi-host runs: seconds each process waits at start-up for the "
    "others, to connect and then to compare their configs, before it gives up with a message "
    "(docs/distributed.md).")
flags.mark_flags_as_required(["config", "workdir"])

EXIT_FINISHED, EXIT_ERROR, EXIT_USAGE, EXIT_STOPPED = 0, 1, 2, 75


class _HideLibraryChatter:
  """Keeps the libraries' warnings, drops their INFO lines that say nothing to a user: orbax's
  one per file it renames, and JAX's "Unable to initialize backend 'tpu'" on a machine
  without one."""

  def filter(self, record):
    if record.levelno >= 30:
      return True
    if "/orbax/" in record.pathname:
      return False
    return not record.getMessage().startswith("Unable to initialize backend")


def main(argv):
  logging.get_absl_handler().addFilter(_HideLibraryChatter())
  # The first line of the log: scripts/study.py times a run's setup from it.
  logging.info("pipejax training: %s", configlib.command_line())
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config, workdir = _CONFIG.value, _WORKDIR.value
  several = _DISTRIBUTED.value or _COORDINATOR.value or (_NUM_PROCESSES.value or 1) > 1
  try:
    # Before the processes wait for each other, or make the workdir.
    plan = plan_lib.resolve(config, overridden=configlib.overridden_keys())
    if several:
      _start_processes(plan, workdir)
    summary = trainer.train(plan, workdir)
  except interruption.StoppedDuringSetup as e:
    print(e)
    _exit(EXIT_STOPPED)
  except trainer.USER_ERRORS as e:
    print(f"error: {e}", file=sys.stderr)  # once: absl's own log line would repeat it
    _exit(EXIT_ERROR)
  except jax.errors.JaxRuntimeError as e:
    if not jax.distributed.is_initialized():
      raise
    from pipejax.parallel import distributed  # pylint: disable=g-import-not-at-top
    print(f"error: {distributed.lost_process_message(e)}", file=sys.stderr, flush=True)
    _exit(EXIT_ERROR)
  except Exception:  # pylint: disable=broad-except
    if not jax.distributed.is_initialized():
      raise
    traceback.print_exc()
    _exit(EXIT_ERROR)
  if summary["stopped_by"]:
    print(f"STOPPED by {summary['stopped_by']} after {summary['samples']} samples; rerun to "
          "resume.")
    sys.exit(EXIT_STOPPED)
  print(f"FINAL test_accuracy={summary['test_accuracy']:.4f} test_loss={summary['test_loss']:.4f} "
        f"method={summary['method']} samples={summary['samples']} "
        f"seconds={summary['train_seconds']:.0f} processes={summary['processes']} "
        f"mesh=data{summary['mesh']['data']}xstage{summary['mesh']['stage']}")


def _start_processes(plan: plan_lib.RunPlan, workdir: str):
  """Connects the processes and makes them agree on what they run, before any of them trains."""
  from pipejax.parallel import distributed  # only multi-host runs pay for it
  try:
    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                           initialization_timeout=_STARTUP_TIMEOUT.value,
                           heartbeat_timeout=_HEARTBEAT_TIMEOUT.value)
    cli.signal_watch().set_phase("start-up (the processes compare their configs)")
    fingerprint = {f"config.{k}": v for k, v in resume.flat_given(plan).items()
                   if k not in resume.PER_HOST_KEYS}
    distributed.agree({**fingerprint, "code": distributed.code_version(), "workdir": workdir},
                      _STARTUP_TIMEOUT.value)
    distributed.agree_on_shared_workdir(workdir, _STARTUP_TIMEOUT.value)
  except distributed.StartupError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    if isinstance(e, distributed.SharedRefusal):
      distributed.leave_together(_STARTUP_TIMEOUT.value)
    _exit(EXIT_ERROR)


def _exit(code: int):
  """Exits; with several processes, without JAX's shutdown barrier, which would wait for a
  process that is gone or failed before it."""
  if not jax.distributed.is_initialized():
    sys.exit(code)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)  # pylint: disable=protected-access


if __name__ == "__main__":
  cli.run(main, flags_parser=configlib.parse_flags)
