"""Replaced by :mod:`pipejax.methods.preset`: its names still answer here, each with a
DeprecationWarning that names what replaced it."""

from typing import Any
import warnings

from pipejax.methods import preset as _preset

_RENAMED = {"Record": "Preset", "Traits": "Traits", "QuadraticForm": "QuadraticForm",
            "BASE_OPTIMIZERS": "BASE_OPTIMIZERS", "PREDICTION_FORMS": "PREDICTION_FORMS"}


def __getattr__(name: str) -> Any:
  if name in _RENAMED:
    warnings.warn(f"pipejax.methods.record.{name} is replaced by "
                  f"pipejax.methods.preset.{_RENAMED[name]}.", DeprecationWarning, stacklevel=2)
    return getattr(_preset, _RENAMED[name])
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
