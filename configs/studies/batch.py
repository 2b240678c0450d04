r"""Batch-size study: the reference recipe converted to micro-batch 1, 4, 16 and 64 at 16 stages.

    python scripts/study.py --study=configs/studies/batch.py --workdir=docs/studies/batch

configs/deep_mlp.py at 16 stages (delays up to 30), one epoch; the batch-128 recipe converted by
the scaling rules to each micro-batch, for plain PB, PB + SC + LWP and SGD at the same batch. The
paper says small batches help PB: per sample, a smaller batch means more, smaller steps over the
same number of samples; a delay of D steps is D*b samples old, so staleness grows with b.
"""

from pipejax.study import Figure, Study, Table


def get_study(arg: str | None = None) -> Study:
  config, batches, seeds = "configs/deep_mlp.py", (1, 4, 16, 64), (0, 1)
  if arg == "smoke":
    config, batches, seeds = "configs/deep_mlp.py:smoke", (1, 4), (0,)
  elif arg:
    raise ValueError(f"Unknown study argument {arg!r}; known: smoke.")
  return Study(
      name="batch" + (" (smoke)" if arg else ""), config=config,
      # 234 ticks a chunk: every batch size then trains on the same 59904 samples (whole chunks).
      fixed={"ticks_per_chunk": 234} if arg else {"model_kwargs.depth": 16, "ticks_per_chunk": 234},
      grids=[{"micro_batch_size": batches, "method": ("sgd", "pb", "pb_sc_lwp"), "seed": seeds}],
      baseline={"method": "sgd"},
      tables=[Table("Test accuracy (%)", rows="micro_batch_size", columns="method"),
              Table("Gap to SGD at the same batch (points)", rows="micro_batch_size",
                    columns="method", kind="gap")],
      figures=[Figure("accuracy_vs_batch.png", x="micro_batch_size", series="method",
                      log_x=True)])
