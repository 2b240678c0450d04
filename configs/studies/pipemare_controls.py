r"""PipeMare controls: is its lead over SGD its learning-rate rescheduling or its pipeline?

    python scripts/study.py --study=configs/studies/pipemare_controls.py \
        --workdir=docs/studies/pipemare_controls
    python scripts/study.py --study=configs/studies/pipemare_controls.py:smoke \
        --workdir=/tmp/pipemare_smoke

PipeMare ends above SGD at every depth of the depth study, by about one point whatever the depth,
which suggests a schedule effect rather than staleness removed. Its per-stage learning rate starts
at lr / D_s and anneals to lr over K steps; in the depth study K is one epoch, the whole run. At 32
stages, one epoch, three seeds, starting weights shared per seed:

* SGD and PipeMare as in the depth study (annealing over the whole run);
* PipeMare with its annealing over a fixed fraction (a tenth) of the run, so that the
  rescheduling ends early and the run is PipeMare's pipeline at the full rate after it;
* PipeMare with the rescheduling off (``method_kwargs.pipemare.anneal_epochs=0``: every stage at
  the base rate, discrepancy correction only);
* SGD without a pipeline whose every layer follows the rate PipeMare gives its stage
  (``method_kwargs.sgd.stage_rates=pipemare``).

If the rescheduled SGD matches PipeMare and PipeMare without rescheduling loses the lead, the lead
is the schedule's.
"""

from pipejax.study import Study, Table

PIPEMARE = "method_kwargs.pipemare"  # PipeMare's section of the training config


def get_study(arg: str | None = None) -> Study:
  config, fixed, seeds = "configs/deep_mlp.py", {"model_kwargs.depth": 32}, (0, 1, 2)
  if arg == "smoke":
    config, fixed, seeds = "configs/deep_mlp.py:smoke", {}, (0, 1)
  elif arg:
    raise ValueError(f"Unknown study argument {arg!r}; known: smoke.")
  return Study(
      name="PipeMare controls" + (" (smoke)" if arg else ""), config=config, fixed=fixed,
      grids=[{"method": ("sgd", "pipemare"), "seed": seeds},
             {"method": ("pipemare",), f"{PIPEMARE}.anneal_fraction": (0.1,), "seed": seeds},
             {"method": ("pipemare",), f"{PIPEMARE}.anneal_epochs": (0.0,), "seed": seeds},
             {"method": ("sgd",), "method_kwargs.sgd.stage_rates": ("pipemare",),
              "seed": seeds}],
      baseline={"method": "sgd"}, margin=0.005,
      labels={f"{PIPEMARE}.anneal_fraction": "annealing over a fraction of the run",
              f"{PIPEMARE}.anneal_epochs": "annealing epochs (0: no rescheduling)",
              "method_kwargs.sgd.stage_rates": "per-layer rates"},
      tables=[Table("PipeMare and its controls: test accuracy (%) and gap to SGD (points)",
                    rows="", columns="", kind="cells")])
