"""MkDocs hooks (mkdocs.yml ``hooks:``).

The pages link to files of the repository outside ``docs/`` (``../benchmarks/cache.py``, ``../CHANGELOG.md``)
with relative links, which GitHub renders as they are. The site contains only ``docs/``, so MkDocs would report
those links as broken: this rewrites each one into the file's page on the repository (``repo_url``), and fails
the build (a warning, an error under ``--strict``) when the file does not exist in the checkout.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.repo_links")

# An inline link or image target, ``[text](target "title")``, and a reference definition, ``[id]: target``.
INLINE = re.compile(r"(?P<head>\]\()(?P<target>[^)\s]+)(?P<tail>(?:\s+\"[^\"]*\")?\))")
DEFINITION = re.compile(r"^(?P<head> {0,3}\[[^\]]+\]:\s*)(?P<target>\S+)(?P<tail>.*)$", re.MULTILINE)
FENCE = re.compile(r"^ {0,3}(```|~~~)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def on_page_markdown(markdown: str, *, page: Any, config: Any, files: Any, **kwargs: Any) -> str:
    docs_dir = Path(config["docs_dir"]).resolve()
    root = docs_dir.parent
    repo_url = (config.get("repo_url") or "").rstrip("/")
    page_dir = (docs_dir / page.file.src_uri).parent

    def rewrite(match: re.Match[str]) -> str:
        target = match["target"]
        if SCHEME.match(target) or target.startswith(("#", "/", "<")):
            return match[0]
        path, _, anchor = target.partition("#")
        resolved = (page_dir / path).resolve()
        if resolved == docs_dir or docs_dir in resolved.parents:
            return match[0]  # a page or file of the site: MkDocs checks it
        if root not in resolved.parents:
            log.warning("%s: link %r leaves the repository", page.file.src_uri, target)
            return match[0]
        if not resolved.exists():
            log.warning("%s: link %r names a file that does not exist", page.file.src_uri, target)
            return match[0]
        relative = posixpath.join(*resolved.relative_to(root).parts)
        kind = "tree" if resolved.is_dir() else "blob"
        url = f"{repo_url}/{kind}/main/{relative}" + (f"#{anchor}" if anchor else "")
        return f"{match['head']}{url}{match['tail']}"

    out: list[str] = []
    fenced: str | None = None
    for line in markdown.split("\n"):
        fence = FENCE.match(line)
        if fenced is not None:
            if fence and fence.group(1) == fenced:
                fenced = None
            out.append(line)
            continue
        if fence:
            fenced = fence.group(1)
            out.append(line)
            continue
        out.append(INLINE.sub(rewrite, DEFINITION.sub(rewrite, line)))
    return "\n".join(out)
