"""Running an optax transform on the same trees and gradients as an opttx one (jax on CPU),
for the tests that compare the two (test_adopt, test_ademamix, test_muon, test_prodigy,
test_schedule_free, test_first_order_set)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from opttx.testing import assert_trees_close

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}


def to_torch(tree: dict) -> dict:
    return {k: torch.from_numpy(np.array(v)) for k, v in tree.items()}


def run_optax(tx: Any, tree: dict, grads: list[dict], jit: bool = True
              ) -> tuple[dict, Any, dict]:
    """``tx`` (optax) applied for every gradient dict: the final parameters as torch tensors,
    the final optax state, and the final parameters as jax arrays."""
    import jax
    import jax.numpy as jnp
    import optax
    params = {k: jnp.asarray(v.numpy()) for k, v in tree.items()}
    state = tx.init(params)
    update = jax.jit(tx.update) if jit else tx.update
    for g in grads:
        updates, state = update({k: jnp.asarray(v.numpy()) for k, v in g.items()}, state,
                                params)
        params = optax.apply_updates(params, updates)
    return to_torch(params), state, params


def assert_params_close(actual: dict, expected: dict, tree: dict, dtype: torch.dtype,
                        what: str) -> None:
    """float64: within 1e-10 of the distance each leaf travelled; float32: within 1e-5 of the
    leaf's magnitude."""
    tol = TOLERANCE[dtype]
    for k, x0 in tree.items():
        if dtype == torch.float64:     # relative to the distance travelled
            scale = float((expected[k] - x0).abs().max())
        else:                          # relative to the leaf's magnitude
            scale = max(float(x0.abs().max()), float(expected[k].abs().max()))
        assert_trees_close(actual[k], expected[k], rtol=tol, atol=tol * scale,
                           what=f"{what} params[{k}]")
