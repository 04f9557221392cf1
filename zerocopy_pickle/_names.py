"""Internal: ``"module:qualname"``, the one way the library writes a global's name (``allow=`` strings, reducer
targets, safe globals, patch points, plugin factories, the cache's calls), parsed, formatted and resolved in one
place.

Each caller keeps its own rule on top of the form (a safe global must be a module-level function, a patch point
dotted identifiers) and its own error message, which says what that caller expected."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from .errors import MissingGlobalError


@dataclass(frozen=True, order=True)
class GlobalName:
    """A global's module and its qualified name in it; ``str()`` gives ``"module:qualname"``."""

    module: str
    qualname: str

    @classmethod
    def parse(cls, text: object) -> GlobalName | None:
        """``"module:qualname"`` as a name; None unless ``text`` is a string with exactly one colon and something
        on both sides of it."""
        if not isinstance(text, str):
            return None
        module, sep, qualname = text.partition(":")
        if not sep or not module or not qualname or ":" in qualname:
            return None
        return cls(module, qualname)

    @classmethod
    def of(cls, obj: object) -> GlobalName | None:
        """The name ``obj`` gives itself (``__module__`` and ``__qualname__``); None where either is not a
        string."""
        module = getattr(obj, "__module__", None)
        qualname = getattr(obj, "__qualname__", None)
        if not isinstance(module, str) or not isinstance(qualname, str):
            return None
        return cls(module, qualname)

    def __str__(self) -> str:
        return f"{self.module}:{self.qualname}"

    @property
    def pair(self) -> tuple[str, str]:
        """``(module, qualname)``, the form the stream analysis and the allow-lists key on."""
        return (self.module, self.qualname)

    @property
    def dotted(self) -> bool:
        """Whether both sides are dotted identifiers (``a.b:C.d``)."""
        return all(part.isidentifier() for side in (self.module, self.qualname) for part in side.split("."))

    def lookup(self) -> Any:
        """Import the module and walk the qualified name's attributes; the import's or the walk's own error
        (``ImportError``, ``AttributeError``) if either fails. Runs the module's code if it was not imported."""
        obj: Any = importlib.import_module(self.module)
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return obj

    def missing(self, error: BaseException) -> MissingGlobalError:
        """The one error for a global a stream names that cannot be imported here (raise it ``from error``)."""
        return MissingGlobalError(
            f"the stream needs {self}, which cannot be imported here ({error}); install the package that defines it",
            module=self.module,
            qualname=self.qualname,
        )

    def resolve(self) -> Any:
        """:meth:`lookup`, a failure raised as :class:`MissingGlobalError` (:meth:`missing`)."""
        try:
            return self.lookup()
        except (ImportError, AttributeError) as e:
            raise self.missing(e) from e
