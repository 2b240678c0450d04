"""Analysis tools: the convex-quadratic stability analysis (docs/design.md §5)."""

from pipejax.analysis.quadratic import (
    METHODS,
    PIPELINE_METHODS,
    best_rate,
    companion_matrix,
    max_stable_lr,
    multi_dim_losses,
    plot_multi_dim_losses,
    plot_rho_by_delay,
    plot_rho_vs_lr,
    simulated_rate,
    spectral_radius,
    stability_table,
)
