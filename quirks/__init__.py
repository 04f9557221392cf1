"""zerocopy_pickle's built-in quirks: plugins for objects plain pickle cannot take, or takes slowly.

How this folder installs and imports: ``quirks/`` is the distribution's second top-level package. Its import
name is ``zerocopy_pickle_quirks``, not ``quirks``: ``pyproject.toml`` maps it with
``[tool.setuptools.package-dir] zerocopy_pickle_quirks = "quirks"``, so ``pip install zerocopy-pickle`` (or an
editable install) installs this folder as ``zerocopy_pickle_quirks`` (``import zerocopy_pickle_quirks.bnb``).
Nothing imports ``quirks`` by its folder name; a checkout needs an install (``make setup``, an editable
``pip install -e .``) for the name to exist.

Each module registers through the ``zerocopy_pickle.plugins`` entry-point group (``pyproject.toml``,
``[project.entry-points."zerocopy_pickle.plugins"]``), exactly as a third-party plugin would: it imports only the
public plugin API, :mod:`zerocopy_pickle.plugin` (an import-linter contract in ``pyproject.toml`` enforces it),
and imports its target library only when an object of that library is pickled or loaded. ``docs/quirks.md``
describes what each one handles and its limits.
"""
