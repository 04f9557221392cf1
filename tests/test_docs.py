"""The documentation site (mkdocs.yml) builds with ``--strict``, its API reference renders the public API, every
page is in its nav, and the examples in the public docstrings run as written."""

from __future__ import annotations

import doctest
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("mkdocs")
pytest.importorskip("material")
pytest.importorskip("mkdocstrings_handlers.python")
yaml = pytest.importorskip("yaml")  # mkdocs depends on PyYAML

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return out


def nav_pages(nav: object) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in nav_pages(value)]
    raise AssertionError(f"unexpected nav entry {nav!r}")


def config() -> dict[str, object]:
    # mkdocs.yml uses no custom tags: a safe load reads it whole.
    loaded = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert isinstance(loaded, dict)
    return loaded


def test_every_page_is_in_the_nav_and_every_nav_entry_exists() -> None:
    pages = nav_pages(config()["nav"])
    on_disk = sorted(path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md"))
    assert sorted(set(pages)) == on_disk
    assert len(pages) == len(set(pages)), "a page is listed twice"
    assert {"index.md", "quickstart.md", "api/zerocopy_pickle.md", "security.md", "changelog.md"} <= set(pages)


def built_path(site: Path, page: str) -> Path:
    """Where ``page`` lands with directory URLs: ``usage.md`` -> ``usage/index.html``, ``api/index.md`` ->
    ``api/index.html``."""
    stem = page.removesuffix(".md")
    folder = stem.removesuffix("index") if stem == "index" or stem.endswith("/index") else stem + "/"
    return site / folder / "index.html"


@pytest.mark.slow
def test_site_builds_strict_with_every_page(site: Path) -> None:
    for page in nav_pages(config()["nav"]):
        assert built_path(site, page).is_file(), page


def html(site: Path, page: str) -> str:
    return (site / page / "index.html").read_text()


def test_top_level_api_page_renders_the_public_functions(site: Path) -> None:
    page = html(site, "api/zerocopy_pickle")
    for name in ("dump", "load", "dumps", "loads", "freeze", "Snapshot", "scan", "read_header", "to_device",
                 "allow_function", "register_reducer", "ZeroCopyPickler", "ZeroCopyUnpickler"):  # fmt: skip
        assert f'id="zerocopy_pickle.{name}"' in page, name
    # Signatures, with their parameters: dump(obj, f, ...), load(f, ..., map_location, trusted, allow, ...).
    text = re.sub(r"<[^>]+>", "", page)
    assert re.search(r"dump\(\s*obj: object,\s*f: ", text)
    assert re.search(r"load\(\s*f: .*?map_location.*?trusted.*?allow", text, re.DOTALL)
    # zerocopy_pickle.reducers is the function (the reducer table's module is reducer_table.py, not reducers.py).
    assert 'id="zerocopy_pickle.reducers"' in page
    assert "zerocopy_pickle.reducers.ReducerTable" not in page
    # The examples render as code.
    assert 'zp.dump({"weight": torch.ones(2, 3), "step": 10}, "weights.zcp")' in text.replace("&quot;", '"')


@pytest.mark.parametrize(
    ("page", "names"),
    [
        (
            "api/cache",
            ["zerocopy_pickle.cache.patch_all", "zerocopy_pickle.cache.status", "zerocopy_pickle.cache.Client"],
        ),
        ("api/multiprocessing", ["zerocopy_pickle.multiprocessing.Shared", "zerocopy_pickle.multiprocessing.register"]),
        ("api/ray", ["zerocopy_pickle.ray.Frozen", "zerocopy_pickle.ray.register"]),
        ("api/plugin", ["zerocopy_pickle.plugin.Registrar", "zerocopy_pickle.plugin.check_safe_global"]),
        (
            "api/native",
            ["zerocopy_pickle.native.backend", "zerocopy_pickle.native.status", "zerocopy_pickle.native.build"],
        ),
        ("api/errors", ["zerocopy_pickle.errors.ZeroCopyPickleError", "zerocopy_pickle.errors.RestrictedLoadError"]),
        ("api/testing", ["zerocopy_pickle.testing.ReducerConformance"]),
        ("api/validate", ["zerocopy_pickle.validate.expect_tensor"]),
    ],
)
def test_api_pages_render_their_module(site: Path, page: str, names: list[str]) -> None:
    content = html(site, page)
    for name in names:
        assert f'id="{name}"' in content, name


def test_no_raw_rest_in_the_api_reference(site: Path) -> None:
    """Sphinx roles and ``::`` literal markers of the docstrings are rewritten (docs/griffe_roles.py)."""
    for path in (site / "api").rglob("*.html"):
        text = re.sub(r"<[^>]+>", "", path.read_text())
        assert not re.search(r":(func|class|mod|meth|attr|data|exc):", text), path
        assert not re.search(r"\w::\s*$", text, re.MULTILINE), path
    # A role naming a rendered object becomes a link to it: dumps' docstring says "the same bytes :func:`dump`".
    assert 'href="#zerocopy_pickle.dump"' in html(site, "api/zerocopy_pickle")


def test_links_to_repository_files_become_repository_urls(tmp_path: Path) -> None:
    """docs/hooks.py: a link that leaves docs/ points at the file on the repository (GitHub renders the relative
    link; the site has no such page)."""
    sys.path.insert(0, str(DOCS))
    try:
        hooks = importlib.import_module("hooks")
    finally:
        sys.path.remove(str(DOCS))
    page = SimpleNamespace(file=SimpleNamespace(src_uri="guide/page.md"))
    conf = {"docs_dir": str(DOCS), "repo_url": "https://example.org/repo/"}
    markdown = (
        "See [the changelog](../../CHANGELOG.md#unreleased), [usage](../usage.md), [web](https://x.org/a.md),\n"
        "[csrc](../../csrc/) and ![plot](../benchmark.png).\n"
        "```\n[not a link](../../CHANGELOG.md)\n```\n"
        "[ref]: ../../pyproject.toml\n"
    )
    out = hooks.on_page_markdown(markdown, page=page, config=conf, files=None)
    assert "(https://example.org/repo/blob/main/CHANGELOG.md#unreleased)" in out
    assert "(https://example.org/repo/tree/main/csrc)" in out
    assert "[ref]: https://example.org/repo/blob/main/pyproject.toml" in out
    assert "[usage](../usage.md)" in out and "(../benchmark.png)" in out and "(https://x.org/a.md)" in out
    assert "[not a link](../../CHANGELOG.md)" in out  # code stays as written


def test_missing_repository_file_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    """A warning, so an error under --strict."""
    sys.path.insert(0, str(DOCS))
    try:
        hooks = importlib.import_module("hooks")
    finally:
        sys.path.remove(str(DOCS))
    page = SimpleNamespace(file=SimpleNamespace(src_uri="page.md"))
    conf = {"docs_dir": str(DOCS), "repo_url": "https://example.org/repo"}
    with caplog.at_level("WARNING", logger="mkdocs.hooks.repo_links"):
        out = hooks.on_page_markdown("[x](../does-not-exist.md)", page=page, config=conf, files=None)
    assert out == "[x](../does-not-exist.md)"
    assert "does not exist" in caplog.text


# The public modules whose docstrings carry runnable (doctest) examples; the others show code that needs a
# server, a Ray cluster or a compiler, as fenced blocks.
DOCTEST_MODULES = [
    "zerocopy_pickle._core.snapshot",
    "zerocopy_pickle._devices.transfer",
    "zerocopy_pickle._core.pickler",
    "zerocopy_pickle.multiprocessing",
    "zerocopy_pickle.native",
]


@pytest.mark.parametrize("module_name", DOCTEST_MODULES)
def test_docstring_examples_run(module_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the examples write their snapshots into the current directory
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = [test for test in finder.find(module, module_name) if test.examples]
    assert tests, f"{module_name} has no examples"
    for test in tests:
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, f"{results.failed} of {results.attempted} examples failed in {module_name}"


def _backticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_design_md_layer_table_is_the_import_contract_and_places_every_module() -> None:
    """docs/design.md's table of layers and ``[tool.importlinter]``'s layers contract are the same list, and every
    module and package of ``zerocopy_pickle/`` is in exactly one layer (the contract alone would leave a module it
    does not name unconstrained)."""
    import tomllib

    contract = next(
        c
        for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
        if c["type"] == "layers" and c["containers"] == ["zerocopy_pickle"]
    )
    declared = [sorted(name.strip() for name in layer.split("|")) for layer in contract["layers"]]
    section = (DOCS / "design.md").read_text().split("## Modules and layers", 1)[1].split("\n## ", 1)[0]
    section = section.split("### The wings", 1)[0]  # the root's table; each wing's is checked below
    table = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].isdigit():
            table[int(cells[0])] = sorted(name.removesuffix(".py").removesuffix("/") for name in _backticked(cells[1]))
    assert [table[number] for number in sorted(table, reverse=True)] == declared
    assert sorted(table) == list(range(1, len(declared) + 1))
    placed = [name for layer in declared for name in layer]
    package = ROOT / "zerocopy_pickle"
    present = sorted(
        [p.stem for p in package.glob("*.py") if p.stem != "__init__"]
        + [p.name for p in package.iterdir() if (p / "__init__.py").is_file()]
    )
    assert sorted(placed) == present, "every module of zerocopy_pickle/ in one layer of the contract"


def _layer_table(text: str) -> dict[int, list[str]]:
    table = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].isdigit():
            table[int(cells[0])] = sorted(name.removesuffix(".py") for name in _backticked(cells[1]))
    return table


