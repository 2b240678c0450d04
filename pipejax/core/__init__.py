"""The pure tick: a pipeline's state, its stages, one tick of every stage, and the runner interface.

Nothing here knows about devices beyond one, files, or configs: :mod:`pipejax.parallel` spreads
the tick over devices and :mod:`pipejax.train` drives it from a config.
"""
