"""pipejax: fine-grained, asynchronous Pipelined Backpropagation in JAX.

The top-level names are imported lazily, so that light modules (``pipejax.config``, which every
config file imports) load without JAX.
"""

import importlib

_LAZY = {name: "pipejax.core.stages" for name in
         ("Model", "ModelError", "Stage", "from_flax", "softmax_cross_entropy")}
__all__ = sorted(_LAZY)


def __getattr__(name):
  if name in _LAZY:
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'pipejax' has no attribute {name!r}")
