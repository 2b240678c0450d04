"""Language models: the transformer's stages, the fortunes byte corpus, and training end to end."""

import functools
import logging
import math
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipejax
from pipejax.train import plan as plan_lib
from pipejax.train import config_checks, evaluation, trainer
from pipejax import data, methods, models
from pipejax.study import spec as study_lib
from pipejax.data import text
from pipejax.core.engine import Pipeline
from pipejax.optim import adam_family
from tests import oracle
from tests import helpers
from tests.helpers import (ROOT, assert_trees_close, checkpoint_dir, flip_a_bit_in_each_data_file,
                           load_config, stage_params, stored_digest)

CORPUS = os.path.isdir(text.DEFAULT_DIR)
needs_corpus = pytest.mark.skipif(not CORPUS, reason="the fortunes corpus is not installed "
                                  "(apt-get install fortunes; scripts/setup_env.sh does it)")


def tiny_lm(**kwargs):
  return models.build("transformer_lm", **{"width": 16, "blocks": 3, "heads": 2, **kwargs})


def forward(model, params, tokens):
  return _forward(model, params, jnp.asarray(tokens, jnp.float32))


@functools.partial(jax.jit, static_argnums=0)
def _forward(model, params, h):
  """Every stage in order, as one compiled program per model and shape: run eagerly, each small
  operation of the transformer would compile on its own, which costs more than the whole."""
  for stage, p in zip(model.stages, params):
    h = stage.infer(p, h)
  return h


def init_params(model, tokens, key=0):
  state = Pipeline(model, methods.make_method("pb", learning_rate=0.0),
                   np.asarray(tokens, np.float32), np.zeros(np.shape(tokens), np.int32)
                   ).init(jax.random.PRNGKey(key))
  return [st.params for st in state.stages]


def test_stages_embedding_blocks_head_with_identical_blocks():
  model = tiny_lm()
  tokens = np.zeros((1, 12), np.float32)
  rows = models.describe(model, tokens)
  assert [r["name"] for r in rows] == ["embed", "block1", "block2", "block3", "head"]
  assert rows[0]["input_shape"] == (1, 12) and rows[0]["output_shape"] == (1, 12, 16)
  assert rows[-1]["output_shape"] == (1, 12, 256)
  # The blocks differ only in their layer's name: the same parameter shapes, stage for stage.
  shapes, _ = model.trace_shapes(jax.random.key(0), tokens)
  block_shapes = [jax.tree.map(lambda a: a.shape, next(iter(s.values()))) for s in shapes[1:-1]]
  assert block_shapes[0] == block_shapes[1] == block_shapes[2]
  assert tiny_lm(layers_per_stage=2).num_stages == 3  # (embed, block1), (block2, block3), head


def test_a_future_token_does_not_change_earlier_logits():
  model = tiny_lm()
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, (1, 10))
  params = init_params(model, tokens)
  changed = tokens.copy()
  changed[0, 6] = (changed[0, 6] + 1) % 256
  before, after = forward(model, params, tokens), forward(model, params, changed)
  np.testing.assert_allclose(before[:, :6], after[:, :6], rtol=1e-6, atol=1e-6)
  assert np.abs(before[:, 6:] - after[:, 6:]).max() > 1e-4  # the change does reach the rest


def test_loss_is_optax_mean_next_token_cross_entropy():
  model = tiny_lm()
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, 256, (2, 9))
  labels = rng.integers(0, 256, (2, 9)).astype(np.int32)
  logits = forward(model, init_params(model, tokens), tokens)
  loss, _ = model.loss(logits, labels)
  expected = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  np.testing.assert_allclose(loss, expected, rtol=1e-6)
  assert abs(float(loss) - math.log(256)) < 0.5  # small initial weights: near uniform


def test_width_must_split_into_heads():
  with pytest.raises(pipejax.ModelError, match="multiple of its number of heads"):
    models.build("transformer_lm", width=10, heads=4)


