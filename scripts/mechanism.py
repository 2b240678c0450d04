r"""The delay's mechanism per stage during a short training run (``pipejax.analysis.mechanism``).

    python scripts/mechanism.py --config=configs/char_lm.py \
        --config.model_kwargs.blocks=30 --config.model_kwargs.width=64 \
        --config.method=pb_sc_lwp --config.reference.momentum=0.99 \
        --sequences=2000 --points=10 --output_dir=/tmp/mechanism/pb_sc_lwp

Trains the config's pipeline from its seed's initial weights on the first ``--sequences``
micro-batches of its training stream, and at ``--points`` ticks spread evenly from the end of the
fill to the last tick measures, per stage, ``|w_fwd - w_bwd| / |w_bwd|`` and the cosine between
the gradient the stage applies and the gradient at the current weights on the same sample.
Writes ``mechanism.jsonl`` (one record a tick and stage, with the run's method, seed, momentum
and rate) and ``figures/stage_NNN.png`` per stage plus ``figures/stages.png`` (the means against
the delay) to ``--output_dir``, and prints the per-stage means.

The run uses the config's schedule at its full length (the warm-up included), so its first
``--sequences`` ticks are those of the full run. On one device; the weights stay at float32.
The command above took 20 minutes on a shared 2-core CPU at load 10 to 14 (7.6 minutes of CPU);
compiling the tick, the scan and the measurement was two thirds of it, and each further 1,000
sequences adds about 2.5 minutes there.
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from pipejax import cli, files
from pipejax import config as configlib
from pipejax.analysis import mechanism
from pipejax.data import stream as stream_lib
from pipejax.train import experiment
from pipejax.train import plan as plan_lib
from pipejax.train.config_checks import ConfigError

_CONFIG = config_flags.DEFINE_config_file("config", None, "The training config file.")
_SEQUENCES = flags.DEFINE_integer("sequences", 2000, "Micro-batches to train on.", lower_bound=1)
_POINTS = flags.DEFINE_integer("points", 10, "Ticks to measure, spread evenly.", lower_bound=1)
_CHUNK = flags.DEFINE_integer("chunk", 100, "Ticks a scan runs between measurements.",
                              lower_bound=1)
_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Where the records and figures go.")


def check_flags(argv) -> None:
  """Refuses what the flags alone show cannot work, before the config is built."""
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if _CONFIG.value is None:
    raise app.UsageError("--config is required, e.g. --config=configs/char_lm.py.")
  if not _OUTPUT_DIR.value:
    raise app.UsageError("--output_dir is required: the records and figures are written there.")
  if _POINTS.value > _SEQUENCES.value:
    raise app.UsageError(f"--points={_POINTS.value} ticks to measure among the ticks of "
                         f"--sequences={_SEQUENCES.value}: give --points of at most --sequences "
                         "(less the pipeline's fill).")
  cli.check_output("output_dir", _OUTPUT_DIR.value, directory=True)


def main(argv):
  check_flags(argv)
  config = _CONFIG.value
  config.diagnostics = True
  config.stack_stages = False
  started = time.perf_counter()
  try:
    setup = experiment.build(plan_lib.resolve(config))
  except ConfigError as e:
    raise app.UsageError(str(e)) from None
  pipe = setup.pipeline
  stream = stream_lib.DataStream(setup.train_source, config.micro_batch_size, config.seed)
  x, y, valid = pipe.to_ticks(*stream.next_chunk(_SEQUENCES.value))
  try:
    at = mechanism.measured_ticks(len(valid), 2 * (pipe.num_stages - 1), _POINTS.value)
    state = setup.runner.to_logical(setup.init(jax.random.PRNGKey(config.seed)))
    _, records = mechanism.measure(pipe, state, x, y, valid, at=at, chunk=_CHUNK.value)
  except mechanism.MechanismError as e:
    raise app.UsageError(str(e)) from None
  seconds = time.perf_counter() - started
  facts = {"method": config.method, "seed": config.seed, "num_stages": pipe.num_stages,
           "momentum": config.reference.momentum, "b2": config.reference.get("b2"),
           "lr": config.reference.lr}
  os.makedirs(_OUTPUT_DIR.value, exist_ok=True)
  files.write(os.path.join(_OUTPUT_DIR.value, "mechanism.jsonl"),
              "".join(json.dumps({**r, **facts}) + "\n" for r in records))
  title = f"{config.method}, {pipe.num_stages} stages, β1 {config.reference.momentum}"
  mechanism.write_figures(records, os.path.join(_OUTPUT_DIR.value, "figures"), title)
  for s in sorted({r["stage"] for r in records}):
    rows = [r for r in records if r["stage"] == s]
    print(f"stage {s:3d} delay {rows[0]['delay']:3d}: mismatch "
          f"{np.mean([r['mismatch'] for r in rows]):.4g}, cosine "
          f"{np.nanmean([r['cosine'] for r in rows]):.4f} ({len(rows)} ticks)")
  print(f"{len(records)} records in {seconds:.0f} s to {_OUTPUT_DIR.value}")


if __name__ == "__main__":
  cli.run(main, flags_parser=configlib.parse_flags)
