"""The one exception type of :mod:`pipejax.data`."""


class DataError(ValueError):
  """A data set is missing, damaged or asked for in a way we cannot serve.

  The message is one paragraph that names the data set or file and says how to fix it (which
  package to install, which ``data_dir`` to point at, how to build a tfds data set).
  """
