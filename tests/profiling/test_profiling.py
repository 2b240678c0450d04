"""pipejax.profiling's instruments (not its timings): warm-up, pass counts, memory formula."""

import time

import jax
import numpy as np
import optax
import pytest

from pipejax.core import accounting
from pipejax import methods
from pipejax.core.engine import Pipeline
from pipejax.profiling import hlo, memory, speed, timing, workloads


def tiny_pipeline(ticks=8):
  x, y = workloads.stream(ticks, 1, (4,), classes=4)
  pipe = Pipeline(workloads.mlp_model(num_layers=3, width=4),
                  methods.pb(optax.sgd(0.1, momentum=0.9)), x[0], y[0])
  return pipe, x, y


def test_warm_up_compiles_every_program_the_timed_calls_run():
  # Three stages fill in 4 ticks; chunks of 3 need two fill calls before the full program runs.
  pipe, x, y = tiny_pipeline(ticks=3)
  runner = timing.TimedRunner(pipe, x, y)
  runner.warm_up()
  assert pipe.every_slot_full(runner.state)
  programs = (pipe.programs[0]._cache_size(), pipe.programs[1]._cache_size())
  assert programs == (1, 1)
  runner()  # what a timed call runs: nothing new to compile
  assert (pipe.programs[0]._cache_size(), pipe.programs[1]._cache_size()) == programs


def test_copy_bytes_counts_the_unfused_copies_of_an_hlo_module():
  hlo_text = ("%fused_computation.1 (p: f32[8,4]) -> f32[4,8] {\n"
         "  copy.9 = f32[4,8]{1,0} copy(t)\n"  # inside a fusion: no pass of its own
         "}\n"
         "%region_0.2 (arg: (f32[256,128])) -> f32[256,128] {\n"
         "  copy.1 = f32[256,128]{1,0} copy(p.2)\n"
         "  copy.2 = bf16[10]{0} copy(q)\n"
         "  add.3 = f32[256,128]{1,0} add(a, b)\n"
         "  copy.3 = pred[] copy(v)\n"
         "}\n")
  assert hlo.copy_bytes(hlo_text) == 256 * 128 * 4 + 10 * 2 + 1


def test_memory_formula_is_the_pipelines_own_accounting():
  model = workloads.mlp_model(num_layers=3, width=4)
  row = memory.memory("tiny", model, np.zeros((1, 4)), 4, ticks=4)
  pipe = Pipeline(model, methods.make_method("pb_sc_lwp", learning_rate=0.1), np.zeros((1, 4)),
                  np.zeros((1,), np.int32))
  state = pipe.init(jax.random.PRNGKey(0))
  parts = row["formula_parts"]
  assert parts["weights"] == sum(accounting.tree_bytes(st.params) for st in state.stages)
  assert parts["stash"] == pipe.spec.stash_bytes() == pipe.held_stash_bytes(state)
  assert row["formula_bytes"] == sum(parts.values())
  # The compiled chunk holds at least the state the formula counts.
  assert row["ratio_compiled_over_formula"] >= 1.0


def test_the_compiled_tick_keeps_no_copy_of_the_weights():
  # XLA's default copy insertion on a CPU copied every weight carry each tick (a pass to read and
  # one to write); the pipeline's programs are compiled so that the update works in place.
  x, y = workloads.stream(4, 1, (64,), classes=64)
  pipe = Pipeline(workloads.mlp_model(num_layers=3, width=64),
                  methods.make_method("pb_sc_lwp", learning_rate=0.1), x[0], y[0])
  counted = hlo.pipeline_passes(pipe, x, y)
  assert counted["full"]["copies"] < 0.1 and counted["filling"]["copies"] < 0.1, counted
  assert counted["full"]["bytes_accessed"] >= 7  # at least what the method must touch


