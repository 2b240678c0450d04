"""The depth limits: each stage's curvature against a dense Hessian, its predictions consistent."""

import jax
import jax.flatten_util
import numpy as np
import pytest

from pipejax.train import plan as plan_lib
from pipejax.analysis import depth_limits
from pipejax.analysis import quadratic
from pipejax.train import experiment
from pipejax.study import records as study_records
from pipejax.train.checkpoint import Checkpointer
from tests.helpers import digits_config


def test_sampled_stages_reach_from_the_longest_delay_to_the_head():
  assert depth_limits.sampled_stages(4) == [0, 1, 2, 3]
  assert depth_limits.sampled_stages(128) == [0, 1, 16, 32, 64, 96, 126, 127]


def test_a_stage_is_predicted_stable_exactly_when_its_delay_is_within_the_limit():
  momentum = 0.99
  for x in (1e-5, 1e-4, 1e-3):
    limits = depth_limits.limits_at(x, momentum, max_delay=64)
    for delay in (0, 8, 40):
      stable = depth_limits.stable_at(x, momentum, delay)
      for method, limit in limits.items():
        assert stable[method] == (limit is None or delay <= limit), (method, x, delay)
      assert stable["pipemare"] == (quadratic.spectral_radius("pipemare", x, momentum, delay) < 1)


@pytest.mark.slow  # builds and measures twice: about 25 s on two idle cores
def test_measure_gives_each_stages_block_of_a_dense_hessian_at_its_checkpoints(tmp_path):
  config = digits_config()
  plan = plan_lib.resolve(config)
  setup = experiment.build(plan)
  initial = setup.runner.to_logical(setup.init(jax.random.PRNGKey(config.seed)))
  moved = initial._replace(stages=tuple(  # weights elsewhere, saved as a run's checkpoint
      st._replace(params=jax.tree_util.tree_map(lambda w: 1.5 * w, st.params))
      for st in initial.stages))
  workdir = str(tmp_path / "run")
  checkpoints = Checkpointer(f"{workdir}/checkpoints")
  checkpoints.save(240, moved, {"data_position": 0})
  checkpoints.close()
  records = list(depth_limits.measure(plan, workdir, at_samples=(0, 240), batch=32,
                                      iterations=150))
  x, y = depth_limits._batch(setup, 32, config.seed)  # pylint: disable=protected-access
  model = setup.model
  by_point = {}
  for r in records:
    by_point.setdefault(r["samples"], []).append(r)
    assert r["delay"] == 2 * (model.num_stages - 1 - r["stage"])
    assert r["learning_rate"] == pytest.approx(setup.recipe.learning_rate)
    assert r["lr_sharpness"] == pytest.approx(r["learning_rate"] * r["sharpness"])
  assert sorted(by_point) == [0, 240]
  loss = lambda f, unflatten: model.loss(model.apply(unflatten(f), x), y)[0]
  hessian = jax.jit(jax.hessian(loss), static_argnums=1)
  for samples, state in ((0, initial), (240, moved)):
    params = [st.params for st in state.stages]
    flat, unflatten = jax.flatten_util.ravel_pytree(params)
    dense = np.asarray(hessian(flat, unflatten), np.float64)
    starts = np.cumsum([0] + [jax.flatten_util.ravel_pytree(p)[0].size for p in params])
    for r in by_point[samples]:
      a, b = starts[r["stage"]], starts[r["stage"] + 1]
      assert r["sharpness"] == pytest.approx(np.linalg.eigvalsh(dense[a:b, a:b]).max(),
                                             rel=5e-3), (samples, r["stage"])
      block = np.asarray(flat[a:b], np.float64)
      assert r["weight_norm"] == pytest.approx(np.linalg.norm(block), rel=1e-6)
  norms = {(r["samples"], r["stage"]): r["weight_norm"] for r in records}
  assert all(norms[240, s] == pytest.approx(1.5 * norms[0, s], rel=1e-6)
             for _, s in norms)  # the checkpoint's weights are the initial ones times 1.5


def test_a_point_without_a_checkpoint_is_refused_naming_what_is_saved(tmp_path):
  plan = plan_lib.resolve(digits_config())
  with pytest.raises(ValueError, match="No checkpoint at 80 samples"):
    list(depth_limits.measure(plan, None, at_samples=(80,), batch=8, iterations=2))


@pytest.mark.parametrize("momentum", [0.0, 0.9, 0.99, 0.99918])
def test_pipemares_stable_base_step_is_never_below_its_value_at_one_delay(momentum):
  # pipemare_limit's shortcut: a base ηλ below 1 − m is stable at every delay.
  edges = [quadratic.max_stable_lr("pipemare", momentum, d) for d in range(1, 33)]
  assert edges[0] == pytest.approx(1 - momentum, rel=1e-9)
  assert min(edges) >= (1 - momentum) * (1 - 1e-9)