def test_design_md_tables_each_wing_as_its_contract_does() -> None:
    """Each private package (a wing) has a layers contract of its own, and docs/design.md a table after the line
    that starts with its name; the two agree, and every module of the wing is in one layer."""
    import tomllib

    contracts = {
        c["containers"][0].removeprefix("zerocopy_pickle."): c["layers"]
        for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
        if c["type"] == "layers" and c["containers"][0].startswith("zerocopy_pickle._")
    }
    wings = sorted(p.name for p in (ROOT / "zerocopy_pickle").glob("_*/__init__.py") for p in [p.parent])
    assert sorted(contracts) == [w for w in wings if w != "_csrc"], "a layers contract for every wing"
    design = (DOCS / "design.md").read_text()
    for wing, layers in contracts.items():
        after = design.split(f"\n`{wing}/`, ", 1)
        assert len(after) == 2, f"docs/design.md has no table for {wing}/"
        table_text = after[1].split("\n\n", 2)[1]
        table = _layer_table(table_text)
        declared = [sorted(name.strip() for name in layer.split("|")) for layer in layers]
        assert [table[n] for n in sorted(table, reverse=True)] == declared, wing
        present = sorted(p.stem for p in (ROOT / "zerocopy_pickle" / wing).glob("*.py") if p.stem != "__init__")
        assert sorted(name for layer in declared for name in layer) == present, wing


