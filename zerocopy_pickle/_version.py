"""Internal: the version, written only here (pyproject.toml reads it: ``[tool.setuptools.dynamic]``)."""

__version__ = "0.1.0.dev0"
