r"""The stage costs behind the time-to-target section of the budget study (pipejax.analysis.price).

Measures, with XLA's cost analysis (nothing is run), the forward, backward and weight-gradient
FLOPs of each stage of the 32-stage language model at one sequence, and the FLOPs of one update
of each stage's optimizer, and writes them as JSON:

    python scripts/price.py --output=docs/studies/lm_budget/stage_costs.json

and rewrites the generated part of docs/lm.md's section "When the pipeline pays" from the budget
study's records and those costs (no JAX):

    python scripts/price.py --docs=docs/lm.md

and writes the token taxes the study measured, per preset and depth, to the file a run's start-up
warning reads (pipejax.analysis.token_tax):

    python scripts/price.py --token_tax=pipejax/methods/token_tax.json

The network is configs/studies/lm_budget.py's (``--blocks`` blocks of ``--width``, one block a
stage, ``--context`` bytes a sequence); the optimizer is ``--method``'s at stage delays.
"""

import json

from absl import app, flags

from pipejax import cli, files

_OUTPUT = flags.DEFINE_string("output", None, "Where to write the stage costs (JSON).")
_BLOCKS = flags.DEFINE_integer("blocks", 30, "Transformer blocks (stages: blocks + 2).")
_WIDTH = flags.DEFINE_integer("width", 64, "Model width.")
_HEADS = flags.DEFINE_integer("heads", 4, "Attention heads.")
_CONTEXT = flags.DEFINE_integer("context", 64, "Bytes a sequence.")
_METHOD = flags.DEFINE_string("method", "pb_muon", "The preset whose optimizer updates are "
                              "counted.")
_DOCS = flags.DEFINE_string("docs", None, "Rewrite this page's generated block instead.")
_STUDY = flags.DEFINE_string("study", "configs/studies/lm_budget.py", "--docs: the study file.")
_RECORDS = flags.DEFINE_string("records", "docs/studies/lm_budget", "--docs: its workdir.")
_TOKEN_TAX = flags.DEFINE_string("token_tax", None, "Write the study's token taxes here (the "
                                 "start-up warning reads pipejax/methods/token_tax.json).")


def _budget_sections():
  """The study's tokens-to-target and time-to-target sections."""
  from pipejax.analysis import price  # pylint: disable=import-outside-toplevel
  from pipejax.study import budget, spec  # pylint: disable=import-outside-toplevel
  try:
    study = spec.load_study(_STUDY.value)
  except spec.StudyError as e:
    raise app.UsageError(str(e)) from e
  bodies = [section.body for section in study.sections]
  tokens = next((b for b in bodies if isinstance(b, budget.TokensToTarget)), None)
  timing = next((b for b in bodies if isinstance(b, price.TimeToTarget)), None)
  if tokens is None or timing is None:
    raise app.UsageError(f"--study={_STUDY.value} has no tokens-to-target and time-to-target "
                         "sections to read.")
  return study, tokens, timing


def write_token_tax(path: str) -> None:
  from pipejax.analysis import token_tax  # pylint: disable=import-outside-toplevel
  from pipejax.study import records  # pylint: disable=import-outside-toplevel
  study, tokens, _ = _budget_sections()
  try:
    token_tax.write_taxes(tokens, records.read_results(_RECORDS.value), study.name,
                          path, command=f"python scripts/price.py --token_tax={path}")
  except token_tax.TaxSeriesError as e:
    raise app.UsageError(str(e)) from e
  print(f"Wrote the token taxes of {_RECORDS.value} to {path}.")


def write_docs(page_path: str) -> None:
  """The page's block from the study's records (its two sections' objects)."""
  from pipejax.analysis import price  # pylint: disable=import-outside-toplevel
  from pipejax.study import records  # pylint: disable=import-outside-toplevel
  _, tokens, timing = _budget_sections()
  try:
    with open(page_path) as f:
      page = f.read()
  except OSError as e:
    raise app.UsageError(str(e)) from e
  block = price.docs_section(tokens, timing, records.read_results(_RECORDS.value),
                             _RECORDS.value)
  try:
    files.write(page_path, price.render_docs(page, block))
  except price.PriceError as e:
    raise app.UsageError(f"{page_path}: {e}") from e
  print(f"Rewrote the generated block of {page_path}.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments {argv[1:]}: every setting is a --flag.")
  for name, flag in (("docs", _DOCS), ("token_tax", _TOKEN_TAX)):
    if flag.value:  # both outputs checked before either is written
      cli.check_output(name, flag.value)
  if _DOCS.value:
    write_docs(_DOCS.value)
  if _TOKEN_TAX.value:
    write_token_tax(_TOKEN_TAX.value)
  if _DOCS.value or _TOKEN_TAX.value:
    return
  if not _OUTPUT.value:
    raise app.UsageError("Give --output=PATH for the stage costs (JSON).")
  cli.check_output("output", _OUTPUT.value)
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from pipejax import methods, models  # pylint: disable=import-outside-toplevel
  from pipejax.schedules import measure  # pylint: disable=import-outside-toplevel
  model = models.build("transformer_lm", num_classes=256, width=_WIDTH.value,
                       blocks=_BLOCKS.value, heads=_HEADS.value, layers_per_stage=1)
  example = jnp.zeros((1, _CONTEXT.value), jnp.int32)
  layers = measure.layer_costs(model, example)
  method = methods.make_method(_METHOD.value, learning_rate=1e-3, momentum=0.9, b2=0.99,
                               optimizer="adam")
  updates = measure.update_costs(model, example, method.optimizer)
  description = (f"the transformer LM of {_BLOCKS.value} blocks of width {_WIDTH.value}, "
                 f"{len(layers)} stages, one sequence of {_CONTEXT.value} bytes; "
                 f"{_METHOD.value}'s update; FLOPs by XLA's cost analysis")
  data = {"description": description,
          "stages": [{"name": l.name, "forward": l.forward, "input_grad": l.input_grad,
                      "weight_grad": l.weight_grad, "update": u}
                     for l, u in zip(layers, updates)]}
  files.write(_OUTPUT.value, json.dumps(data, indent=1) + "\n")
  print(f"{len(layers)} stages; forward {sum(l.forward for l in layers):.3g}, backward "
        f"{sum(l.input_grad + l.weight_grad for l in layers):.3g}, updates {sum(updates):.3g} "
        f"FLOPs: {_OUTPUT.value}")


if __name__ == "__main__":
  cli.run(main)
