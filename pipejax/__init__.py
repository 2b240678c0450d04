"""pipejax: fine-grained, asynchronous Pipelined Backpropagation in JAX.

What a user needs is a name of this package:

* the runners: :class:`Pipeline` (one device, stage by stage), :class:`StackedPipeline` (runs of
  identical stages as one stack) and :class:`ShardedPipeline` (over a device mesh from
  :func:`make_mesh`); :class:`PipelineError` is what they refuse a bad input with;
* the methods: :func:`make_method` and :class:`Method`;
* the model: :class:`Model` of :class:`Stage` s, :func:`from_flax`, the loss
  :func:`softmax_cross_entropy`, and the project's networks in :mod:`pipejax.models`
  (``models.build``);
* the data sets: :mod:`pipejax.data` (``data.load``);
* the optax transformations: :mod:`pipejax.optim`;
* the config's fields: :mod:`pipejax.config` (what every config file imports).

Every name is imported when first used, so that ``pipejax.config`` and the study files load
without JAX.
"""

import importlib

_NAMES = {
    "Pipeline": "pipejax.core.engine",
    "PipelineError": "pipejax.core.checks",
    "StackedPipeline": "pipejax.parallel.stacking",
    "ShardedPipeline": "pipejax.parallel.sharding",
    "make_mesh": "pipejax.parallel.mesh",
    "Method": "pipejax.methods",
    "make_method": "pipejax.methods",
    **{name: "pipejax.core.stages" for name in
       ("Model", "ModelError", "Stage", "from_flax", "softmax_cross_entropy")},
}
_NAMESPACES = ("config", "data", "models", "optim")
__all__ = sorted(_NAMES) + list(_NAMESPACES)


def __getattr__(name):
  if name in _NAMES:
    return getattr(importlib.import_module(_NAMES[name]), name)
  if name in _NAMESPACES:
    return importlib.import_module(f"pipejax.{name}")
  raise AttributeError(f"module 'pipejax' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(__all__))
