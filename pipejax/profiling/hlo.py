"""A compiled tick's cost read from its optimized HLO: passes over the weights, copies, kernels.

Passes over the weights: XLA's ``cost_analysis`` of a compiled ``lax.scan`` counts its body once,
so the "bytes accessed" of a compiled chunk is that of one tick (plus the few bytes outside the
loop). Divided by the bytes of every stage's weights it is the number of weight-sized passes a
tick makes: at micro-batch 1 activations are a rounding error beside the weights. ``copies`` are
the bytes written by the unfused ``copy`` instructions XLA inserted (loop carries it could not
update in place), in the same unit; each also reads as much, inside ``bytes_accessed``.
``operations`` counts the kernels a tick launches (:func:`operations_per_tick`): on a GPU at small
micro-batches they, not the passes, set the pace.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import jax
import numpy as np

from pipejax.core import accounting

# Instructions that launch nothing: they name, bundle or reinterpret buffers other work produced.
_FREE_OPERATIONS = frozenset({"parameter", "get-tuple-element", "tuple", "constant", "bitcast",
                              "opt-barrier", "after-all", "partition-id", "replica-id"})

# An instruction's called computations: ``body=%b``, ``branch_computations={%x, %y}``, ...
_CALLED_COMPUTATIONS = re.compile(r"\b(body|condition|calls|to_apply|branch_computations|"
                                  r"true_computation|false_computation)=(\{[^}]*\}|%[\w.-]+)")
_COPY = re.compile(r"= (\w+)\[([\d,]*)\](?:\{[^}]*\})? copy\(")


class Copy(NamedTuple):
  """One unfused ``copy`` instruction: its computation, and the size of what it writes."""
  computation: str
  elements: int
  bytes: int


def unfused_copies(hlo_text: str) -> list[Copy]:
  """The ``copy`` instructions of an optimized HLO module that are passes of their own.

  A copy inside a fused computation (a transpose fused into its consumer) is part of a pass the
  fusion makes anyway; only copies in the other computations (the loop body, the entry) count.
  """
  copies, name, fused = [], None, False
  for line in hlo_text.splitlines():
    if line and not line[0].isspace():  # a computation's header, or its closing brace
      name = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
      fused = name.lstrip("%").startswith("fused_")
      continue
    match = _COPY.search(line)
    if match and not fused:
      dtype, dims = match.groups()
      size = 1 if dtype == "pred" else int(re.sub(r"\D", "", dtype)) // 8  # f32, bf16, s8, ...
      elements = int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
      copies.append(Copy(name, elements, size * elements))
  return copies


def copy_bytes(hlo_text: str) -> int:
  """Bytes written by the :func:`unfused_copies` of an optimized HLO module.

  Of the branches of a conditional only one runs: each conditional counts its costliest branch,
  as ``cost_analysis`` does.
  """
  per_computation = {}
  for copy in unfused_copies(hlo_text):
    per_computation[copy.computation] = per_computation.get(copy.computation, 0) + copy.bytes
  branch_sets = [[b.strip() for b in branches.split(",")]
                 for branches in re.findall(r"branch_computations=\{([^}]*)\}", hlo_text)]
  in_branches = {b for branch_set in branch_sets for b in branch_set}
  return (sum(v for k, v in per_computation.items() if k not in in_branches)
          + sum(max(per_computation.get(b, 0) for b in branch_set) for branch_set in branch_sets))


def operations_per_tick(hlo_text: str) -> int:
  """Operations of the loop body of a compiled chunk: one tick's kernel launches on a GPU.

  A fusion is one kernel and a library call (a cuBLAS product) is one; a loop inside the tick
  counts its body and condition, and a conditional itself and its costliest branch (one runs).
  At small micro-batches a GPU spends its tick launching kernels rather than computing, so this
  count, not the passes over the weights, sets the pace there. Of several loops the costliest
  body is the tick.
  """
  computations, name, entry = {}, None, None  # computation -> [(opcode, {role: [callees]})]
  for line in hlo_text.splitlines():
    if line.startswith(("%", "ENTRY ")):
      name = line.split()[1] if line.startswith("ENTRY ") else line.split()[0]
      computations[name] = []
      if line.startswith("ENTRY "):
        entry = name
    elif name and re.match(r"\s+(ROOT )?%", line):
      opcode = re.search(r" = .*?\s([a-z][a-z0-9-]*)\(", line)
      callees = {role: re.findall(r"%[\w.-]+", targets)
                 for role, targets in re.findall(_CALLED_COMPUTATIONS, line)}
      computations[name].append((opcode.group(1) if opcode else "", callees))

  def count(computation):
    total = 0
    for opcode, callees in computations.get(computation, []):
      called = [c for targets in callees.values() for c in targets]
      if opcode in _FREE_OPERATIONS:
        continue
      if opcode in ("while", "call"):
        total += sum(count(c) for c in called)
      elif opcode == "conditional":
        total += 1 + max((count(c) for c in called), default=0)
      else:
        total += 1
    return total

  def loop_bodies(computation):
    for opcode, callees in computations.get(computation, []):
      if opcode == "while":
        yield from callees.get("body", [])
      elif opcode in ("call", "conditional"):
        for targets in callees.values():
          for c in targets:
            yield from loop_bodies(c)

  return max((count(body) for body in loop_bodies(entry)), default=count(entry))


def cost(compiled) -> dict:
  """XLA's ``cost_analysis`` of a compiled program (of a ``lax.scan``: one iteration's)."""
  analysis = compiled.cost_analysis()
  return analysis[0] if isinstance(analysis, list) else analysis


def passes(compiled, per_pass_bytes: int) -> dict:
  """Weight-sized passes of a compiled tick: bytes accessed and copied over the weights' bytes,
  and its :func:`operations_per_tick`."""
  hlo_text = compiled.as_text()
  return {"bytes_accessed": cost(compiled)["bytes accessed"] / per_pass_bytes,
          "copies": copy_bytes(hlo_text) / per_pass_bytes,
          "operations": operations_per_tick(hlo_text)}


def weight_bytes(pipe) -> int:
  """Bytes of every stage's weights of a :class:`~pipejax.core.engine.Pipeline`: one pass."""
  return sum(accounting.tree_bytes(p) for p in pipe.spec.stage_param_shapes)


def pipeline_passes(pipe, x, y) -> dict:
  """Passes per tick of both programs of ``Pipeline.run``: after the fill, and while filling."""
  state = pipe.state_spec
  per_pass = weight_bytes(pipe)
  full, filling = (passes(pipe.lower(state, x[:4], y[:4], every_slot_full=full).compile(),
                          per_pass) for full in (True, False))
  return {"full": full, "filling": filling}


def sharded_passes(sharded, x, y) -> dict:
  """Passes per tick of a ShardedPipeline's full-pipeline program, over all stages' weights."""
  packed = sharded.init(jax.random.PRNGKey(0))
  batch = sharded.placed_batch(x[:4], y[:4])
  compiled = sharded.programs[1].lower(packed, batch).compile()
  # One loop iteration runs ticks_per_iteration ticks (two over several devices).
  return passes(compiled, weight_bytes(sharded.pipeline) * sharded.ticks_per_iteration)


def plain_passes(scan, params, opt_state, x, y) -> dict:
  """Passes per tick of a plain loop ``scan`` (:func:`pipejax.profiling.workloads.plain_scan`)."""
  compiled = scan.lower((params, opt_state), (x[:4], y[:4])).compile()
  return passes(compiled, accounting.tree_bytes(params))
