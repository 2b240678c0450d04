"""The convex quadratic ``L(w) = ½ λ w²``: each pipelined method as a linear recurrence.

* :mod:`~pipejax.analysis.quadratic.stability`: the companion matrices, stability limits and best
  rates (docs/design.md §5); its public names are this package's, ``quadratic.spectral_radius``;
* :mod:`~pipejax.analysis.quadratic.simulation`: each update rule stepped directly, the
  independent check of the matrices;
* :mod:`~pipejax.analysis.quadratic.noise`: the excess loss under gradient noise;
* :mod:`~pipejax.analysis.quadratic.figures`: the figures of docs/quadratic.md;
* :mod:`~pipejax.analysis.quadratic.docs`: its tables and docs/quadratic.md's numbers.
"""

from pipejax.analysis.quadratic.stability import (
    FORMS,
    METHODS,
    PIPELINE_METHODS,
    REFERENCE,
    best_rate,
    check_arguments,
    check_lr,
    companion_matrix,
    effective_delay,
    gradient_column,
    largest_stable_delay,
    lr_scale,
    max_stable_lr,
    spectral_radii,
    spectral_radius,
    stability_table,
)

__all__ = ["FORMS", "METHODS", "PIPELINE_METHODS", "REFERENCE", "best_rate", "check_arguments",
           "check_lr", "companion_matrix", "effective_delay", "gradient_column",
           "largest_stable_delay", "lr_scale", "max_stable_lr", "spectral_radii",
           "spectral_radius", "stability_table"]