@pytest.mark.parametrize("momentum", [0.9, 0.99918])
def test_pipemares_limit_is_the_longest_run_of_stable_delays(momentum):
  def by_scan(x, max_delay):
    for d in range(max_delay + 1):
      if quadratic.spectral_radius("pipemare", x, momentum, d) >= 1:
        return d - 1
    return None
  for x in (0.5 * (1 - momentum), 0.999 * (1 - momentum), 1.001 * (1 - momentum),
            2 * (1 + momentum) + 0.1):
    assert depth_limits.pipemare_limit(x, momentum, 48) == by_scan(x, 48), x
  assert depth_limits.pipemare_limit(0.5 * (1 - momentum), momentum, 48) is None
  assert depth_limits.pipemare_limit(2 * (1 + momentum) + 0.1, momentum, 48) == -1


def _limit_record(stage, sharpness, limits=None, stable=None, samples=0):
  return {"num_stages": 8, "samples": samples, "method": "pb", "stage": stage,
          "delay": 2 * (7 - stage), "sharpness": sharpness, "lr_sharpness": 1e-3 * sharpness,
          "largest_stable_delay": limits or {},
          "stable_at_delay": stable or dict.fromkeys(depth_limits.LIMIT_METHODS, True)}


def _run(method, seed, accuracy, status="finished", divergence=None):
  record = {"run": "", "overrides": {"model_kwargs.depth": 8, "method": method, "seed": seed},
            "status": status, "test_accuracy": accuracy}
  if divergence:
    record["divergence"] = divergence
  return study_records.parse_record(record)


def test_the_report_row_gives_the_sharpest_blocks_limits_and_the_paired_gap():
  limits = dict.fromkeys(depth_limits.LIMIT_METHODS, 9)
  records = [_limit_record(0, 50.0, {**limits, "pb": 1}), _limit_record(1, 2.0),
             _limit_record(3, 4.0, {**limits, "pb": 5}), _limit_record(7, 99.0)]
  study = [_run("sgd", 0, 0.80), _run("sgd", 1, 0.90), _run("pb", 0, 0.78), _run("pb", 1, 0.85),
           _run("pb_sc", 0, None, "diverged")]
  text = depth_limits.report_section(study, records)
  row = next(line for line in text.splitlines() if line.startswith("| 8 |")).split(" | ")
  assert row[2:5] == ["50.0 (14)", "2.0–4.0", "12"]  # the head (stage 7) is not a block
  # Stage 3's limit; the gaps −2 and −5 points, paired by seed.
  assert row[5 + depth_limits.LIMIT_METHODS.index("pb")] == "5 · −3.5 pts (n=2)"
  assert row[5 + depth_limits.LIMIT_METHODS.index("pb_sc")] == "9 · div. 1/1"
  assert "No curvature measured" in depth_limits.report_section(study, [])


def test_each_methods_verdict_sets_the_predicted_break_against_the_runs():
  everything_stable = dict.fromkeys(depth_limits.LIMIT_METHODS, True)
  limits = dict.fromkeys(depth_limits.LIMIT_METHODS, 20)
  early = [_limit_record(0, 50.0, {**limits, "pb": 3},
                         {**everything_stable, "pb": False, "pb_sc": False}),
           _limit_record(1, 2.0, limits)]
  late = [_limit_record(0, 1.0, limits, samples=500), _limit_record(1, 2.0, limits, samples=500)]
  study = [_run("sgd", 0, 0.80), _run("sgd", 1, 0.90),
           _run("pb", 0, None, "diverged", {"samples": 300, "stages": [0]}),
           _run("pb", 1, None, "diverged", {"samples": 420, "stages": [0, 1]}),
           _run("pb_sc", 0, 0.70), _run("pb_sc", 1, 0.86),
           _run("pipemare", 0, None, "diverged"), _run("pipemare", 1, 0.9)]
  text = depth_limits.verdicts(study, early + late)
  sections = {part.split("**")[0]: part for part in text.split("\n- **")[1:]}
  assert sorted(sections) == ["PB", "PB + SC", "PipeMare"]  # SpecTrain and the others: no runs
  pb, pb_sc, pipemare = sections["PB"], sections["PB + SC"], sections["PipeMare"]
  assert "diverged 2 of 2 (first non-finite value at 300–420 samples, in stages 0, 1)" in pb
  assert "initial: limit 20 on the sharpest block against 12, 3 on the stem against 14: a break " \
         "(the stem unstable at its own delay); agrees." in pb
  assert "pb after 500:" in pb and "too late to judge: every run had diverged by 420" in pb
  assert "gap to SGD −7.00 [" in pb_sc  # −10 and −4 points
  assert "a break (the stem unstable at its own delay); disagrees: no run diverged" in pb_sc
  assert "pb after 500: limit 20 on the sharpest block against 12, 20 on the stem against 14: " \
         "no break" in pb_sc and "agrees: no run diverged" in pb_sc
  assert "diverged 1 of 2 (the records name no sample or stage)" in pipemare
  assert "disagrees for 1 of 2 runs" in pipemare


