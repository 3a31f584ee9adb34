"""Griffe extension for the docs site: read opttx's docstrings as they are written.

opttx's docstrings are Google style with three habits that griffe's Google parser does not
know, handled here before the docstrings are parsed (only the docs change, never the package):

* RST math. ``:math:`x``` becomes arithmatex's inline ``\\(x\\)``, and a ``.. math::``
  directive with its indented body becomes a ``$$ ... $$`` block at the directive's
  indentation (so it stays inside the section it belongs to); pymdownx.arithmatex and MathJax
  render both.
* Grouped arguments, ``b1, b2, eps: as in `adam```. They stay one row of the Args table.
  An item whose list of names runs onto a second line is joined into one line, so the
  parser finds its ``name: description`` pair.
* Because griffe would report a grouped row as an unknown parameter, mkdocs.yml turns off its
  ``warn_unknown_params`` and this extension checks instead: every name of every Args row
  must be a parameter of the documented function (or of the class's ``__init__``), else it
  logs a warning, which fails the strict build.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_INLINE = re.compile(r":math:`(.+?)`", flags=re.S)
_DIRECTIVE = re.compile(r"^(?P<indent>[ \t]*)\.\. math::[ \t]*(?P<rest>.*)$")
_SECTION = re.compile(r"^(?P<indent>[ \t]*)(?:Args|Arguments|Parameters|Params):[ \t]*$")
_NAMES = r"\**[A-Za-z_]\w*(?:,[ \t]*\**[A-Za-z_]\w*)*"
_OPEN_GROUP = re.compile(rf"^[ \t]*{_NAMES},[ \t]*$")          # "a, b, c," and nothing else
_ITEM = re.compile(rf"^[ \t]*(?P<names>{_NAMES})[ \t]*(?:\([^)]*\))?[ \t]*:")


def _indent_of(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def math_blocks(text: str) -> str:
    """``text`` with every ``.. math::`` directive rewritten as a ``$$`` block."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = _DIRECTIVE.match(lines[i])
        if match is None:
            out.append(lines[i])
            i += 1
            continue
        indent = match.group("indent")
        body = [match.group("rest")] if match.group("rest").strip() else []
        i += 1
        while i < len(lines) and (not lines[i].strip() or _indent_of(lines[i]) > len(indent)):
            body.append(lines[i])
            i += 1
        while body and not body[-1].strip():    # trailing blank lines belong to what follows
            body.pop()
            i -= 1
        if out and out[-1].strip():
            out.append("")
        out.append(indent + "$$")
        out.extend(indent + line.strip() for line in body if line.strip())
        out.append(indent + "$$")
        if i < len(lines) and lines[i].strip():
            out.append("")
    return "\n".join(out)


def _args_items(lines: list[str]) -> list[tuple[int, int]]:
    """(line index, indentation) of the first line of every item of every Args section."""
    items = []
    i = 0
    while i < len(lines):
        section = _SECTION.match(lines[i])
        i += 1
        if section is None:
            continue
        item_indent = None
        while i < len(lines):
            line = lines[i]
            if line.strip():
                indent = _indent_of(line)
                if indent <= len(section.group("indent")):
                    break
                if item_indent is None:
                    item_indent = indent
                if indent == item_indent:
                    items.append((i, indent))
            i += 1
    return items


def join_grouped_names(text: str) -> str:
    """Join an Args item whose comma-separated names continue on the next line."""
    lines = text.split("\n")
    for index, _ in reversed(_args_items(lines)):
        while _OPEN_GROUP.match(lines[index]) and index + 1 < len(lines):
            lines[index] = lines[index].rstrip() + " " + lines[index + 1].strip()
            del lines[index + 1]
    return "\n".join(lines)


def rewrite(text: str) -> str:
    """The docstring ``text`` as griffe's Google parser and arithmatex should read it."""
    text = join_grouped_names(math_blocks(text))
    return _INLINE.sub(lambda m: r"\(" + m.group(1) + r"\)", text)


def _signature_names(obj: griffe.Object) -> set[str] | None:
    if obj.is_function:
        parameters = obj.parameters
    elif obj.is_class:
        init = obj.members.get("__init__")
        if init is None or init.is_alias or not init.is_function:
            return None
        parameters = init.parameters
    else:
        return None
    return {p.name for p in parameters}


def check_args(obj: griffe.Object) -> None:
    """Warn for every Args name that is not a parameter of ``obj``."""
    names = _signature_names(obj)
    if names is None or obj.docstring is None:
        return
    lines = obj.docstring.value.split("\n")
    for index, _ in _args_items(lines):
        item = _ITEM.match(lines[index])
        if item is None:
            griffe.logger.warning(f"{obj.path}: Args item without 'name: description': "
                                  f"{lines[index].strip()!r}")
            continue
        for name in item.group("names").split(","):
            name = name.strip().lstrip("*")
            if name not in names:
                griffe.logger.warning(f"{obj.path}: documented argument {name!r} is not a "
                                      f"parameter of its signature")


def _walk(obj: griffe.Object, seen: set[str]):
    if obj.path in seen:
        return
    seen.add(obj.path)
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member, seen)


class RstMath(griffe.Extension):
    """Rewrites every docstring of a loaded package, then checks its Args sections."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for obj in _walk(pkg, set()):
            if obj.docstring is not None:
                obj.docstring.value = rewrite(obj.docstring.value)
                check_args(obj)
