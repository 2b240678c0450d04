"""The pure tick: a pipeline's state, its stages, each stage's maths, one tick over its parts, the
local runner and the runner interface.

Nothing here knows about devices beyond one, files, or configs: :mod:`pipejax.parallel` spreads
the tick over devices and :mod:`pipejax.train` drives it from a config.
"""
