"""The study tool: a grid of trainer runs, their records, and the report drawn from the records.

A study file (``configs/studies/*.py``) imports its spec from here; this loads without JAX, so
``scripts/study.py`` reads dozens of studies, and reports from their records, without it.
"""

from pipejax.study.spec import Figure, Section, Study, StudyError, Table

__all__ = ["Figure", "Section", "Study", "StudyError", "Table"]