def test_operations_per_tick_counts_the_kernels_of_the_loop_body():
  hlo_text = ("%fused_computation (p: f32[4]) -> f32[4] {\n"
         "  %p = f32[4]{0} parameter(0)\n"
         "  %a = f32[4]{0} add(%p, %p)\n"  # inside the fusion: part of its one kernel
         "  ROOT %m = f32[4]{0} multiply(%a, %a)\n"
         "}\n"
         "%cheap (p.1: f32[4]) -> f32[4] {\n"
         "  ROOT %p.1 = f32[4]{0} parameter(0)\n"
         "}\n"
         "%costly (p.2: f32[4]) -> f32[4] {\n"
         "  %p.2 = f32[4]{0} parameter(0)\n"
         "  %n = f32[4]{0} negate(%p.2)\n"
         "  ROOT %e = f32[4]{0} exponential(%n)\n"
         "}\n"
         "%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {\n"
         "  %t = (s32[], f32[4]{0}) parameter(0)\n"
         "  %i = s32[] get-tuple-element(%t), index=0\n"
         "  %x = f32[4]{0} get-tuple-element(%t), index=1\n"
         "  %f = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_computation\n"
         "  %d = f32[4]{0} custom-call(%f, %f), custom_call_target=\"__cublas$gemm\"\n"
         "  %c = f32[4]{0} conditional(%i, %d, %d), branch_computations={%cheap, %costly}\n"
         "  ROOT %r = (s32[], f32[4]{0}) tuple(%i, %c)\n"
         "}\n"
         "%cond (t.1: (s32[], f32[4])) -> pred[] {\n"
         "  %t.1 = (s32[], f32[4]{0}) parameter(0)\n"
         "  ROOT %k = pred[] constant(true)\n"
         "}\n"
         "ENTRY %main (x.1: f32[4]) -> (s32[], f32[4]) {\n"
         "  %x.1 = f32[4]{0} parameter(0)\n"
         "  %z = s32[] constant(0)\n"
         "  %init = (s32[], f32[4]{0}) tuple(%z, %x.1)\n"
         "  ROOT %w = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body\n"
         "}\n")
  # The fusion, the library call, the conditional and its costlier branch's two operations.
  assert hlo.operations_per_tick(hlo_text) == 1 + 1 + 1 + 2


def test_best_times_warns_when_a_timed_call_is_too_short(caplog):
  seconds = timing.best_times({"quick": lambda: 0, "slow": lambda: time.sleep(0.06)}, 2)
  assert seconds["slow"][0] >= 0.06 > seconds["quick"][0]
  warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  assert len(warned) == 1 and "quick" in warned[0] and "slow" not in warned[0], warned


def test_tick_time_fit_recovers_a_known_line():
  # Ticks of 20 us + 8 us per pass: pb at 7 passes takes 76 us, so 0.85 of its speed allows
  # 76 / 0.85 = 89.41 us, i.e. (89.41 - 20) / 8 - 7 = 1.68 passes more than pb.
  rows = [{"method": name, "passes_per_tick": {"full": {"bytes_accessed": passes}},
           "samples_per_s": 1e6 / (20.0 + 8.0 * passes)}
          for name, passes in (("pb", 7.0), ("pb_lwp", 10.0), ("pipemare", 13.0))]
  fit = speed.tick_time_fit(rows)
  assert fit["fixed_us"] == pytest.approx(20.0) and fit["us_per_pass"] == pytest.approx(8.0)
  assert fit["largest_residual_us"] == pytest.approx(0.0, abs=1e-9)
  assert fit["extra_passes_at_target"] == pytest.approx((76 / 0.85 - 20) / 8 - 7)


def cores_and_sum(a, b):
  """What a child of :func:`timing.on_one_core` runs: the cores it may use, and its arguments'
  sum (so that the kwargs are seen to arrive)."""
  import os  # pylint: disable=import-outside-toplevel
  return {"cores": sorted(os.sched_getaffinity(0)), "sum": a + b}


def test_on_one_core_runs_the_function_in_a_process_held_to_one_core():
  result = timing.on_one_core(__name__, "cores_and_sum", a=2, b=3)
  assert len(result["cores"]) == 1
  assert result["sum"] == 5


def test_on_one_core_says_which_call_failed():
  with pytest.raises(RuntimeError, match=r"os\.no_such_function on one core"):
    timing.on_one_core("os", "no_such_function")


def test_lm_row_counts_the_recompute_in_the_pipelines_arithmetic():
  # PB's backward recomputes each stage's forward; the plain loop differentiates the forward it
  # ran. A transformer's backward costs about twice its forward, so the plain loop does about
  # 3/4 of the pipeline's arithmetic.
  row = speed.lm_row(blocks=1, sequences=4, repeats=1, width=16)
  assert 0.7 < row["flops_ratio_plain_over_pipeline"] < 0.9
  assert row["num_stages"] == 3 and row["pipeline_compile_s"] > 0
