r"""Runs a study: a grid of trainings (config x method x seed x overrides), N at a time.

    python scripts/study.py --study=configs/studies/depth.py --workdir=docs/studies/depth
    python scripts/study.py --study=configs/studies/depth.py:smoke --workdir=/tmp/depth_smoke
    python scripts/study.py --study=configs/studies/depth.py --workdir=docs/studies/depth \
        --report_only
    python scripts/study.py --study=configs/studies/depth.py --workdir=docs/studies/depth --list

Each run is its own ``scripts/train.py`` process in ``WORKDIR/runs/RUN_ID`` (its log in
``log.txt`` there). A finished or diverged run is appended to ``WORKDIR/results.jsonl`` and never
run again; a failed one is retried on the next invocation. Ctrl-C (or SIGTERM, or SIGHUP: a
closed terminal) stops every running trainer through its own checkpoint, so rerunning the same
command continues the study where it stopped; a killed study's trainers stop the same way. One
study at a time holds a workdir. ``WORKDIR/report.md``, ``results.csv`` and the figures are
rewritten after every run. Runs share a persistent XLA compilation cache
(``WORKDIR/runs/.jax_cache``), so runs that differ only by seed compile once.

Exit status: 0 every selected run done (with --list: listed); 75 some runs not done (stopped by
a signal; named; rerun to continue); 1 some failed (named; retried on rerun), or the workdir is
held by another study or cannot be written; 2 a study file or flag that cannot be used (a
mistyped or malformed flag, a typo in the file, a grid key that is not a config field, a --where
that selects nothing, the flag --report_only on a workdir without a study or beside --list), or
a study whose settings differ from the workdir's records; nothing is created then.
The scheduler is ``pipejax/study/launcher.py``.
"""

import os
import sys

from absl import app, flags, logging

from pipejax import cli
from pipejax.study import spec as study_lib
from pipejax.study import launcher
from pipejax.study import preflight

_STUDY = flags.DEFINE_string("study", None, "Study file, e.g. configs/studies/depth.py[:smoke].")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where results.jsonl, report.md, the figures and "
                               "runs/ (the trainers' workdirs) go.")
_PARALLEL = flags.DEFINE_integer("parallel", None, "Trainings at a time; default: the number of "
                                 "CPU cores this process may use (each training then uses one "
                                 "core). More is allowed, with a warning; each training's memory "
                                 "check then counts on 1/N of the memory.")
_REPORT_ONLY = flags.DEFINE_bool("report_only", False,
                                 "Only rewrite the report from results.jsonl.")
_LIST = flags.DEFINE_bool("list", False,
                          "Only list the selected runs and where each stands in the workdir "
                          "(done, failed, stopped at a checkpoint, to run); trains nothing and "
                          "writes nothing, so it may run beside the study.")
_WHERE = flags.DEFINE_list("where", [], "Run only the grid points with these overrides, e.g. "
                           "--where=model_kwargs.depth=32,method=pb|pb_sc_lwp (one of the values "
                           "separated by '|'; the report covers all).")
flags.mark_flags_as_required(["study", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  try:
    study = study_lib.load_study(_STUDY.value)
    if not _REPORT_ONLY.value:
      preflight.check_config_keys(study)
  except study_lib.StudyError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  if _LIST.value and _REPORT_ONLY.value:
    print("error: --list and --report_only are two different things to do (list where the runs "
          "stand; rewrite the report); give one of them.", file=sys.stderr)
    sys.exit(2)
  if not _WORKDIR.value.strip():  # abspath would make it the current directory
    print("error: --workdir is empty; give the study's own directory, e.g. "
          "--workdir=/tmp/depth_smoke.", file=sys.stderr)
    sys.exit(2)
  workdir = os.path.abspath(_WORKDIR.value)
  # One command whichever way the workdir is spelled ('docs/studies/depth/' as a shell completes
  # it): the report that quotes it regenerates byte for byte.
  command = (f"python scripts/study.py --study={_STUDY.value} "
             f"--workdir={os.path.normpath(_WORKDIR.value)}")
  parallel = _PARALLEL.value or launcher.cpu_cores()
  if parallel < 1:
    print(f"error: --parallel must be at least 1; got {parallel}.", file=sys.stderr)
    sys.exit(2)
  where = {}
  for item in _WHERE.value:
    key, sep, value = item.partition("=")
    if not sep or key not in study.keys():
      print(f"error: --where takes KEY=VALUE items with a grid key of the study "
            f"({', '.join(study.keys())}); got {item!r}.", file=sys.stderr)
      sys.exit(2)
    if key in where:  # a second item would silently replace the first
      print(f"error: --where names {key} twice; give its values as one item, "
            f"{key}={where[key]}|{value}.", file=sys.stderr)
      sys.exit(2)
    where[key] = value
  sys.exit(launcher.main(study, workdir, parallel=parallel, command=command, where=where,
                         report_only=_REPORT_ONLY.value, list_only=_LIST.value))


if __name__ == "__main__":
  logging.set_verbosity(logging.WARNING)
  cli.run(main)
