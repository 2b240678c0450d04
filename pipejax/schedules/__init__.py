"""A cost model of every pipeline schedule, simulated event by event (pure Python, no JAX).

Give per-layer costs (forward F, activation gradient B, weight gradient W, optional transfer
time and activation bytes), a device count and a schedule name; :func:`simulate` returns its
throughput, bubble rate, peak activation memory, weight versions and per-layer gradient delays.
:mod:`pipejax.schedules.measure` measures the costs of a pipejax model with XLA's cost analysis.

Example:
  >>> from pipejax import schedules
  >>> schedules.simulate('zb_h1', schedules.uniform(4), num_devices=4, micro_batches=8).bubble_rate
  0.125
  >>> schedules.simulate('pb', schedules.uniform(4), num_devices=4).delays
  [6, 4, 2, 0]
"""

from pipejax.schedules.costs import LayerCost, ScheduleError, uniform
from pipejax.schedules.plans import SCHEDULES
from pipejax.schedules.report import NAMES, Report, delay_profile, simulate

__all__ = ["LayerCost", "NAMES", "Report", "SCHEDULES", "ScheduleError", "delay_profile",
           "simulate", "uniform"]
