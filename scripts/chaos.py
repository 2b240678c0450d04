r"""Fault injection: kills and corrupted checkpoints never turn into a different result with exit 0.

    python scripts/chaos.py --trials=10 --workdir=/tmp/chaos
    python scripts/chaos.py --cases=study --study_trials=1 --workdir=/tmp/chaos
    python scripts/chaos.py --cases=lm --cases=lm_two_process --lm_trials=1 --workdir=/tmp/chaos

Trains the smoke config on a few samples once without interruption (the reference), then:

* ``--trials`` kill trials: start the run, send SIGTERM or SIGKILL at a random moment, either
  while a checkpoint is being written (its ``*.orbax-checkpoint-tmp`` directory exists) or at a
  random time, then rerun the same command until it exits;
* ``--trials`` corruption trials: take a run stopped half-way (or the finished reference), damage
  its newest checkpoint (flip a bit, garble 4096 bytes, truncate or delete a file) and rerun;
* ``--two_process_trials`` trials of a run of two processes (docs/distributed.md), after a
  two-process reference: process 1 started with one config field changed (both processes must
  refuse, naming the field, before the workdir exists), and one process killed with SIGTERM or
  SIGKILL at a random time (the other must end within TWO_PROCESS_DEADLINE seconds, and rerunning
  both must give the reference's exact result).

The language model (``--cases=lm``: configs/char_lm.py's smoke config, a transformer with AdamW
on the fortunes corpus) goes through ``--lm_trials`` kill and corruption trials the same way, and
(``--cases=lm_two_process``) through ``--two_process_trials`` trials of a run of two processes
that split its micro-batch (``mesh.data=2``), and (``--cases=lm_stages``) of a run whose stages
are split over the two processes (``mesh.stage=2``).

Every rerun must either exit 0 with exactly the reference's result (final state digest, verified
on restore, test loss and accuracy, every metrics record), or exit non-zero with a message that
names the damaged step.

The study launcher (``--cases=study``; ``--study`` and ``--study_where`` choose the runs, by default
two runs of the depth smoke study) is tried the same way against an uninterrupted study:
``--study_trials`` times each of

* a kill of the study (SIGTERM or SIGKILL at a random moment): no trainer may outlive it;
* a kill of one of its trainers (SIGTERM or SIGKILL): the study must not exit 0 with an
  incomplete grid;
* a results line cut at a random byte (a full disk's half-written record);

after which one rerun of the same command must exit 0 with every run's status, test accuracy,
test loss and samples equal to the reference's, and a results.jsonl with no damaged line; and

* ``--report_only`` run in a loop beside the study, from a random moment on: every report must
  succeed, and the study must end by itself as the reference did, with a whole report.md and no
  writer's temporary file left.

Anything else is a failure; the script exits 1 if there is one. It prints one line per trial and
the counts.
"""

import collections
import os
import random
import shutil
import sys

from absl import app, flags, logging

from pipejax import cli
from pipejax.chaos import ReferenceFailed, lm, study, trainer, two_process

_TRIALS = flags.DEFINE_integer("trials", 10, "Kill trials, and as many corruption trials.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/pipejax-chaos", "Where the runs go (emptied).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the random kill points and corruptions.")
_CASES = flags.DEFINE_multi_enum("cases", ["trainer", "study", "two_process", "lm",
                                           "lm_two_process", "lm_stages"],
                                 ["trainer", "study", "two_process", "lm", "lm_two_process",
                                  "lm_stages"],
                                 "Which trials: the single trainer's, the study launcher's, a "
                                 "two-process run's; the language model's in one process, over "
                                 "two (data parallel), over two with its stages split.")
_STUDY = flags.DEFINE_string("study", "configs/studies/depth.py:smoke",
                             "The study of the study launcher's trials.")
_STUDY_WHERE = flags.DEFINE_list("study_where", ["model_kwargs.depth=4", "method=pb"],
                                 "The --where of the study launcher's trials (empty: every run).")
_STUDY_TRIALS = flags.DEFINE_integer("study_trials", 2, "Trials of each study-runner case.")
_LM_TRIALS = flags.DEFINE_integer("lm_trials", 2, "The language model's kill trials, and as "
                                  "many corruption trials.")
_TWO_PROCESS_TRIALS = flags.DEFINE_integer(
    "two_process_trials", 2, "Trials of a two-process run: a mismatched process, and a kill of "
    "one process, each.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  cli.check_output("workdir", _WORKDIR.value, directory=True)
  rng = random.Random(_SEED.value)
  workdir = _WORKDIR.value
  shutil.rmtree(workdir, ignore_errors=True)
  os.makedirs(workdir)
  outcomes = collections.Counter()
  try:
    if "trainer" in _CASES.value:
      outcomes += trainer.trainer_trials(workdir, _TRIALS.value, rng)
    if "study" in _CASES.value:
      case = study.StudyCase(_STUDY.value, tuple(_STUDY_WHERE.value))
      outcomes += study.study_trials(case, workdir, _STUDY_TRIALS.value, rng)
    if "two_process" in _CASES.value:
      outcomes += two_process.two_process_round(workdir, rng, _TWO_PROCESS_TRIALS.value)
    if "lm" in _CASES.value:
      outcomes += trainer.trainer_trials(workdir, _LM_TRIALS.value, rng, lm.LM)
    for name, case in (("lm_two_process", lm.LM_DATA), ("lm_stages", lm.LM_STAGES)):
      if name in _CASES.value:
        outcomes += two_process.two_process_round(workdir, rng, _TWO_PROCESS_TRIALS.value, case)
  except ReferenceFailed as e:
    sys.exit(str(e))
  print("COUNTS " + ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items())))
  failures = sum(v for k, v in outcomes.items() if k.endswith(": FAIL"))
  sys.exit(1 if failures else 0)


if __name__ == "__main__":
  logging.set_verbosity(logging.WARNING)  # orbax logs every restore of the judge's at INFO
  cli.run(main)
