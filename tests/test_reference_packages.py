"""The reference packages the tests compare against are importable where they are promised.

The comparisons skip (``pytest.importorskip``) when a reference package is missing, so that a
venv without them (a user's, or one on another torch) still runs the rest. That would also let
an install that lost one pass with the comparisons silently skipped. ``make test`` (and so CI)
installs ``.[test]`` and sets ``OPTTX_REQUIRE_REFERENCES=1``: then every distribution of the
``test`` extra must import, and a missing one fails here instead of skipping elsewhere.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import os
import re

import pytest

REQUIRED = os.environ.get("OPTTX_REQUIRE_REFERENCES") == "1"


def _test_extra() -> list[str]:
    """The distribution names of opttx's ``test`` extra, from the installed metadata."""
    try:
        requires = metadata.requires("opttx") or []
    except metadata.PackageNotFoundError:          # a source tree on sys.path, not installed
        return []
    names = []
    for req in requires:
        if re.search(r"""extra\s*==\s*["']test["']""", req):
            names.append(re.match(r"[A-Za-z0-9_.\-]+", req).group())
    return names


def _modules(dist: str) -> list[str]:
    """The module a distribution is imported as: its own name with '_' when it provides one
    of that name (pytest-timeout, galore-torch), else the top-level modules it provides
    (pytorch-optimizer: pytorch_optimizer, lomo-optim: lomo_optim, ...)."""
    norm = re.sub(r"[-_.]+", "-", dist).lower()
    found = [module for module, dists in metadata.packages_distributions().items()
             if any(re.sub(r"[-_.]+", "-", d).lower() == norm for d in dists)
             and not module.startswith("_")]
    own = norm.replace("-", "_")
    return [own] if own in found or not found else sorted(found)


@pytest.mark.skipif(not REQUIRED, reason="OPTTX_REQUIRE_REFERENCES is not 1 (make test sets it)")
def test_every_reference_package_of_the_test_extra_imports() -> None:
    dists = _test_extra()
    assert "heavyball" in dists and "optax" in dists, \
        f"opttx's installed metadata lists no test extra ({dists}): reinstall with .[test]"
    missing = []
    for dist in dists:
        for module in _modules(dist):
            try:
                importlib.import_module(module)
            except Exception as e:   # noqa: BLE001 (any import failure makes tests skip)
                missing.append(f"{dist} ({module}): {type(e).__name__}: {e}")
    assert not missing, "reference packages that do not import, so their comparisons " \
                        "would skip: " + "; ".join(missing)
