"""A compiled training chunk's memory against the pipeline's own formula."""

from __future__ import annotations

from pipejax.core import accounting
from pipejax import methods
from pipejax.core.engine import Pipeline
from pipejax.profiling.workloads import stream

METHOD = methods.RECOMMENDED  # the default config's method


def memory(name: str, model, example_input, num_classes: int, ticks: int = 64) -> dict:
  """Compiled memory of a chunk of ``ticks`` ticks (``memory_analysis`` of the full pipeline's
  ``run``) against the formula, in bytes.

  The formula: weights + optimizer state + stashed inputs sum_s (D_s+1)|x_s| + the registers
  (each stage's forward and backward outputs of the last tick). The chunk's own input stream and
  metrics are arguments and outputs of the program too; they are reported, not counted.
  """
  x, y = stream(ticks, example_input.shape[0], example_input.shape[1:], classes=num_classes)
  pipe = Pipeline(model, methods.make_method(METHOD, learning_rate=1e-3, momentum=0.9),
                  x[0], y[0])
  state = pipe.state_spec
  stats = pipe.lower(state, x, y).compile().memory_analysis()
  parts = {
      "weights": sum(accounting.tree_bytes(st.params) for st in state.stages),
      "optimizer_state": sum(accounting.tree_bytes(st.opt_state) for st in state.stages),
      "stash": pipe.spec.stash_bytes(),
      "registers": sum(accounting.tree_bytes((st.forward_out, st.backward_out))
                       for st in state.stages),
  }
  formula = sum(parts.values())
  stream_bytes = accounting.tree_bytes(pipe.spec.checked_batch(x, y, None, ticks=True))
  metrics_bytes = ticks * accounting.tree_bytes(pipe.metric_shapes())
  # Arguments (state + stream) and outputs (state + metrics) share the donated state's buffers.
  live = (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
          + stats.temp_size_in_bytes)
  compiled_state = live - stream_bytes - metrics_bytes
  return {
      "model": name, "method": METHOD, "ticks": ticks, "formula_bytes": formula,
      "formula_parts": parts, "compiled_bytes": compiled_state,
      "ratio_compiled_over_formula": compiled_state / formula,
      "memory_analysis": {k: getattr(stats, k) for k in (
          "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
          "temp_size_in_bytes", "peak_memory_in_bytes") if hasattr(stats, k)},
      "stream_bytes": stream_bytes, "metrics_bytes": metrics_bytes,
      "temp_over_weights": stats.temp_size_in_bytes / parts["weights"],
  }
