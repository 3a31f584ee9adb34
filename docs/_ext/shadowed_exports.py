"""MkDocs hook for the docs site: list the exports that griffe files under a submodule.

A package that re-exports a function from the submodule of the same name
(``from .sharded import sharded`` in ``opttx/distributed/__init__.py``) binds the name to the
function at runtime, but griffe, which reads the sources for mkdocstrings, keeps the submodule
under that name (mkdocstrings/griffe#124), so ``::: opttx.distributed`` would leave the
function out. After every ``::: package`` block of a page this hook adds one block per such
export, documenting the function where it is defined (``::: opttx.distributed.sharded.sharded``),
one heading level below the package. The list is read from the package's ``__init__.py`` at
build time, so a new export of this kind needs no edit of the page.
"""

from __future__ import annotations

import ast
import pathlib
import re
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
_DIRECTIVE = re.compile(r"^:::[ \t]+(?P<path>[\w.]+)[ \t]*$")
_HEADING_LEVEL = re.compile(r"^[ \t]+heading_level:[ \t]*(?P<level>\d+)[ \t]*$")


def shadowed_exports(package: str) -> list[str]:
    """Names of ``package.__all__`` imported from the submodule of the same name."""
    init = ROOT.joinpath(*package.split("."), "__init__.py")
    if not init.is_file():
        return []
    tree = ast.parse(init.read_text(encoding="utf-8"))
    exported: list[str] = []
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                 for t in node.targets)):
            exported = [e.value for e in getattr(node.value, "elts", [])
                        if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    found = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            for alias in node.names:
                name = alias.asname or alias.name
                if name == node.module == alias.name and name in exported:
                    found.append(name)
    return sorted(found)


def add_shadowed_exports(markdown: str) -> str:
    lines = markdown.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = _DIRECTIVE.match(lines[i])
        out.append(lines[i])
        i += 1
        if match is None:
            continue
        level, members_off = 2, False
        while i < len(lines) and lines[i].strip() and lines[i][:1] in " \t":   # its options
            heading = _HEADING_LEVEL.match(lines[i])
            if heading:
                level = int(heading.group("level"))
            members_off = members_off or re.match(r"^\s+members:\s*false\s*$", lines[i]) is not None
            out.append(lines[i])
            i += 1
        if members_off:
            continue
        package = match.group("path")
        for name in shadowed_exports(package):
            out += ["", f"::: {package}.{name}.{name}", "    options:",
                    f"      heading_level: {level + 1}"]
    return "\n".join(out)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return add_shadowed_exports(markdown)
