"""The report's figures: cell means and gaps, loss curves, and their axes."""

import dataclasses

import numpy as np
import pytest

from pipejax.study import spec as study_lib
from pipejax.study import figures as study_figures
from pipejax.study import records as study_records
from pipejax.study import report as study_report
from pipejax.study.spec import Study, Table

from tests.study.helpers import STUDY, loss_record, record, sectioned_study, write_records, changed


def test_figures_put_diverged_runs_in_a_band_of_their_own(tmp_path):
  from pipejax.study.spec import Figure  # pylint: disable=import-outside-toplevel
  records = [record("sgd", 4, 0, 0.9), record("sgd", 8, 0, 0.9), record("pb", 4, 0, 0.8),
             record("pb", 8, 0, None, study_records.DIVERGED), record("pb", 8, 1, 0.7)]
  figure = Figure("f.png", x="model_kwargs.depth", series="method", title="Accuracy by depth")
  series = dict((s, (points, failed)) for s, points, failed in
                study_figures.cell_points(STUDY, records, figure))
  assert series["pb"] == ([(4, 80.0, 0.0), (8, 70.0, 0.0)], [(8, "1/2")])
  assert study_figures.draw_figure(STUDY, records, figure, str(tmp_path / "f.png"))
  assert (tmp_path / "f.png").stat().st_size > 1000


BITS = 1 / np.log(2)  # a loss in nats drawn in bits


def drawn_figure(study, records, figure, path, monkeypatch):
  """Draws ``figure`` and returns the matplotlib figure it saved, to read its axes."""
  saved, real_save = [], study_figures.plotting.save
  monkeypatch.setattr(study_figures.plotting, "save",
                      lambda fig, p: (saved.append(fig), real_save(fig, p)))
  assert study_figures.draw_figure(study, records, figure, str(path))
  (fig,) = saved
  return fig


def test_a_loss_gap_figure_draws_method_minus_baseline_paired_by_seed(tmp_path, monkeypatch):
  from pipejax.study.spec import Figure  # pylint: disable=import-outside-toplevel
  losses = {("sgd", 4): (1.90, 1.95, 1.92), ("pb", 4): (1.88, 1.96, 1.90),
            ("sgd", 8): (2.00, 2.10, 2.05), ("pb", 8): (2.03, 2.11, 2.09)}
  records = [loss_record(m, d, s, v) for (m, d), values in losses.items()
             for s, v in enumerate(values)]
  figure = Figure("gap.png", x="model_kwargs.depth", series="method", kind="gap",
                  metric="test_loss", scale=BITS, unit="bits per byte")
  ((series, points, failed),) = study_figures.cell_points(STUDY, records, figure)
  assert series == "pb" and failed == []
  for (x, mean, half), depth in zip(points, (4, 8)):
    gaps = np.subtract(losses[("pb", depth)], losses[("sgd", depth)])  # method - baseline
    # 95% paired interval at n = 3: t(0.975, 2) = 4.3027 from the printed table.
    assert x == depth
    assert mean == pytest.approx(gaps.mean() * BITS)
    assert half == pytest.approx(4.3027 * gaps.std(ddof=1) / np.sqrt(3) * BITS, rel=1e-4)
  assert points[1][1] > 0  # pb's loss is higher at 8 stages: a positive gap, the worse one
  # The table of the same gap shows the same number, with the same sign.
  table = Table("gap", rows="model_kwargs.depth", columns="method", kind="gap",
                metric="test_loss", scale=BITS)
  row = study_report.markdown_table(STUDY, records, table).splitlines()[3]
  assert row.startswith(f"| 8 | baseline | +{points[1][1]:.2f} [")
  fig = drawn_figure(STUDY, records, figure, tmp_path / "gap.png", monkeypatch)
  assert fig.axes[0].get_ylabel() == "test loss gap to SGD (bits per byte; lower is better)"
  (errorbar,) = fig.axes[0].containers  # the pb series: its line of means
  assert list(errorbar.lines[0].get_ydata()) == pytest.approx([mean for _, mean, _ in points])


def _curve_record(method, seed, curve):
  return changed(record(method, 8, seed, curve[-1][1]), test_curve=curve, test_loss=curve[-1][2],
                 initial_test_loss=5.0)


CURVE_SAMPLES = (400, 1200, 2000, 2800, 3600, 4000)


def _curves_records():
  """Two seeds of two methods whose accuracy and loss curves differ: a loss read from the
  accuracy's column, or an accuracy from the loss's, gives other numbers."""
  accuracy = (0.30, 0.60, 0.70, 0.72, 0.74, 0.75)
  loss = (4.0, 2.5, 2.0, 1.8, 1.7, 1.65)
  records = []
  for m, shift in (("sgd", 0.0), ("pb", 0.05)):
    for seed in (0, 1):
      records.append(_curve_record(m, seed, [
          [n, a - shift / 10 + seed / 100, l + shift + seed / 100]
          for n, a, l in zip(CURVE_SAMPLES, accuracy, loss)]))
  return records


