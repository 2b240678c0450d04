"""The device mesh of a sharded pipeline: a ``('data', 'stage')`` grid of devices.

``stage`` devices each own a contiguous shard of logical stages; ``data`` devices run replicas of
the pipeline on parts of every micro-batch (``pipejax.parallel.sharding``). Arrays move between a
host's full copy and the mesh with :func:`to_global` and :func:`to_host`.
"""

from __future__ import annotations

from typing import Sequence

import jax
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, PartitionSpec as P
import numpy as np

from pipejax.core.checks import PipelineError

STAGE, DATA = "stage", "data"


class MeshError(PipelineError):
  """A mesh, partition or micro-batch that does not fit the pipeline; says how to fix it."""


def make_mesh(stage: int, data: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ``('data', 'stage')`` mesh over ``devices`` (default: all global devices).

  ``data`` is the innermost (fastest) axis of ``jax.make_mesh``'s topology-aware order: each tick
  all-reduces every stage's gradient over ``data`` but sends only one activation packet along
  ``stage``, so the data replicas of one stage should share the fastest links (one host). Axes are
  ``Auto``: the pipeline places its buffers itself.

  Raises:
    MeshError: ``stage * data`` differs from the number of devices, or an axis is < 1.
  """
  for name, size in (("stage", stage), ("data", data)):
    if not isinstance(size, (int, np.integer)) or size < 1:
      raise MeshError(f"mesh.{name} must be an integer >= 1; got {size!r}.")
  devices = list(jax.devices() if devices is None else devices)
  if stage * data != len(devices):
    count = len(devices)
    fits = [f"stage={count // d} x data={d}" for d in range(1, count + 1) if count % d == 0]
    raise MeshError(
        f"A mesh of stage={stage} x data={data} needs {stage * data} devices, but there are "
        f"{count} ({_describe_devices(devices)}). Choose mesh.stage * mesh.data = {count}: "
        f"{', '.join(fits[:4])}{', ...' if len(fits) > 4 else ''}."
        + (f" To try a mesh on one CPU, give it fake devices: set XLA_FLAGS="
           f"--xla_force_host_platform_device_count={stage * data} before starting Python."
           if all(d.platform == "cpu" for d in devices) and stage * data > count else ""))
  grid = np.array(devices, dtype=object).reshape(stage, data)
  if devices == list(jax.devices()):
    try:  # the physical topology's order on TPU and GPU
      grid = jax.make_mesh((stage, data), (STAGE, DATA),
                           axis_types=(AxisType.Auto, AxisType.Auto)).devices
    except (ValueError, NotImplementedError):  # a shape the topology helper cannot lay out
      pass
  return Mesh(np.asarray(grid).T, (DATA, STAGE), axis_types=(AxisType.Auto, AxisType.Auto))


def _describe_devices(devices) -> str:
  kinds = sorted({d.platform for d in devices})
  processes = len({d.process_index for d in devices})
  return f"{'/'.join(kinds) or 'none'} on {processes} process{'es' if processes != 1 else ''}"


def normalized_mesh(mesh: Mesh) -> Mesh:
  """The mesh as ``('data', 'stage')`` with Auto axes (a missing ``data`` axis has size 1)."""
  if not isinstance(mesh, Mesh):
    raise MeshError(f"mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}. Build one with "
                    "pipejax.parallel.mesh.make_mesh(stage, data).")
  names = tuple(mesh.axis_names)
  extra = [n for n in names if n not in (STAGE, DATA)]
  if STAGE not in names or extra:
    raise MeshError(f"The mesh must have a '{STAGE}' axis and optionally a '{DATA}' axis; it has "
                    f"axes {names}. Build one with pipejax.parallel.mesh.make_mesh(stage, data).")
  devices = np.asarray(mesh.devices)
  if DATA not in names:
    devices = devices[None]
  elif names.index(DATA) != 0:
    devices = devices.T
  return Mesh(devices, (DATA, STAGE), axis_types=(AxisType.Auto, AxisType.Auto))


def to_global(host_array, sharding) -> jax.Array:
  """A global array placed by ``sharding``, each process filling its own devices' parts from its
  full host copy."""
  host_array = np.asarray(host_array)
  return jax.make_array_from_callback(host_array.shape, sharding, lambda index: host_array[index],
                                      dtype=host_array.dtype)


def to_host(array) -> np.ndarray:
  """A host copy of ``array``, gathered from the other processes when it spans them (then a
  collective: every process calls it, and each gets the whole array, so that a digest of it is
  the same whichever number of processes wrote or reads it)."""
  if isinstance(array, jax.Array) and not array.is_fully_addressable:
    if array.is_fully_replicated:  # every process holds all of it
      return np.asarray(array.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))
  return np.asarray(array)


def tree_to_host(arrays: dict) -> dict:
  """Host copies of the arrays, those spread over processes gathered in one collective.

  (Gathering each array on its own would compile and run one small program per buffer.)
  """
  spread = {k: v for k, v in arrays.items()
            if isinstance(v, jax.Array) and not v.is_fully_addressable}
  if spread:
    replicated = {k: v.sharding.update(spec=P()) for k, v in spread.items()}
    spread = jax.jit(_identity, out_shardings=replicated)(spread)
  return {k: to_host(spread.get(k, v)) for k, v in arrays.items()}


def _identity(tree):
  return tree  # one function object, so that jit compiles each gather once
