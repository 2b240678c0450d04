"""Methods as data: one module per preset, each holding its :class:`Preset`.

A preset is a module of this package with a ``PRESET``: its name, display name, hyperparameters
(a dataclass), traits, quadratic form and the function that builds its :class:`Method`. This
module finds them, so that adding a method is adding one file (CONTRIBUTING.md, "Add a method"),
and answers every question about a preset by its name: :func:`make_method`, :func:`preset_of`,
:func:`traits_of`. No caller compares a method's name.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any
import warnings

from pipejax import optim
from pipejax.methods.hyperparameters import Hyperparameters, Predicting
from pipejax.methods.method import (Method, MethodError, current_weights, pb, per_stage,
                                    pipedream, sync)
from pipejax.methods.preset import BASE_OPTIMIZERS, QuadraticForm, Preset, Traits
from pipejax.methods.stage_rates import STAGE_RATES, sgd_with_pipemare_rates


def _find_presets() -> dict[str, Preset]:
  """Every module of this package with a ``PRESET``, by preset name, sorted by name."""
  found = {}
  for info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
    module = importlib.import_module(f"{__name__}.{info.name}")
    preset = getattr(module, "PRESET", None)
    if preset is None:
      continue
    if preset.name != info.name or preset.name in found:
      raise ImportError(f"pipejax/methods/{info.name}.py holds the preset of "
                        f"'{preset.name}': a preset's module is named after it, once.")
    found[preset.name] = preset
  return found


PRESETS: dict[str, Preset] = _find_presets()
"""Every preset's :class:`Preset`, by its name, sorted by name."""
# Importing the preset modules bound their names (``pb``, ``pipedream``, ``sync``) on this package:
# the names stay the builders of :mod:`pipejax.methods.method`, as documented.
from pipejax.methods.method import pb, pipedream, sync  # pylint: disable=wrong-import-position
METHODS = tuple(PRESETS)
"""Every preset's name, sorted."""
RECOMMENDED = next(name for name, preset in PRESETS.items() if preset.traits.recommended)
"""The name of the preset whose traits mark it as the recommended one."""
PLAIN_PIPELINE = next(name for name, preset in PRESETS.items() if preset.traits.plain_pipeline)
"""The name of plain Pipelined Backpropagation: the yardstick of the other pipelined presets."""
ONE_STAGE_REFERENCE = next(name for name, preset in PRESETS.items() if preset.traits.one_stage
                           and preset.optimizers == BASE_OPTIMIZERS)
"""The name of the one-stage preset of every base update (SGD or Adam without a pipeline)."""
DISPLAY_NAMES = {name: preset.display_name for name, preset in PRESETS.items()}
"""How reports and figures name the presets, by name."""


def preset_of(name: str) -> Preset:
  """The preset named ``name``, or a :class:`MethodError` that lists the known names."""
  if name not in PRESETS:
    raise MethodError(f"Unknown method '{name}'. Known methods: {', '.join(METHODS)}.")
  return PRESETS[name]


def traits_of(name: str) -> Traits:
  """What preset ``name`` is, from its name alone (see :class:`Traits`)."""
  return preset_of(name).traits


def optimizers_of(name: str) -> tuple[str, ...]:
  """The base optimizers preset ``name`` is defined for (e.g. ``('sgd', 'adam')``)."""
  return preset_of(name).optimizers


def hyperparameters_of(name: str, learning_rate, **hyperparameters: Any) -> Hyperparameters:
  """Preset ``name``'s hyperparameters, checked; a field it does not take is refused by name."""
  preset = preset_of(name)
  fields = preset.fields()
  unknown = sorted(set(hyperparameters) - set(fields))
  if unknown:
    raise MethodError(f"Method '{name}' takes no {', '.join(unknown)}: nothing would read "
                      f"{'them' if len(unknown) > 1 else 'it'}. Its hyperparameters are "
                      f"{', '.join(fields)}.")
  h = preset.hyperparameters(learning_rate=learning_rate, **hyperparameters)
  if h.optimizer not in preset.optimizers:
    raise MethodError(f"Method '{name}' is defined for the base optimizer(s) "
                      f"{', '.join(preset.optimizers)}, not '{h.optimizer}'. Use "
                      f"optimizer='{preset.optimizers[0]}' or another method.")
  return h


def make_method(name: str, *, learning_rate, **hyperparameters: Any) -> Method:
  """The methods of docs/design.md §3 by name.

  Args:
    name: one of :data:`METHODS`.
    learning_rate: float or optax schedule (in optimizer steps).
    **hyperparameters: the fields of the preset's hyperparameters dataclass
      (``preset_of(name).hyperparameters``): every preset takes those of
      :class:`Hyperparameters` (``momentum``, ``weight_decay``, ``optimizer``, ``b2``, ``eps``,
      ``decay_mask``); ``sync`` adds ``micro_batches``, ``sgd`` ``stage_rates`` (with
      ``layer_delays`` and ``anneal_steps``), the predicting presets ``horizon``, PipeMare
      ``anneal_steps`` and ``gamma``, DC-ASGD ``dc_strength``, Nesterov AsyncPP ``num_stages``
      and ``anneal_steps``. A field the preset does not take is refused.

  Every preset keeps its optimizer state in float32 for parameters of fewer bits
  (:func:`pipejax.optim.float32_state`): a bfloat16 momentum trace would stall (at 256 for
  ``m = 0.99918``). On float32 parameters the updates are those of the preset itself, bit for bit.
  """
  method = preset_of(name).build(hyperparameters_of(name, learning_rate, **hyperparameters))
  stage_optimizer = method.optimizer
  return dataclasses.replace(
      method, optimizer=lambda delay: optim.float32_state(stage_optimizer(delay)))


# The preset's names before it was called a preset: each still answers, with a DeprecationWarning.
_RENAMED = {"RECORDS": "PRESETS", "record_of": "preset_of", "Record": "Preset"}


def __getattr__(name: str) -> Any:
  if name in _RENAMED:
    warnings.warn(f"pipejax.methods.{name} is replaced by pipejax.methods.{_RENAMED[name]}.",
                  DeprecationWarning, stacklevel=2)
    return globals()[_RENAMED[name]]
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BASE_OPTIMIZERS", "DISPLAY_NAMES", "Hyperparameters", "METHODS", "Method",
           "MethodError", "PRESETS", "Predicting", "Preset", "QuadraticForm", "RECOMMENDED",
           "STAGE_RATES", "Traits", "current_weights", "hyperparameters_of", "make_method", "pb",
           "per_stage", "pipedream", "preset_of", "sgd_with_pipemare_rates", "sync", "traits_of"]
