"""Every alias gives bitwise the parameters and states it gave when the fixture was recorded
(``tests/golden/record.py``): refactors of the transform contract change no number."""

from __future__ import annotations

import pytest
import torch

from golden.record import CASES, PATH, machine, run

TABLE = torch.load(PATH)


@pytest.mark.skipif(TABLE["torch"] != str(torch.__version__),
                    reason=f"fixture recorded with torch {TABLE['torch']}; bitwise results "
                           f"are only comparable on the same build")
@pytest.mark.skipif(TABLE.get("machine") != machine(),
                    reason=f"fixture recorded on {TABLE.get('machine')}, this is {machine()}: "
                           "vectorized kernels round differently on other CPUs (see "
                           "tests/golden/record.py to record it here)")
@pytest.mark.parametrize("name", list(CASES))
def test_alias_is_bitwise_unchanged(name: str) -> None:
    assert name in TABLE["cases"], f"{name} has no recorded entry: run tests/golden/record.py {name}"
    now, then = run(name), TABLE["cases"][name]
    assert len(now["state"]) == len(then["state"]), "the state holds another number of tensors"
    for kind in ("params", "state"):
        for i, (a, b) in enumerate(zip(now[kind], then[kind])):
            assert a.dtype == b.dtype and a.shape == b.shape, f"{kind}[{i}]"
            assert torch.equal(a, b), f"{name}: {kind}[{i}] changed (max diff " \
                                      f"{(a.double() - b.double()).abs().max().item():.3e})"
