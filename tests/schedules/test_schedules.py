"""The schedule cost model against the closed forms of each schedule's paper, and by hand."""

import subprocess
import sys

import pytest

from pipejax import schedules
from pipejax.schedules import LayerCost, ScheduleError, drawing, simulate, uniform

SIZES = [(2, 4), (3, 6), (4, 8), (4, 12), (6, 16)]


@pytest.mark.parametrize("p,m", SIZES)
def test_gpipe_bubble_is_p_minus_1_over_m_plus_p_minus_1(p, m):
  report = simulate("gpipe", uniform(p), p, m)
  assert report.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
  assert report.bubble_rate == pytest.approx((p - 1) / m)
  assert report.peak_activations == [m] * p
  assert report.delays == [0] * p


@pytest.mark.parametrize("p,m", SIZES)
def test_1f1b_bubble_rate_and_memory(p, m):
  report = simulate("1f1b", uniform(p), p, m)
  assert report.bubble_rate == pytest.approx((p - 1) / m)
  assert report.bubble_rate_per_device == pytest.approx([(p - 1) / m] * p)
  assert report.peak_activations == [p - d for d in range(p)]
  assert report.weight_versions == [1] * p
  # Throughput: m samples per iteration of (m + p - 1)(F + B + W).
  assert report.throughput == pytest.approx(m / (3 * (m + p - 1)))


@pytest.mark.parametrize("p,m", SIZES)
def test_zb_h1_bubble_rate_is_a_third_of_1f1b(p, m):
  report = simulate("zb_h1", uniform(p), p, m)
  assert report.bubble_rate == pytest.approx((p - 1) / (3 * m))
  assert max(report.peak_activations) == p  # 1F1B's peak, as the paper keeps it


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8), (4, 12)])
def test_zb_h2_has_no_bubble_once_m_reaches_2p_minus_1(p, m):
  assert m >= 2 * p - 1
  report = simulate("zb_h2", uniform(p), p, m)
  assert report.bubble_rate == pytest.approx(0.0, abs=1e-12)
  assert report.peak_activations == [2 * p - 1] * p


@pytest.mark.parametrize("num_stages", [1, 2, 4, 7])
def test_pb_delays_memory_and_full_utilization(num_stages):
  report = simulate("pb", uniform(num_stages), num_stages)
  assert report.delays == [2 * (num_stages - 1 - s) for s in range(num_stages)]
  assert report.peak_activations == [2 * (num_stages - 1 - s) + 1 for s in range(num_stages)]
  assert report.weight_versions == [1] * num_stages
  assert report.utilization == pytest.approx(1.0)
  assert report.throughput == pytest.approx(1 / 3)  # one sample per tick of F + B + W


def test_pb_utilization_with_unequal_stages_is_mean_over_max():
  # The slowest stage sets the tick: utilization = sum(c) / (S max c).
  layers = [LayerCost(1, 1, 1), LayerCost(2, 2, 2), LayerCost(3, 3, 3), LayerCost(1, 0, 2)]
  report = simulate("pb", layers, 4)
  totals = [3, 6, 9, 3]
  assert report.utilization == pytest.approx(sum(totals) / (4 * max(totals)))
  assert report.throughput == pytest.approx(1 / 9)


def test_pb_at_granularity_k_groups_k_layers_per_stage():
  report = simulate("pb", uniform(12), 4, layers_per_stage=3)
  assert report.device_layers == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
  assert report.delays == [6, 4, 2, 0]
  assert report.layer_delays == [6, 6, 6, 4, 4, 4, 2, 2, 2, 0, 0, 0]
  with pytest.raises(ScheduleError, match="make 3 stages"):
    simulate("pb", uniform(12), 4, layers_per_stage=4)


@pytest.mark.parametrize("schedule", ["pipedream", "layerpipe", "layerpipe_inter"])
@pytest.mark.parametrize("num_stages", [2, 4, 6])
def test_pipedream_weight_versions_and_delays(schedule, num_stages):
  # LayerPipe is PipeDream's pipeline: with equal layers its split changes nothing.
  report = simulate(schedule, uniform(num_stages), num_stages)
  assert report.delays == [num_stages - 1 - s for s in range(num_stages)]
  assert report.weight_versions == [num_stages - s for s in range(num_stages)]
  assert report.peak_activations == [num_stages - s for s in range(num_stages)]
  assert report.bubble_rate == pytest.approx(0.0, abs=1e-12)


def test_2bw_keeps_two_weight_versions_and_a_delay_of_one():
  report = simulate("2bw", uniform(4), 4, micro_batches=4)
  assert report.weight_versions == [2, 2, 2, 1]
  assert report.delays == [1, 1, 1, 0]
  assert report.throughput == pytest.approx(1 / 3)


def test_layerpipe_assignment_by_hand():
  # Three equal layers on two devices. PipeDream: whole layers, 2 + 1 -> load 6.
  # Intra-layer: F+B 2, W 1, F+B 2 | W 1, F+B 2, W 1 -> loads 5 and 4.
  # Inter-layer: B divisible too -> 4.5 and 4.5.
  layers = uniform(3)
  assert simulate("pipedream", layers, 2).throughput == pytest.approx(1 / 6)
  assert simulate("layerpipe", layers, 2).throughput == pytest.approx(1 / 5)
  assert simulate("layerpipe_inter", layers, 2).throughput == pytest.approx(1 / 4.5)