def test_contributing_md_names_every_test_file_once() -> None:
    """docs/contributing.md's table of where the tests are names each ``tests/test_*.py`` exactly once, and only
    files that exist."""
    text = (DOCS / "contributing.md").read_text()
    section = text.split("## Where the tests of a module are", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    named = [name for row in rows for name in _backticked(row.split("|")[3]) if re.fullmatch(r"test_\w+\.py", name)]
    on_disk = sorted(p.name for p in (ROOT / "tests").glob("test_*.py"))
    assert sorted(named) == on_disk
    assert len(named) == len(set(named))


def test_usage_md_tables_every_environment_variable_the_code_reads() -> None:
    """docs/usage.md's table of environment variables is the one list: every ``ZEROCOPY_PICKLE_*`` name written in
    the library, the quirks or the suite's conftest and zygote is in it, and it names nothing the code does not."""
    in_code = set()
    for path in [
        *(ROOT / "zerocopy_pickle").rglob("*.py"),
        *(ROOT / "quirks").rglob("*.py"),
        ROOT / "tests" / "conftest.py",
        ROOT / "tests" / "zygote.py",
    ]:
        in_code |= set(re.findall(r"\bZEROCOPY_PICKLE_[A-Z_]*[A-Z]\b", path.read_text()))
    section = (DOCS / "usage.md").read_text().split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    tabled = [m for line in section.splitlines() if (m := re.match(r"\| `(ZEROCOPY_PICKLE_[A-Z_]+)` \|", line))]
    names = [m[1] for m in tabled]
    assert len(names) == len(set(names))
    assert set(names) == in_code
