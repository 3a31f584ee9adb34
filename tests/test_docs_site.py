"""The documentation site builds cleanly, documents every public name, and its guide runs.

`mkdocs build --strict` turns every warning (a docstring griffe cannot parse, an Args name
that is not a parameter, a broken link) into a failure; the API reference must then carry a
heading for each name of ``opttx.__all__``, ``opttx.extend.__all__``,
``opttx.distributed.__all__`` and ``opttx.testing.__all__``, read at test time, so a new
public name without documentation fails here. The Python examples of the home page and the single-process guide pages run as written
(``docs/mapping.md`` runs in tests/test_docs.py).
"""

from __future__ import annotations

import importlib
import inspect
import os
import pathlib
import re
import subprocess
import sys
import types

import pytest

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCUMENTED_MODULES = ["opttx", "opttx.extend", "opttx.distributed", "opttx.testing"]
# pages whose examples run in one process (the distributed guide needs process groups)
RUNNABLE_PAGES = ["index.md", "guide/composing.md", "guide/compiled.md", "guide/writing.md"]


def needs_mkdocs() -> None:
    for module in ("mkdocs", "mkdocstrings", "material"):
        pytest.importorskip(module, reason=f"{module} is not installed (pip install -e '.[docs]')")

# the heading mkdocstrings writes for each documented object: its anchor and its kind
HEADING = re.compile(r'<h[1-6] id="(?P<id>[^"]+)" class="doc doc-heading">\s*'
                     r'<code class="doc-symbol doc-symbol-heading doc-symbol-(?P<kind>[\w-]+)">')


def public_names(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, obj in vars(module).items()
                 if not n.startswith("_") and inspect.isfunction(obj)
                 and obj.__module__ == module_name]
    return sorted(names)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> tuple[pathlib.Path, str]:
    needs_mkdocs()
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        # no --quiet: it lowers the log level below WARNING, and --strict counts only the
        # warnings logged, so a docstring griffe cannot parse passed unseen
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
         str(ROOT / "mkdocs.yml"), "-d", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{log}"
    return out, log


def test_site_builds_without_warnings(site) -> None:
    _, log = site
    problems = [line for line in log.splitlines() if re.search(r"WARNING|ERROR", line)]
    assert not problems, "\n".join(problems)


def test_every_public_name_is_documented(site) -> None:
    out, _ = site
    headings: dict[str, str] = {}
    for page in (out / "api").rglob("*.html"):
        for match in HEADING.finditer(page.read_text(encoding="utf-8")):
            headings[match["id"]] = match["kind"]
    assert headings, "the API reference has no mkdocstrings headings"
    missing = []
    for module_name in DOCUMENTED_MODULES:
        module = importlib.import_module(module_name)
        for name in public_names(module_name):
            is_module = inspect.ismodule(getattr(module, name))
            # documented where it is defined (opttx.chain is opttx.combine.chain) or re-exported
            found = [anchor for anchor, kind in headings.items()
                     if anchor.startswith("opttx.") and anchor.rsplit(".", 1)[-1] == name
                     and (kind == "module") == is_module]
            if not found:
                missing.append(f"{module_name}.{name}")
    assert not missing, (
        "public names without an entry in the API reference (add them to a page under "
        f"docs/api/): {missing}")


@pytest.mark.parametrize("name", RUNNABLE_PAGES)
def test_guide_examples_run(name: str, monkeypatch) -> None:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / name).read_text(), flags=re.S)
    assert blocks, f"{name} has no Python examples"
    # compiled steps are traced whole (fullgraph) but not lowered: Inductor on a shared CPU
    # takes a minute, and tests/test_compile.py covers the backends
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile",
                        lambda fn=None, **kw: compile_(fn, **{"backend": "eager", **kw}))
    # a real module: Dynamo looks a compiled function's globals up by its module's name
    module = types.ModuleType("docs_page_" + re.sub(r"\W", "_", name))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/{name}[block {i}]", "exec"), module.__dict__)


def test_a_new_transform_module_needs_no_page_edit(tmp_path) -> None:
    """docs/_ext/transform_modules.py: an exported module of ``opttx.transforms`` that no
    page under docs/api/ names (here: kron, its line removed) is added to api/transforms.md
    at build time; today every exported module is named by a page or added."""
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    try:
        import transform_modules
    finally:
        sys.path.remove(str(ROOT / "docs" / "_ext"))
    api = tmp_path / "api"
    api.mkdir()
    for page in (ROOT / "docs" / "api").glob("*.md"):
        text = page.read_text(encoding="utf-8").replace("::: opttx.transforms.kron\n", "")
        (api / page.name).write_text(text, encoding="utf-8")
    missing = transform_modules.unnamed_modules(api_dir=api)
    assert missing == ["kron"]
    page = transform_modules.add_unnamed_modules("# First-order transforms\n", missing)
    assert page.endswith("\n\n::: opttx.transforms.kron\n")
    exported = set(transform_modules.exported_modules())
    assert {"moments", "kron", "shampoo"} <= exported
    assert exported <= transform_modules.named_modules() | set(transform_modules.unnamed_modules())


def test_docstring_extension(tmp_path, caplog) -> None:
    """docs/_ext/rst_math.py: RST math becomes arithmatex, a grouped Args row split over two
    lines becomes one, and an Args name that is not a parameter is reported."""
    griffe = pytest.importorskip("griffe", reason="griffe is not installed (pip install -e '.[docs]')")
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    try:
        import rst_math
    finally:
        sys.path.remove(str(ROOT / "docs" / "_ext"))
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "__init__.py").write_text(
        'def f(a, b, c):\n'
        '    r"""Sum, :math:`a + b`.\n\n'
        '    .. math::\n'
        '        s = a + b + c\n\n'
        '    Args:\n'
        '      a, b,\n'
        '        c: the terms.\n'
        '      d: not a parameter.\n'
        '    """\n')
    with caplog.at_level("WARNING"):
        toy = griffe.load("toy", search_paths=[str(tmp_path)],
                          extensions=griffe.load_extensions(rst_math.RstMath()))
    text = toy["f"].docstring.value
    assert r"\(a + b\)" in text and "$$\ns = a + b + c\n$$" in text
    assert "  a, b, c: the terms." in text
    warnings = [r.getMessage() for r in caplog.records]
    assert any("'d' is not a parameter" in w for w in warnings), warnings
    assert not any(f"'{n}' is not" in w for w in warnings for n in "abc"), warnings
