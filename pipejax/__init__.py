"""pipejax: fine-grained, asynchronous Pipelined Backpropagation in JAX.

What a user needs is a name of this package:

* the runners: :class:`Pipeline` (one device, stage by stage, or with identical stages stacked:
  ``stack=True``) and :class:`ShardedPipeline` (over a device mesh from :func:`make_mesh`);
  :class:`PipelineError` is what they refuse a bad input with (:func:`StackedPipeline` is the
  old spelling of ``pipe.restacked()``);
* the methods: :func:`make_method` and :class:`Method`;
* the model: :class:`Model` of :class:`Stage` s, :func:`from_flax`, the loss
  :func:`softmax_cross_entropy`, and the project's networks in :mod:`pipejax.models`
  (``models.build``);
* the data sets: :mod:`pipejax.data` (``data.load``);
* the optax transformations: :mod:`pipejax.optim`;
* the config's fields: :mod:`pipejax.config` (what every config file imports).

Every name is imported when first used, so that ``pipejax.config`` and the study files load
without JAX. The same names are imported under ``TYPE_CHECKING`` below, for the readers that never
run this file: type checkers, IDEs and the API reference (``scripts/api_docs.py``).
"""

import importlib
import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from pipejax import config as config
  from pipejax import data as data
  from pipejax import models as models
  from pipejax import optim as optim
  from pipejax.core.checks import PipelineError as PipelineError
  from pipejax.core.flax_bridge import from_flax as from_flax
  from pipejax.core.engine import Pipeline as Pipeline
  from pipejax.core.engine import StackedPipeline as StackedPipeline
  from pipejax.core.stages import Model as Model
  from pipejax.core.stages import ModelError as ModelError
  from pipejax.core.stages import Stage as Stage
  from pipejax.core.stages import softmax_cross_entropy as softmax_cross_entropy
  from pipejax.methods import Method as Method
  from pipejax.methods import make_method as make_method
  from pipejax.parallel.mesh import make_mesh as make_mesh
  from pipejax.parallel.sharding import ShardedPipeline as ShardedPipeline

_NAMES = {
    "Pipeline": "pipejax.core.engine",
    "PipelineError": "pipejax.core.checks",
    "StackedPipeline": "pipejax.core.engine",
    "ShardedPipeline": "pipejax.parallel.sharding",
    "make_mesh": "pipejax.parallel.mesh",
    "Method": "pipejax.methods",
    "make_method": "pipejax.methods",
    "from_flax": "pipejax.core.flax_bridge",
    **{name: "pipejax.core.stages" for name in
       ("Model", "ModelError", "Stage", "softmax_cross_entropy")},
}
_NAMESPACES = ("config", "data", "models", "optim")
__all__ = sorted(_NAMES) + list(_NAMESPACES)


def __getattr__(name):
  if name in _NAMES:
    value = getattr(importlib.import_module(_NAMES[name]), name)
  elif name in _NAMESPACES or importlib.util.find_spec(f"pipejax.{name}") is not None:
    # Any package of pipejax by its attribute (pipejax.methods.make_method after `import
    # pipejax`), as it would be once something else had imported it.
    value = importlib.import_module(f"pipejax.{name}")
  else:
    raise AttributeError(f"module 'pipejax' has no attribute {name!r}")
  globals()[name] = value  # found directly next time, and by readers of the module's __dict__
  return value


def __dir__():
  return sorted(set(globals()) | set(__all__))