def test_loss_curves_read_the_loss_column_times_the_scale_and_zoom_on_it(tmp_path, monkeypatch):
  from pipejax.study.spec import Figure  # pylint: disable=import-outside-toplevel
  records = _curves_records()
  figure = Figure("c.png", x="samples", series="method", kind="curves", metric="test_loss",
                  scale=BITS, unit="bits per byte", where=(("model_kwargs.depth", 8),))
  fig = drawn_figure(STUDY, records, figure, tmp_path / "c.png", monkeypatch)
  ax, zoom = fig.axes
  assert ax.get_ylabel() == "test loss (bits per byte)"
  sgd = [(a[2] + b[2]) / 2 * BITS for a, b in zip(records[0].test_curve,
                                                  records[1].test_curve)]
  assert list(ax.lines[0].get_xdata()) == list(CURVE_SAMPLES)
  assert list(ax.lines[0].get_ydata()) == pytest.approx(sgd)
  # The zoom holds the last three quarters (from 1000 samples) and leaves out the first loss.
  tail = [v for line in zoom.lines for x, v in zip(line.get_xdata(), line.get_ydata())
          if x >= 1000]
  low, high = zoom.get_ylim()
  assert low < min(tail) and max(tail) < high < 4.0 * BITS
  assert zoom.get_xlim()[0] == pytest.approx(1000)
  accuracy = Figure("a.png", x="samples", series="method", kind="curves",
                    where=(("model_kwargs.depth", 8),))
  fig = drawn_figure(STUDY, records, accuracy, tmp_path / "a.png", monkeypatch)
  assert list(fig.axes[0].lines[0].get_ydata()) == pytest.approx(
      [(a[1] + b[1]) / 2 * 100 for a, b in zip(records[0].test_curve, records[1].test_curve)])
  with pytest.raises(study_lib.StudyError, match="curves are recorded of test_accuracy and"):
    Study(name="t", config="c.py", grids=[], figures=[
        dataclasses.replace(accuracy, metric="samples_to:0.7")])


def test_the_axes_of_accuracy_figures_read_as_before(tmp_path, monkeypatch):
  from pipejax.study.spec import Figure  # pylint: disable=import-outside-toplevel
  records = [record(m, d, s, 0.8 + s / 100 + (m == "pb") / 50)
             for m in ("sgd", "pb") for d in (4, 8) for s in range(3)]
  mean = Figure("m.png", x="model_kwargs.depth", series="method", threshold=0.7)
  fig = drawn_figure(STUDY, records, mean, tmp_path / "m.png", monkeypatch)
  assert fig.axes[0].get_ylabel() == "test accuracy (%)"
  assert "threshold 70%" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
  gap = Figure("g.png", x="model_kwargs.depth", series="method", kind="gap")
  fig = drawn_figure(STUDY, records, gap, tmp_path / "g.png", monkeypatch)
  assert fig.axes[0].get_ylabel() == "test accuracy gap to SGD (points)"
  assert study_figures.cell_points(STUDY, records, gap)[0][1][0][1] == pytest.approx(2.0)
  curves = Figure("c.png", x="samples", series="method", kind="curves",
                  where=(("model_kwargs.depth", 8),))
  fig = drawn_figure(STUDY, _curves_records(), curves, tmp_path / "c.png", monkeypatch)
  assert fig.axes[0].get_ylabel() == "test accuracy (%)"


def test_labels_of_any_script_draw_without_glyph_warnings(tmp_path, caplog):
  """'β₁ − 0.9' is drawn as it is (DejaVu Sans has it); characters no installed font has are
  drawn as '?' and named once in the log, never as empty boxes with a warning each."""
  import warnings  # pylint: disable=import-outside-toplevel
  from pipejax import plotting  # pylint: disable=import-outside-toplevel
  write_records(tmp_path)
  study = dataclasses.replace(sectioned_study(), labels={"pb": "β₁ − 0.9", "sgd": "学習率"})
  drawn = []
  real_save = plotting.save

  def save_and_keep(fig, path, **kwargs):
    real_save(fig, path, **kwargs)
    drawn.extend(t.get_text() for t in fig.axes[0].get_legend().get_texts())

  with warnings.catch_warnings(record=True) as caught, caplog.at_level("WARNING"):
    warnings.simplefilter("always")
    with pytest.MonkeyPatch.context() as patch:
      patch.setattr(study_figures.plotting, "save", save_and_keep)
      for _ in range(2):
        study_report.write_report(study, str(tmp_path))
  assert [str(w.message) for w in caught] == []
  cjk = all(plotting._font_with(c) for c in "学習率")  # pylint: disable=protected-access
  assert drawn[:2] == ["学習率" if cjk else "???", "β₁ − 0.9"]
  named = [r for r in caplog.records if "no installed font has" in r.getMessage()]
  assert len(named) == (0 if cjk else 1)
