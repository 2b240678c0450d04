"""The mechanism measurement: its delayed gradient is the engine's, its two numbers at the cases
where they are known, and a 2-stage linear pipeline re-derived by hand in numpy."""

import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipejax
from pipejax.analysis import mechanism
from pipejax.core.engine import Pipeline
from pipejax.core.state import Packet
from pipejax.models import online_norm
from pipejax.methods.method import pb, pipedream, sync
from tests import helpers
from tests.helpers import make_model, make_stream

LR = 0.1


SMALL = (5, 7)  # three stages: delays 4, 2 and 0


def _measure(method, ticks=10, at=None, model=None, b=2):
  model = model or make_model(SMALL)
  x, y = make_stream(ticks, b)
  pipe = Pipeline(model, method, x[0], y[0], track_weight_discrepancy=True)
  xs, ys, valid = pipe.to_ticks(x, y)
  at = range(len(valid)) if at is None else at
  _, records = mechanism.measure(pipe, pipe.init(jax.random.PRNGKey(0)), xs, ys, valid, at=at,
                                 chunk=len(valid))
  return pipe, records


def test_one_stage_sgd_has_cosine_one_and_no_mismatch():
  _, records = _measure(sync(optax.sgd(LR, momentum=0.9), 1),
                        model=pipejax.Model(make_model(SMALL).stages[-1:]), ticks=6)
  assert [r["tick"] for r in records] == list(range(6))
  for r in records:
    assert r["delay"] == 0 and r["mismatch"] == 0.0
    assert r["cosine"] == pytest.approx(1.0, abs=1e-6)
    assert r["delayed_norm"] == pytest.approx(r["current_norm"], rel=1e-5)


def test_delay_zero_behind_frozen_stages_has_cosine_one():
  # The last stage's own weights are never stale; its input is, unless upstream stands still.
  frozen_upstream = pb(lambda delay: optax.sgd(LR if delay == 0 else 0.0, momentum=0.9))
  pipe, records = _measure(frozen_upstream)
  last = [r for r in records if r["stage"] == pipe.num_stages - 1]
  assert len(last) == 10 - (pipe.num_stages - 1)
  for r in last:
    assert r["mismatch"] == 0.0 and r["cosine"] == pytest.approx(1.0, abs=1e-6)


def test_pb_mismatch_grows_with_the_delay_and_the_cosine_falls_below_one():
  pipe, records = _measure(pb(optax.sgd(LR, momentum=0.9)), ticks=12, at=[9, 10, 11])
  mean = lambda s, key: np.mean([r[key] for r in records if r["stage"] == s])
  mismatch = [mean(s, "mismatch") for s in range(pipe.num_stages)]
  assert mismatch[-1] == 0.0
  assert all(a > b for a, b in zip(mismatch, mismatch[1:])), mismatch
  assert all(mean(s, "cosine") < 0.9999 for s in range(pipe.num_stages - 1))


def test_pipedream_has_no_mismatch_but_stale_gradients():
  pipe, records = _measure(pipedream(optax.sgd(LR, momentum=0.9)), ticks=12, at=[10, 11])
  assert len(records) == 2 * pipe.num_stages
  assert all(r["mismatch"] == 0.0 for r in records)
  assert min(r["cosine"] for r in records if r["stage"] == 0) < 0.9999


def test_the_delayed_gradient_is_the_one_the_engine_applies():
  # Plain SGD applies -lr times the gradient: the weights' change gives the engine's gradient.
  x, y = make_stream(8, 2)
  pipe = Pipeline(make_model(SMALL), pb(optax.sgd(LR)), x[0], y[0],
                  track_weight_discrepancy=True)
  state = pipe.init(jax.random.PRNGKey(1))
  for t in range(7):
    state, _ = pipe.tick(state, x[t], y[t])
  inbound = Packet(jnp.asarray(x[7]), jnp.asarray(y[7]), jnp.array(True), state.tick)
  delayed = jax.jit(lambda state, inbound: [mechanism.delayed_gradient(pipe, state, inbound, s)
                                            for s in range(pipe.num_stages)])(state, inbound)
  before = helpers.stage_params(state)
  after, _ = pipe.tick(state, x[7], y[7])
  for s, (grads, index, valid) in enumerate(delayed):
    assert bool(valid) and int(index) == mechanism.backward_sample(pipe, 7, s)
    applied = jax.tree.map(lambda b, a: (b - np.asarray(a)) / LR, before[s], after.stages[s].params)
    helpers.assert_trees_close(grads, applied, rtol=1e-4, atol=1e-5)


