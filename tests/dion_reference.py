"""Microsoft's ``dion`` package (Dion, Dion2, NorMuon, Muon, Polar Express), the reference of
the Muon family's tests. It is not on PyPI: the project keeps it in ``../shared/refs/dion``
(see its README); tests that need it skip with this reason where the folder is absent."""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent / "shared" / "refs" / "dion"
REASON = (f"Microsoft's dion package is not at {ROOT} (it is not on PyPI; see "
          "shared/refs/dion/README.md)")


def dion(module: str = "dion"):
    """``import dion`` (or ``dion.<module>``) from the shared folder, or skip the test."""
    if (ROOT / "dion").is_dir() and str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return pytest.importorskip(module, reason=REASON)
