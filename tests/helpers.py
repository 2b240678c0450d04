"""What several test files share: the repository root, the small dense test model and its stream,
tree comparisons, configs, and the trainer binary stopped by SIGTERM and resumed.

A plain module rather than ``conftest.py``: pytest loads conftest files itself and advises against
importing from them, and these are functions and constants, not fixtures.
"""

import functools
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np

import pipejax
from pipejax import config as configlib
from pipejax.train import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IN_DIM, NUM_CLASSES = 6, 4  # inputs of IN_DIM features, NUM_CLASSES logits
WIDTHS = (5, 7, 3)  # uneven on purpose: every stage has its own input and weight shapes


def as_from_a_terminal() -> None:
  """A ``preexec_fn``: SIGINT and SIGHUP at their defaults, as for a command typed in a terminal.

  A suite started in the background (``nohup``, or ``&`` in a script) hands its children both
  signals ignored, and the trainer and the study rightly keep an ignored signal ignored
  (``pipejax.cli.honoured``); a test of what such a signal does would then fail for how the suite
  was started, not for what the code does.
  """
  for sig in (signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, signal.SIG_DFL)


def dense_model(widths) -> pipejax.Model:
  """One ``Dense(w) + tanh`` stage per width, then a dense head: uneven widths give every stage
  its own input and weight shapes. One model per widths, shared by every test that asks for it:
  a model traces once per input shape (``Model.trace``), for all the pipelines built on it."""
  return _dense_model(tuple(widths))


@functools.cache
def _dense_model(widths: tuple) -> pipejax.Model:
  stages = [pipejax.from_flax(nn.Sequential([nn.Dense(w), nn.tanh]), name=f"dense{w}")
            for w in widths]
  return pipejax.Model(stages + [pipejax.from_flax(nn.Dense(NUM_CLASSES), name="head")])


def make_model(widths=WIDTHS) -> pipejax.Model:
  return dense_model(widths)


def make_stream(num_ticks, b, seed=0):
  """``num_ticks`` micro-batches of ``b`` random inputs and labels for :func:`dense_model`.

  Drawn by numpy: ``jax.random`` would compile its sampler again for every new shape.
  """
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((num_ticks, b, IN_DIM), dtype=np.float32)
  y = rng.integers(0, NUM_CLASSES, (num_ticks, b), dtype=np.int32)
  return x, y


def stage_params(state):
  """A host copy of every stage's weights (run() donates the state it is given)."""
  return jax.tree.map(np.array, [st.params for st in state.stages])


def assert_trees_close(actual, expected, rtol=2e-6, atol=1e-6):
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


def leaves_equal(a, b):
  """Every leaf of ``a`` bit for bit that of ``b``."""
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def config_module(name):
  """The module of ``configs/<name>.py``."""
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def load_config(name, arg=None):
  """``configs/<name>.py``'s ``get_config(arg)``, loaded as the trainer loads it."""
  path = os.path.join(ROOT, "configs", f"{name}.py")
  return configlib.load_config(path if arg is None else f"{path}:{arg}")


def digits_config(**overrides):
  """A seconds-long run on scikit-learn's digits: 2 chunks of 40 ticks, checkpoint per chunk."""
  config = load_config("default", "smoke")
  config.dataset = "digits"
  config.max_train_examples = 0
  config.max_test_examples = 0
  config.model_kwargs = {"hidden": (16, 12), "layers_per_stage": 1}
  config.epochs = 240 / 1437
  config.warmup_epochs = 40 / 1437  # within the run (a longer warm-up is refused)
  config.ticks_per_chunk = 40
  config.eval_every_samples = 80
  config.checkpoint_every_samples = 40
  config.eval_batch_size = 128
  # The tests that read curves.png ask for it; drawing it would be a third of such a run's time.
  config.plot_curves = False
  for key, value in overrides.items():  # dotted keys reach nested fields: "micro_batch.lr"
    parent, _, leaf = key.rpartition(".")
    (config[parent] if parent else config)[leaf] = value
  return config


def sigterm_midway_and_resume(tmp_path, overrides):
  """Runs the binary straight through in tmp_path/straight, and in tmp_path/killed with a SIGTERM
  once it trains, then again to resume; checks the stop and the resume happened."""
  env = dict(os.environ, PYTHONUNBUFFERED="1")

  def command(workdir):
    return [sys.executable, os.path.join(ROOT, "scripts", "train.py"),
            "--config=" + os.path.join(ROOT, "configs", "default.py") + ":smoke",
            f"--workdir={workdir}", "--config.plot_curves=False", *overrides]

  straight = subprocess.run(command(tmp_path / "straight"), capture_output=True, text=True,
                            env=env, timeout=300)
  assert straight.returncode == 0, straight.stderr[-2000:]
  # The log starts with the run's own line, without the libraries' INFO chatter.
  assert "] pipejax training: --config=" in straight.stderr.splitlines()[0]
  assert "Unable to initialize backend" not in straight.stderr and "/orbax/" not in straight.stderr

  victim = subprocess.Popen(command(tmp_path / "killed"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
  lines = []
  for line in victim.stdout:  # wait until it is training (a progress line), then kill it
    lines.append(line)
    if "samples/s" in line:
      victim.send_signal(signal.SIGTERM)
      break
  rest, _ = victim.communicate(timeout=300)
  output = "".join(lines) + rest
  assert victim.returncode == 75, output[-2000:]  # stopped, not finished: see scripts/train.py
  assert "STOPPED by SIGTERM" in output
  stopped_at = json.load(open(tmp_path / "killed" / "summary.json"))["samples"]
  assert 0 < stopped_at < json.load(open(tmp_path / "straight" / "summary.json"))["samples"]

  resumed = subprocess.run(command(tmp_path / "killed"), capture_output=True, text=True, env=env,
                           timeout=300)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert "Resumed from" in resumed.stderr


def checkpoint_dir(workdir) -> str:
  return os.path.join(workdir, "checkpoints")


def stored_digest(workdir, step) -> str:
  """The state digest a run's checkpoint ``step`` wrote in its meta."""
  meta = checkpoint.Checkpointer(checkpoint_dir(workdir)).restore_meta(step)
  return meta["digests"]["state_digest"]


def data_files(step_dir) -> list[str]:
  """The array data files of a checkpoint step's state, the ones a damage test flips bits in."""
  return [os.path.join(root, name) for root, _, names in os.walk(os.path.join(step_dir, "state"))
          for name in names if os.sep + "d" + os.sep in os.path.join(root, name)]


def flip_a_bit_in_each_data_file(step_dir) -> None:
  """One bit in the middle of each data file: orbax reads some of them (OCDBT keeps superseded
  nodes too), and reads the flipped bit back without complaint."""
  for path in data_files(step_dir):
    with open(path, "r+b") as f:
      f.seek(os.path.getsize(path) // 2)
      byte = f.read(1)
      f.seek(-1, os.SEEK_CUR)
      f.write(bytes([byte[0] ^ 0x10]))


def copy_of(finished, tmp_path) -> str:
  """A copy of a finished run's workdir (the ``finished`` fixture) to damage or resume."""
  workdir = str(tmp_path / "run")
  shutil.copytree(finished[0], workdir)
  return workdir


def taking(name: str, **kwargs) -> dict:
  """The keywords of ``kwargs`` that preset ``name``'s hyperparameters have: a test that builds
  every preset from one set of values passes each only what it reads."""
  from pipejax import methods  # pylint: disable=import-outside-toplevel
  return {key: value for key, value in kwargs.items() if key in methods.preset_of(name).fields()}
