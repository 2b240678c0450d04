"""Analysis tools beside the engine.

* :mod:`pipejax.analysis.quadratic`: the convex-quadratic stability analysis (docs/design.md §5);
  :mod:`pipejax.analysis.quadratic.simulation` steps its update rules directly (the independent
  check), :mod:`pipejax.analysis.quadratic.noise` gives the excess loss under gradient noise,
  :mod:`pipejax.analysis.quadratic.figures` draws its figures and
  :mod:`pipejax.analysis.quadratic.docs` writes its tables and docs/quadratic.md's numbers.
* :mod:`pipejax.analysis.staleness`: training under a schedule's gradient delays alone, in a
  plain optax loop (docs/schedules.md).
"""

from pipejax.analysis.quadratic import (
    METHODS,
    PIPELINE_METHODS,
    best_rate,
    companion_matrix,
    max_stable_lr,
    spectral_radii,
    spectral_radius,
    stability_table,
)
from pipejax.analysis.quadratic.simulation import multi_dim_losses, simulated_rate

__all__ = ["METHODS", "PIPELINE_METHODS", "best_rate", "companion_matrix", "max_stable_lr",
           "multi_dim_losses", "simulated_rate", "spectral_radii", "spectral_radius",
           "stability_table"]