def write_corpus(directory, fortunes_per_file=2000, files=("alpha", "beta")):
  """A fake fortunes directory of over 1 MB: numbered fortunes, an index file and a link."""
  directory.mkdir()
  for name in files:
    body = "".join(f"{name} fortune {k}: {'words ' * 50}\n%\n" for k in range(fortunes_per_file))
    (directory / name).write_text(body)
    (directory / f"{name}.dat").write_bytes(b"\0" * 64)
    os.symlink(directory / name, directory / f"{name}.u8")
  return directory


def test_split_is_fixed_disjoint_and_covers_every_file(tmp_path):
  corpus = write_corpus(tmp_path / "fortunes")
  train, validation = text.split_fortunes(str(corpus))
  assert (train, validation) == text.split_fortunes(str(corpus))
  held_out = [f for f in validation.split(b"\n%\n") if f]
  trained = set(f for f in train.split(b"\n%\n") if f)
  assert len(held_out) + len(trained) == 4000  # no .dat, the link read once
  assert 350 < len(held_out) < 450  # one in ten (by each fortune's hash)
  assert not trained & set(held_out)
  assert {f.split(b" ")[0] for f in held_out} == {b"alpha", b"beta"}
  source = text.TextSource(validation, 16, "v")
  x, y = source.take([0, 3])
  np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # labels are the next bytes
  assert source.decode(x[0]) == validation[:16].decode()


def test_stream_over_text_is_seeded_and_resumes_exactly(tmp_path):
  train, _ = data.load("fortunes", data_dir=str(write_corpus(tmp_path / "f")), context=32)
  stream = data.DataStream(train, 2, seed=5)
  stream.next_chunk(7)
  saved = stream.get_state()
  x, y = stream.next_chunk(4)
  assert x.shape == (4, 2, 32) and y.shape == (4, 2, 32) and y.dtype == np.int32
  resumed = data.DataStream(train, 2, seed=5)
  resumed.set_state(saved)
  x2, y2 = resumed.next_chunk(4)
  np.testing.assert_array_equal(x, x2)
  np.testing.assert_array_equal(y, y2)
  np.testing.assert_array_equal(x[..., 1:], y[..., :-1])
  other = data.DataStream(train, 2, seed=6)
  other.set_state({**saved, "seed": 6})
  assert not np.array_equal(other.next_chunk(4)[0], x)


def test_eval_batches_pad_per_token_labels(tmp_path):
  _, validation = data.load("fortunes", data_dir=str(write_corpus(tmp_path / "f")), context=64)
  batches = list(data.eval_batches(validation, 128))
  inputs, labels, mask = batches[-1]
  assert labels.shape == (128, 64) and inputs.shape == (128, 64)
  assert mask.sum() == len(validation) - 128 * (len(batches) - 1)


@pytest.mark.parametrize("make_missing", ["no_directory", "empty", "small"])
def test_missing_corpus_says_how_to_install_it(tmp_path, make_missing):
  directory = tmp_path / "fortunes"
  if make_missing != "no_directory":
    directory.mkdir()
  if make_missing == "small":
    (directory / "tiny").write_text("one fortune\n%\n")
  with pytest.raises(data.DataError, match=r"apt-get install fortunes") as info:
    data.load("fortunes", data_dir=str(directory))
  assert "\n" not in str(info.value)


def test_evaluator_averages_per_token_loss_and_accuracy(tmp_path):
  _, validation = data.load("fortunes", data_dir=str(write_corpus(tmp_path / "f")), context=8)
  validation = data.Subset(validation, 5)
  model = tiny_lm(blocks=1)
  params = init_params(model, np.zeros((1, 8)))
  result = evaluation.make_evaluator(model, 3)(params, validation)
  x, y = validation.take(np.arange(5))
  logits = forward(model, params, x)
  expected = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  np.testing.assert_allclose(result["loss"], expected, rtol=1e-5)
  np.testing.assert_allclose(result["accuracy"], np.mean(np.argmax(logits, -1) == y), rtol=1e-6)


