"""A griffe extension for the API reference (mkdocs.yml loads it): the docstrings are Google style with a few
reST habits (Sphinx roles such as :func:`dump`, literal blocks after ``::``) that read well in the source and in
``help()``, but that Markdown would show raw. Before mkdocstrings renders a docstring, this rewrites

* ``:func:`x```, ``:class:`x```, ``:meth:`x``` ... into cross references: ``x`` is resolved in the scope of the
  object the docstring belongs to (as Sphinx would), and links to its entry when the reference renders it;
  targets it does not render (internal modules) stay plain code, never a broken link (autorefs' ``optional``);
* a paragraph ending in ``::`` followed by an indented block into a paragraph ending in ``:`` and a fenced
  Python block (``Example::`` into a Google ``Examples:`` section, whose ``>>>`` lines render as a session);
* an ``Args:`` entry that documents several parameters at once (``obj, backend, key: as for dump``) into one
  entry per parameter, so that each gets its row (and type) in the parameter table.

It also makes a package's name that an import shadows name the import (:func:`unshadow`).
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|exc|obj|const):`(?P<target>[^`]+)`")
PACKAGE = "zerocopy_pickle"


def resolve(obj: griffe.Object, target: str) -> str:
    """The full dotted path ``target`` names from ``obj``'s scope, as well as static analysis can tell."""
    if target.startswith((PACKAGE + ".", PACKAGE + "_quirks.")) or target in (PACKAGE, PACKAGE + "_quirks"):
        return target
    first, _, rest = target.partition(".")
    scope: griffe.Object | None = obj
    while scope is not None:
        try:
            base = scope.resolve(first)
        except (griffe.NameResolutionError, AttributeError, KeyError):
            scope = scope.parent
            continue
        return f"{base}.{rest}" if rest else base
    return target


def crossref(obj: griffe.Object, match: re.Match[str]) -> str:
    target = match["target"].strip()
    short = target.startswith("~")
    target = target.lstrip("~!")
    title = target.rsplit(".", 1)[-1] if short else target
    identifier = html.escape(resolve(obj, target), quote=True)
    return f'<autoref identifier="{identifier}" optional><code>{html.escape(title)}</code></autoref>'


def literal_blocks(text: str) -> str:
    """reST ``Intro::`` plus an indented block becomes ``Intro:`` plus a fenced block."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.rstrip().endswith("::"):
            out.append(line)
            i += 1
            continue
        indent = len(line) - len(line.lstrip())
        stripped = line.rstrip()[:-2].rstrip()
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        block_end = j
        while block_end < len(lines) and (
            not lines[block_end].strip() or len(lines[block_end]) - len(lines[block_end].lstrip()) > indent
        ):
            block_end += 1
        if j == i + 1 or j >= block_end:  # not a literal block: keep the line as written
            out.append(line)
            i += 1
            continue
        while block_end > j and not lines[block_end - 1].strip():
            block_end -= 1
        block = lines[j:block_end]
        if stripped.strip() in ("Example", "Examples"):  # reST-style "Example::": a Google Examples section
            out.append(f"{' ' * indent}Examples:")
            out.extend(lines[j:block_end])  # a Google section starts on the line after its title
            i = block_end
            continue
        inner = min(len(b) - len(b.lstrip()) for b in block if b.strip())
        pad = " " * indent
        if stripped:
            out.append(f"{stripped}:")
        out.append("")
        out.append(f"{pad}```python")
        out.extend(pad + b[inner:] if b.strip() else "" for b in block)
        out.append(f"{pad}```")
        i = block_end
    return "\n".join(out)


SECTION = re.compile(r"^(?P<indent> *)(?P<title>[A-Z][A-Za-z ]*):\s*$")
GROUPED = re.compile(r"^(?P<indent> +)(?P<names>\w+(?:, *\w+)+): (?P<text>.*)$")


def split_grouped_args(text: str) -> str:
    """``a, b: text`` in an ``Args:`` section becomes ``a: text`` and ``b: text`` (continuation lines too)."""
    lines = text.split("\n")
    out: list[str] = []
    in_args = False
    i = 0
    while i < len(lines):
        line = lines[i]
        section = SECTION.match(line)
        if section:
            in_args = section["title"] in ("Args", "Arguments", "Parameters")
        grouped = GROUPED.match(line) if in_args else None
        if grouped is None:
            out.append(line)
            i += 1
            continue
        indent = len(grouped["indent"])
        j = i + 1
        while j < len(lines) and lines[j].strip() and len(lines[j]) - len(lines[j].lstrip()) > indent:
            j += 1
        for name in grouped["names"].split(","):
            out.append(f"{grouped['indent']}{name.strip()}: {grouped['text']}")
            out.extend(lines[i + 1 : j])
        i = j
    return "\n".join(out)


def rewrite(obj: griffe.Object) -> None:
    docstring = obj.docstring
    if docstring is not None:
        value = split_grouped_args(literal_blocks(docstring.value))
        docstring.value = ROLE.sub(lambda match: crossref(obj, match), value)


def unshadow(module: griffe.Module) -> None:
    """A name a package imports over its submodule's name names the import, as at run time.

    A package that binds a name over a submodule of the same name (``from .x import y`` where ``y.py`` exists
    too) documents the bound object, not the submodule griffe would otherwise see. (The reducer table's module
    was once ``reducers.py``, under the top-level function ``reducers``; it is ``reducer_table.py`` now.)
    """
    for name, target in module.imports.items():
        member = module.members.get(name)
        if member is not None and not member.is_alias and member.is_module and target != member.path:
            module.set_member(name, griffe.Alias(name, target, parent=module))


class Roles(griffe.Extension):
    """Rewrite every docstring once the package is loaded (names resolve only then)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        unshadow(pkg)
        rewrite(pkg)  # griffe fires on_object for the package's members only

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if not obj.is_alias:
            rewrite(obj)
        if isinstance(obj, griffe.Module):
            unshadow(obj)
