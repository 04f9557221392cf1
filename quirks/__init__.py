"""zerocopy_pickle's built-in quirks: plugins for objects plain pickle cannot take, or takes slowly.

Each module registers through the ``zerocopy_pickle.plugins`` entry-point group (see this distribution's
``pyproject.toml``), exactly as a third-party plugin would, and imports its target library only when an object
of that library is pickled or loaded. ``docs/quirks.md`` describes what each one handles and its limits.
"""