def test_study_and_config_files_load():
  path = os.path.join(ROOT, "configs/studies/lm_depth.py")
  for spec in (path, path + ":smoke"):
    study = study_lib.load_study(spec)
    assert study.baseline == {"method": "sgd"}
    assert all(run.get("optimizer", "adam") == "adam" for run in study.runs())
  config = load_config("char_lm", "smoke")
  plan_lib.resolve(config)
  assert config.dataset == "fortunes" and config.optimizer == "adam"


@needs_corpus
def test_real_corpus_is_over_a_megabyte_and_splits_one_in_ten():
  train, validation = data.load("fortunes", context=128)
  assert len(train.tokens) + len(validation.tokens) > 2_000_000
  assert 0.08 < len(validation.tokens) / (len(train.tokens) + len(validation.tokens)) < 0.12
  corpus = text.read_fortunes(text.DEFAULT_DIR)
  held_out = set(text.split_corpus(corpus)[1].split(text.SEPARATOR))
  for name, fortunes in corpus.topics.items():  # every topic in both splits (pratchett has two)
    assert held_out & set(fortunes) and set(fortunes) - held_out, name


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
  """configs/char_lm.py:smoke trained to its end: (workdir, summary). Checkpoints at 1000 and
  1500 sequences."""
  workdir = str(tmp_path_factory.mktemp("lm") / "run")
  return workdir, trainer.train_and_evaluate(load_config("char_lm", "smoke"), workdir)


@pytest.mark.slow
@needs_corpus
def test_char_lm_smoke_trains_and_reports_validation_loss(smoke_run):
  _, summary = smoke_run
  assert summary["stopped_by"] is None and summary["num_stages"] == 4
  assert summary["test_loss"] < math.log(256) - 1.0  # well below uniform over bytes


@pytest.mark.slow
@needs_corpus
def test_the_lm_retrains_past_a_damaged_checkpoint_to_the_same_bits(smoke_run, tmp_path, caplog):
  """The LM's resume: its AdamW states and its position in the byte stream come back from the
  checkpoint at 1000 sequences, and the last 500 retrain to the bits of the run never damaged."""
  caplog.set_level(logging.WARNING)
  finished, summary = smoke_run
  workdir = str(tmp_path / "run")
  shutil.copytree(finished, workdir)
  final_digest = stored_digest(workdir, 1500)
  flip_a_bit_in_each_data_file(os.path.join(checkpoint_dir(workdir), "1500"))
  resumed = trainer.train_and_evaluate(load_config("char_lm", "smoke"), workdir)
  warnings = "\n".join(r.getMessage() for r in caplog.records)
  assert "checkpoint at 1500 samples" in warnings and "at 1000 samples" in warnings, warnings
  assert stored_digest(workdir, 1500) == final_digest
  assert (resumed["test_loss"], resumed["test_accuracy"]) == (summary["test_loss"],
                                                              summary["test_accuracy"])


def test_pipeoptim_leaves_adamw_updates_alone_and_predicts_from_its_moments():
  params = {"w": jnp.array([[1.0, -2.0]]), "b": jnp.array([0.5])}
  grads = [{"w": jnp.array([[0.3, -0.1]]), "b": jnp.array([0.2])},
           {"w": jnp.array([[-0.4, 0.6]]), "b": jnp.array([0.1])}]
  predicting = adam_family.adam_weight_prediction(0.1, 3, b1=0.8, b2=0.9, weight_decay=0.5,
                                                  mask=adam_family.decay_mask)
  plain = optax.adamw(0.1, b1=0.8, b2=0.9, weight_decay=0.5, mask=adam_family.decay_mask)
  state, reference = predicting.init(params), plain.init(params)
  jax.tree.map(np.testing.assert_array_equal,  # no step yet: the weights as they are
               adam_family.adam_predicted_params(params, state, 0.8, 0.9), params)
  p = params
  for g in grads:
    u, state = jax.jit(predicting.update)(g, state, p)
    v, reference = jax.jit(plain.update)(g, reference, p)
    jax.tree.map(np.testing.assert_array_equal, u, v)
    p = optax.apply_updates(p, u)
  m = {k: 0.8 * 0.2 * grads[0][k] + 0.2 * grads[1][k] for k in params}
  n = {k: 0.9 * 0.1 * grads[0][k] ** 2 + 0.1 * grads[1][k] ** 2 for k in params}
  predicted = adam_family.adam_predicted_params(p, state, 0.8, 0.9)
  for k in params:
    expected = p[k] - 0.1 * 3 * (m[k] / (1 - 0.8 ** 2)) / (np.sqrt(n[k] / (1 - 0.9 ** 2)) + 1e-8)
    np.testing.assert_allclose(predicted[k], expected, rtol=1e-5)


