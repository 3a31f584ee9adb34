"""The Python examples of the documentation pages run as written (each page's blocks in order,
sharing one namespace), so every mapping they show is valid against the current code."""

from __future__ import annotations

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
PAGES = ["mapping.md"]


def python_blocks(page: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


@pytest.mark.parametrize("name", PAGES)
def test_doc_examples_run(name: str) -> None:
    page = DOCS / name
    blocks = python_blocks(page)
    assert len(blocks) >= 5, f"{name}: expected its examples, found {len(blocks)} blocks"
    namespace: dict = {"__name__": "__main__"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{page.name}[block {i}]", "exec"), namespace)
