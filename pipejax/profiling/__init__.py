"""Profiling of the pipeline engine: what its compiled programs do, and how fast they run.

``scripts/benchmark.py`` composes these measurements into one JSON object.

* :mod:`~pipejax.profiling.hlo`: a compiled program's cost per tick read from its optimized HLO
  (passes over the weights, unfused copies, kernel launches), for every kind of runner;
* :mod:`~pipejax.profiling.timing`: interleaved best-of-N timing, and a runner kept warm for it;
* :mod:`~pipejax.profiling.workloads`: the benchmarked networks, their streams and the plain
  (unpipelined) optax loop they are compared with;
* :mod:`~pipejax.profiling.speed`: one device: ``Pipeline.run`` against the plain loop, per
  method, normalizer, depth and model, compile times, and the line through tick times and passes;
* :mod:`~pipejax.profiling.memory`: a compiled chunk's memory against the pipeline's formula;
* :mod:`~pipejax.profiling.meshes`: ``ShardedPipeline`` on stage meshes, and the fake-device
  control;
* :mod:`~pipejax.profiling.report`: the recorded JSON files as one generated markdown report.
"""