def test_nesterov_asyncpp_is_nadamw_without_delay_and_takes_array_delays():
  params = jnp.array([1.0, -1.0])
  g = jnp.array([0.3, 0.7])
  asyncpp = adam_family.nesterov_asyncpp(0.01, 0, 6, anneal_steps=10, b1=0.9)
  u, _ = asyncpp.update(g, asyncpp.init(params), params)
  nadamw = optax.nadamw(0.01, b1=0.9, weight_decay=0.0)
  v, _ = nadamw.update(g, nadamw.init(params), params)
  np.testing.assert_allclose(u, v, rtol=1e-6)
  assert adam_family.asyncpp_momentum(0.9, 6, 6) == pytest.approx(0.9 + 6 * 0.09 / 7)
  # A traced delay (a stack's per-stage array) gives the numbers a Python int gives.
  def first_update(delay):
    tx = adam_family.nesterov_asyncpp(0.01, delay, 6, 10)
    return tx.update(g, tx.init(params), params)[0]

  by_array = jax.jit(first_update)(jnp.array(4))
  by_int = first_update(4)
  np.testing.assert_allclose(by_array, by_int, rtol=1e-6)
  with pytest.raises(ValueError, match="cannot exceed the pipeline's largest delay"):
    adam_family.nesterov_asyncpp(0.01, 8, 6, 10)


@pytest.mark.parametrize("name", ["pb", "nesterov_asyncpp"])
def test_lm_through_the_pipeline_matches_the_naive_oracle(name):
  """Per-token labels ride the delay lines with their sequence: the engine equals the oracle.

  The key bias's gradient is zero in exact arithmetic (softmax ignores a constant per query), so
  a small eps would let Adam blow float rounding up to whole steps: eps = 1e-3 keeps it rounding.
  """
  model = tiny_lm(width=8, blocks=1)
  rng = np.random.default_rng(2)
  tokens = rng.integers(0, 256, (3 * model.num_stages + 2, 1, 7))
  x, y = tokens[..., :-1].astype(np.float32), tokens[..., 1:].astype(np.int32)
  method = methods.make_method(name, **helpers.taking(
      name, learning_rate=0.01, momentum=0.8, b2=0.95, optimizer="adam", anneal_steps=4,
      num_stages=model.num_stages, eps=1e-3))
  pipe = Pipeline(model, method, x[0], y[0])
  state = pipe.init(jax.random.PRNGKey(0))
  max_delay = 2 * (model.num_stages - 1)
  rule = {"pb": lambda d: oracle.Adam(0.01, 0.8, 0.95, eps=1e-3),
          "nesterov_asyncpp": lambda d: oracle.NAdam(0.01, 0.8, 0.95, d, max_delay, 4,
                                                     eps=1e-3)}[name]
  expected, expected_metrics = oracle.run_oracle(
      model, oracle.OracleMethod(rule, backward="stashed" if name != "pb" else "current"),
      stage_params(state), x, y)
  state, metrics = pipe.run(state, x, y)
  assert_trees_close(stage_params(state), expected, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(metrics["loss"], [m["loss"] for m in expected_metrics], rtol=1e-5,
                             atol=1e-6)
