"""MkDocs hook for the docs site: document every exported module of ``opttx.transforms``.

The API pages name the transform modules by family, with prose (``::: opttx.transforms.moments``
on docs/api/transforms.md, ``::: opttx.transforms.shampoo`` on docs/api/shampoo.md, ...). A
module that ``opttx/transforms/__init__.py`` exports names from, but that no page under
docs/api/ names in a ``::: opttx.transforms.<module>`` line, is added at the end of
docs/api/transforms.md at build time, so a new transform module needs no edit of the pages
(tests/test_docs_site.py checks that every public name has an entry). Modules whose names
are not exported (helpers shared by the transforms) are left out, as the pages leave them.
Both lists are read from the sources (no import of opttx).
"""

from __future__ import annotations

import ast
import pathlib
import re
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = "api/transforms.md"
"""The page that receives the modules no page names."""
_NAMED = re.compile(r"^:::[ \t]+opttx\.transforms\.(?P<module>\w+)[ \t]*$", re.M)


def exported_modules(init: pathlib.Path = ROOT / "opttx" / "transforms" / "__init__.py"
                     ) -> list[str]:
    """The submodules ``opttx/transforms/__init__.py`` imports public names from."""
    tree = ast.parse(init.read_text(encoding="utf-8"))
    return sorted({node.module for node in tree.body
                   if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
                   and any(not a.name.startswith("_") for a in node.names)})


def named_modules(api_dir: pathlib.Path = ROOT / "docs" / "api") -> set[str]:
    """The ``opttx.transforms`` modules some page under ``api_dir`` documents by name."""
    return {m["module"] for page in api_dir.glob("*.md")
            for m in _NAMED.finditer(page.read_text(encoding="utf-8"))}


def unnamed_modules(init: pathlib.Path = ROOT / "opttx" / "transforms" / "__init__.py",
                    api_dir: pathlib.Path = ROOT / "docs" / "api") -> list[str]:
    """The exported transform modules no API page names."""
    named = named_modules(api_dir)
    return [m for m in exported_modules(init) if m not in named]


def add_unnamed_modules(markdown: str, modules: list[str]) -> str:
    """``markdown`` with one ``::: opttx.transforms.<module>`` block per module."""
    if not modules:
        return markdown
    blocks = "\n\n".join(f"::: opttx.transforms.{m}" for m in modules)
    return f"{markdown.rstrip()}\n\n{blocks}\n"


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    return add_unnamed_modules(markdown, unnamed_modules())