def test_layerpipe_moves_a_heavy_weight_gradient_to_the_next_device():
  # Layer 1 (F 2, B 2, W 2) dominates. Inter-layer: device 0 takes layer 0, F1 and nothing of
  # B1 (load 4), device 1 takes B1 and W1 (load 4).
  layers = [LayerCost(1, 0, 1), LayerCost(2, 2, 2)]
  assert simulate("pipedream", layers, 2).throughput == pytest.approx(1 / 6)
  report = simulate("layerpipe_inter", layers, 2)
  assert report.throughput == pytest.approx(1 / 4)
  assert [c["forward"] + c["input_grad"] + c["weight_grad"] for c in report.device_costs] == \
      pytest.approx([4, 4])


def test_transfer_time_adds_latency_to_each_boundary():
  # GPipe with one micro-batch: forward chain, then backward chain, each crossing p-1 links.
  p, c = 3, 0.5
  report = simulate("gpipe", uniform(p, transfer=c), p, micro_batches=1)
  assert 1 / report.throughput == pytest.approx(p * 1 + p * 2 + 2 * (p - 1) * c)


def test_delay_profile_is_one_call():
  assert schedules.delay_profile("pb", 4) == [6, 4, 2, 0]
  assert schedules.delay_profile("pipedream", 4) == [3, 2, 1, 0]
  assert schedules.delay_profile("1f1b", 4) == [0, 0, 0, 0]


def test_errors_say_what_to_change():
  with pytest.raises(ScheduleError, match="only 3 layers"):
    simulate("1f1b", uniform(3), 4)
  with pytest.raises(ScheduleError, match="Unknown schedule 'zb'"):
    simulate("zb", uniform(3), 3)
  with pytest.raises(ScheduleError, match="micro_batches must be >= 1"):
    simulate("gpipe", uniform(3), 3, micro_batches=0)
  with pytest.raises(ScheduleError, match=r"finite and >= 0; layers \[1\]"):
    simulate("gpipe", [LayerCost(1, 1, 1), LayerCost(float("nan"), 1, 1)], 2)


def test_simulator_and_drawings_import_no_jax():
  code = ("import sys, pipejax.schedules, pipejax.schedules.drawing; "
          "assert not {'jax', 'matplotlib'} & set(sys.modules), 'jax or matplotlib imported'")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert result.returncode == 0, result.stderr


def test_tick_grid_as_text():
  grid = [[(0, None), (None, None)], [(1, None), (0, 0)], [(12, 0), (None, None)]]
  assert drawing.format_grid(grid).splitlines() == [
      "tick | stage 0    | stage 1   ",
      "   0 |   F0    . |    .    .",
      "   1 |   F1    . |   F0   B0",
      "   2 |  F12   B0 |    .    .",
  ]


def test_drawings_are_pngs_and_close_their_figures(tmp_path):
  from pipejax import plotting  # pylint: disable=import-outside-toplevel

  drawing.draw_grid([[(0, None), (None, None)], [(1, 0), (0, 0)]], str(tmp_path / "grid.png"),
                    "two stages")
  for name in ("pb", "1f1b"):
    drawing.draw_gantt(simulate(name, uniform(3), 3, 4), str(tmp_path / f"{name}.png"))
  for name in ("grid", "pb", "1f1b"):
    assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert len(list(tmp_path.iterdir())) == 3  # no temporary file left behind
  assert not plotting.pyplot().get_fignums()


def test_measured_costs_of_a_dense_layer():
  import jax.numpy as jnp
  from pipejax import models
  from pipejax.schedules import measure

  batch, width_in, width_out = 4, 16, 8
  layers = measure.layer_costs(models.build("mlp", hidden=(width_out,)),
                               jnp.zeros((batch, width_in)))
  matmul = 2 * batch * width_in * width_out
  first, head = layers
  assert matmul <= first.forward <= 1.2 * matmul  # + bias and ReLU
  assert first.input_grad == 0.0  # nobody needs the data's gradient
  assert matmul <= first.weight_grad <= 1.3 * matmul
  assert head.input_grad == pytest.approx(2 * batch * width_out * 10, rel=0.3)
  assert first.activation_bytes == batch * width_in * 4


def test_stale_optimizer_delays_each_stage_by_its_own_amount():
  import jax.numpy as jnp
  import optax
  from pipejax.analysis import staleness

  tx = staleness.stale_optimizer([2, 0], lambda: optax.sgd(1.0))
  params = [{"w": jnp.zeros(())}, {"w": jnp.zeros(())}]
  state = tx.init(params)
  seen = []
  for t in range(1, 5):
    grads = [{"w": jnp.asarray(float(t))}, {"w": jnp.asarray(float(t))}]
    updates, state = tx.update(grads, state, params)
    seen.append((float(updates[0]["w"]), float(updates[1]["w"])))
  # Stage 0 receives gradient t - 2 (zeros first); stage 1 gradient t; SGD negates.
  assert seen == [(0.0, -1.0), (0.0, -2.0), (-1.0, -3.0), (-2.0, -4.0)]


@pytest.mark.parametrize("module_name", ["pipejax.schedules", "pipejax.schedules.report",
                                         "pipejax.schedules.measure"])
def test_docstring_examples_run(module_name):
  import doctest
  import importlib

  result = doctest.testmod(importlib.import_module(module_name), optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0
  assert result.failed == 0