def _adam_on_a_quadratic(curvatures, divisor, lr, b1, delay, spike_compensated, steps=6000):
  """Delayed Adam on ``½ Σ λ_i w_i²`` in numpy, with its divisor ``√ν̂ + ε`` held: the decay
  rate per step of ``‖w‖`` over the run's second half (a log-linear fit)."""
  lam, divisor = np.asarray(curvatures, np.float64), np.asarray(divisor, np.float64)
  history = [np.ones_like(lam)] * (delay + 1)  # history[0] is w_{t−D}
  moment = np.zeros_like(lam)
  kept = b1 ** delay
  log_norms, log_scale = [], 0.0
  for t in range(1, steps + 1):
    gradient = lam * history[0]
    moment = b1 * moment + (1 - b1) * gradient
    moment_hat = moment / (1 - b1 ** t)
    update = kept * moment_hat + (1 - kept) * gradient if spike_compensated else moment_hat
    history = history[1:] + [history[-1] - lr * update / divisor]
    norm = np.linalg.norm(history[-1])
    log_norms.append(np.log(norm) + log_scale)
    if not 1e-50 < norm < 1e50:  # the recurrence is linear: rescaling keeps its shape
      history, moment, log_scale = ([w / norm for w in history], moment / norm,
                                    log_scale + np.log(norm))
  tail = np.arange(steps // 2, steps)
  return float(np.exp(np.polyfit(tail, np.asarray(log_norms)[tail], 1)[0]))


@pytest.mark.parametrize("method,delay", [("pb", 0), ("pb", 6), ("pb_sc", 6)])
@pytest.mark.parametrize("edge_fraction", [0.7, 1.2])
def test_adam_on_a_quadratic_decays_at_the_rate_of_its_step_curvature(method, delay,
                                                                     edge_fraction):
  # The divisor turns the sharper raw coordinate (λ 4) into the flatter one: λ/P is 2 and 10.
  curvatures, divisor, b1 = [4.0, 1.0], [2.0, 0.1], 0.9
  spike = quadratic.FORMS[method].spike_compensated
  edge = quadratic.max_stable_lr(method, b1, delay)
  lr = edge_fraction * edge / depth_limits.step_curvature(1.0, 10.0, b1, "ema")
  predicted = max(quadratic.spectral_radius(
      method, depth_limits.step_curvature(lr, lam / p, b1, "ema"), b1, delay)
      for lam, p in zip(curvatures, divisor))
  measured = _adam_on_a_quadratic(curvatures, divisor, lr, b1, delay, spike)
  assert measured == pytest.approx(predicted, abs=2e-3)
  assert (measured < 1) == (edge_fraction < 1)
  if edge_fraction < 1:  # read as heavy ball on the raw curvature, this stable run diverges
    assert quadratic.spectral_radius(method, lr * 4.0, b1, delay) > 1


def test_a_recipes_form_outside_the_two_is_refused():
  with pytest.raises(ValueError, match="form must be 'heavy_ball' or 'ema'"):
    depth_limits.step_curvature(0.1, 1.0, 0.9, "nesterov")


@pytest.mark.slow  # builds and measures an Adam run: about 25 s on two idle cores
def test_an_adam_runs_curvature_is_the_hessians_over_adams_divisor(tmp_path):
  config = digits_config(optimizer="adam", **{"reference.lr": 1e-3})
  plan = plan_lib.resolve(config)
  setup = experiment.build(plan)
  records = list(depth_limits.measure(plan, None, at_samples=(0,), batch=32, iterations=200))
  x, y = depth_limits._batch(setup, 32, config.seed)  # pylint: disable=protected-access
  model, b = setup.model, config.micro_batch_size
  params = [st.params for st in setup.runner.to_logical(
      setup.init(jax.random.PRNGKey(config.seed))).stages]
  flat, unflatten = jax.flatten_util.ravel_pytree(params)
  loss = lambda f, xb, yb: model.loss(model.apply(unflatten(f), xb), yb)[0]
  grad = jax.jit(jax.grad(loss))
  squares = [np.asarray(grad(flat, x[i:i + b], y[i:i + b]), np.float64) ** 2
             for i in range(0, len(x) - b + 1, b)]
  scale = 1 / np.sqrt(np.sqrt(np.mean(squares, axis=0)) + 1e-8)  # P^(-1/2)
  dense = np.asarray(jax.hessian(loss)(flat, x, y), np.float64) * np.outer(scale, scale)
  starts = np.cumsum([0] + [jax.flatten_util.ravel_pytree(p)[0].size for p in params])
  b1 = setup.recipe.momentum
  for r in records:
    a, e = starts[r["stage"]], starts[r["stage"] + 1]
    assert r["form"] == "ema" and r["momentum"] == pytest.approx(b1)
    assert r["sharpness"] == pytest.approx(np.linalg.eigvalsh(dense[a:e, a:e]).max(), rel=1e-2)
    assert r["lr_sharpness"] == pytest.approx(r["learning_rate"] * (1 - b1) * r["sharpness"])