class _Linear:
  """Stage ``y = x W`` with W of shape (d_in, d_out)."""

  def __init__(self, d_out, seed):
    self.d_out, self.seed = d_out, seed

  def stage(self, name):
    init = lambda rng, x: {"w": jnp.asarray(np.random.default_rng(self.seed).standard_normal(
        (x.shape[-1], self.d_out)).astype(np.float32) * 0.5)}
    return pipejax.Stage(init, lambda p, x, rng: x @ p["w"], name=name)


def _squared_error(y, labels):
  return 0.5 * jnp.mean(jnp.sum(jnp.square(y - labels), -1)), {}


def _cosine(a, b):
  return float(np.vdot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_cosine_and_mismatch_match_a_numpy_two_stage_linear_pipeline():
  rng = np.random.default_rng(3)
  ticks, d0, d1, d2 = 8, 3, 4, 2
  x = rng.standard_normal((ticks, 1, d0)).astype(np.float32)
  y = rng.standard_normal((ticks, 1, d2)).astype(np.float32)
  model = pipejax.Model([_Linear(d1, 0).stage("a"), _Linear(d2, 1).stage("b")], _squared_error)
  pipe = Pipeline(model, pb(optax.sgd(LR)), x[0], y[0], track_weight_discrepancy=True)
  state = pipe.init(jax.random.PRNGKey(0))
  w0 = [np.asarray(state.stages[0].params["w"], np.float64)]
  w1 = [np.asarray(state.stages[1].params["w"], np.float64)]
  _, records = mechanism.measure(pipe, state, x, y, at=range(ticks), chunk=3)

  # By hand, docs/design.md §2: at tick t stage 1 meets sample t-1 with the output stage 0 made
  # at tick t-1, and sends back W1_t-times-residual; stage 0 backwards sample t-2 with that.
  expected, h, cotangent = [], {}, {}
  for t in range(ticks):
    h[t] = x[t, 0] @ w0[t]
    g0 = np.zeros_like(w0[t])
    if t >= 2:
      n = t - 2
      g0 = np.outer(x[n, 0], cotangent[n])
      current = np.outer(x[n, 0], w1[t] @ (x[n, 0] @ w0[t] @ w1[t] - y[n, 0]))
      mismatch = np.linalg.norm(w0[n] - w0[t]) / np.linalg.norm(w0[t])
      expected.append((t, 0, mismatch, _cosine(g0.ravel(), current.ravel())))
    g1 = np.zeros_like(w1[t])
    if t >= 1:
      n = t - 1
      residual = h[n] @ w1[t] - y[n, 0]
      g1, cotangent[n] = np.outer(h[n], residual), w1[t] @ residual
      current = np.outer(x[n, 0] @ w0[t], x[n, 0] @ w0[t] @ w1[t] - y[n, 0])
      expected.append((t, 1, 0.0, _cosine(g1.ravel(), current.ravel())))
    w0.append(w0[t] - LR * g0)
    w1.append(w1[t] - LR * g1)

  got = sorted((r["tick"], r["stage"], r["mismatch"], r["cosine"]) for r in records)
  assert [g[:2] for g in got] == sorted(e[:2] for e in expected)
  for g, e in zip(got, sorted(expected)):
    np.testing.assert_allclose(g[2:], e[2:], rtol=1e-5, atol=1e-6)
  assert min(e[3] for e in expected) < 0.999  # the case tests something: stale is not current


def test_refuses_a_pipeline_without_stashed_weights():
  x, y = make_stream(2, 1)
  pipe = Pipeline(make_model(SMALL), pb(optax.sgd(LR)), x[0], y[0])
  with pytest.raises(mechanism.MechanismError, match="track_weight_discrepancy=True"):
    mechanism.measure(pipe, pipe.init(jax.random.PRNGKey(0)), x, y, at=[1])


def test_refuses_ticks_outside_the_stream():
  x, y = make_stream(3, 1)
  pipe = Pipeline(make_model(SMALL), pb(optax.sgd(LR)), x[0], y[0], track_weight_discrepancy=True)
  with pytest.raises(mechanism.MechanismError, match=r"Ticks \[3\] lie outside the stream, "
                     r"which covers ticks \[0, 3\)"):
    mechanism.measure(pipe, pipe.init(jax.random.PRNGKey(0)), x, y, at=[0, 3])


def test_refuses_a_model_with_variables():
  norm = pipejax.from_flax(nn.Sequential([nn.Dense(3), online_norm.OnlineNorm()]), name="norm")
  x, y = make_stream(2, 1)
  pipe = Pipeline(pipejax.Model([norm]), pb(optax.sgd(LR)), x[0], y[0],
                  track_weight_discrepancy=True)
  with pytest.raises(mechanism.MechanismError, match="stateless stages only"):
    mechanism.check_pipeline(pipe)


def test_refuses_a_runner_that_is_not_the_single_device_pipeline():
  with pytest.raises(mechanism.MechanismError, match=r"Pass its \.pipeline"):
    mechanism.check_pipeline(object())


@pytest.mark.slow
def test_the_script_writes_records_and_a_figure_per_stage(tmp_path):
  env = {**os.environ, "PYTHONPATH": helpers.ROOT}
  result = subprocess.run(
      [sys.executable, os.path.join(helpers.ROOT, "scripts", "mechanism.py"),
       "--config=" + os.path.join(helpers.ROOT, "configs", "char_lm.py") + ":smoke",
       "--config.method=pb", "--sequences=16", "--points=2", "--chunk=8",
       f"--output_dir={tmp_path}"], capture_output=True, text=True, timeout=600, env=env,
      cwd=helpers.ROOT)
  assert result.returncode == 0, result.stderr[-3000:]
  with open(tmp_path / "mechanism.jsonl") as f:
    records = [json.loads(line) for line in f]
  stages = 4  # the smoke LM: embedding, two blocks, head
  # Ticks 6 (the fill's end) and 15: every stage backwards a real sample at both.
  assert sorted((r["tick"], r["stage"]) for r in records) == [
      (t, s) for t in (6, 15) for s in range(stages)]
  assert all(r["method"] == "pb" and r["num_stages"] == stages for r in records)
  assert [r["delay"] for r in records if r["tick"] == 15] == [6, 4, 2, 0]
  assert all(-1 <= r["cosine"] <= 1 + 1e-6 and r["mismatch"] >= 0 for r in records)
  assert sorted(os.listdir(tmp_path / "figures")) == [
      *(f"stage_{s:03d}.png" for s in range(stages)), "stages.png"]


def test_the_measured_ticks_are_as_many_as_asked_or_refused():
  assert mechanism.measured_ticks(16, 6, 2) == [6, 15]
  assert mechanism.measured_ticks(16, 6, 10) == list(range(6, 16))
  with pytest.raises(mechanism.MechanismError, match=r"11 ticks to measure, but the stream's 16 "
                     r"ticks leave 10 after the pipeline's fill of 6 .* at least 17 micro-batches"):
    mechanism.measured_ticks(16, 6, 11)
  with pytest.raises(mechanism.MechanismError, match="leave 0 after"):
    mechanism.measured_ticks(4, 6, 1)


def test_the_script_refuses_more_points_than_sequences_before_any_work(tmp_path):
  result = subprocess.run(
      [sys.executable, os.path.join(helpers.ROOT, "scripts", "mechanism.py"),
       "--config=" + os.path.join(helpers.ROOT, "configs", "char_lm.py") + ":smoke",
       "--sequences=2", "--points=3", f"--output_dir={tmp_path / 'out'}"],
      capture_output=True, text=True, timeout=300, cwd=helpers.ROOT,
      env={**os.environ, "PYTHONPATH": helpers.ROOT})
  assert result.returncode == 2, result.stderr[-3000:]
  assert result.stderr.startswith("error: --points=3 ticks to measure among the ticks of "
                                  "--sequences=2")
  assert not (tmp_path / "out").exists()
