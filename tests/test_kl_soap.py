"""KL-SOAP (Meta's KL-Shampoo factor update in the eigenvalue-corrected form) and the
SOAP -> orthogonalize chain, each against a float64 derivation written here from the papers
(Lin et al., arXiv 2509.03378; Vyas et al., arXiv 2409.11321; Muon's polar factor). Meta's
code has no eigenvalue-corrected KL-Shampoo config to compare with."""

from __future__ import annotations

import pytest
import torch

import opttx
from opttx.testing import run_transform

F64 = torch.float64


def problem(shapes: dict, steps: int):
    g = torch.Generator().manual_seed(0)
    tree = {k: torch.randn(s, generator=g, dtype=F64) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=g, dtype=F64) for k, s in shapes.items()}
             for _ in range(steps)]
    return tree, grads


def mode(x: torch.Tensor, m: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` times ``m`` along dim k: x_(k) <- m^T x_(k) (m symmetric or a basis Q for Q^T)."""
    return torch.movedim(torch.tensordot(x, m, dims=([k], [0])), -1, k)


def unfold(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.movedim(x, k, 0).reshape(x.shape[k], -1)


def meta_correction(beta: float, t: int) -> float:
    """1 - beta^t as Meta computes it: float32 power and subtraction."""
    return float(1.0 - torch.pow(beta, torch.tensor(t, dtype=torch.int32)))


def kl_soap_reference(tree, grads, beta2, eps, freq, kl_exponent=None):
    """KL-SOAP in Meta's order, float64, per leaf: the factors take in G times the other
    dims' inverse roots Q diag(lambda')^-e Q^T of the last refresh (identity before it);
    refresh (eigh of L / b_t + eps I) every ``freq`` steps from step ``freq``; Adam's
    second moment in the eigenbasis; the update (G~ / (sqrt(nu / b_t) + eps)) rotated back."""
    params = {k: v.clone() for k, v in tree.items()}
    state = {k: dict(L=[torch.zeros(d, d, dtype=F64) for d in v.shape],
                     Q=[torch.eye(d, dtype=F64) for d in v.shape],
                     lam=[torch.ones(d, dtype=F64) for d in v.shape],
                     nu=torch.zeros_like(v)) for k, v in tree.items()}
    for t, grad in enumerate(grads, start=1):
        for name, g in grad.items():
            s, order = state[name], g.dim()
            e = kl_exponent if kl_exponent is not None else 1 / (2 * order)
            roots = []
            for q, lam in zip(s["Q"], s["lam"]):
                lam = torch.where(lam.min() < eps, lam - lam.min() + eps, lam)
                roots.append(q @ torch.diag(lam ** -e) @ q.T)
            for i in range(order):
                h = g
                for j in range(order):
                    if j != i:
                        h = mode(h, roots[j], j)
                s["L"][i] = beta2 * s["L"][i] + (1 - beta2) * unfold(h, i) @ unfold(h, i).T
            if t % freq == 0:
                b = meta_correction(beta2, t)
                for i in range(order):
                    lam, q = torch.linalg.eigh(s["L"][i] / b + eps * torch.eye(g.shape[i],
                                                                                dtype=F64))
                    s["lam"][i], s["Q"][i] = lam, q
            rot = g
            for i in range(order):
                rot = mode(rot, s["Q"][i], i)
            s["nu"] = beta2 * s["nu"] + (1 - beta2) * rot ** 2
            u = rot / ((s["nu"] / meta_correction(beta2, t)).sqrt() + eps)
            for i in range(order):
                u = mode(u, s["Q"][i].T, i)
            params[name] = params[name] + u
    return params


@pytest.mark.parametrize("kl_exponent", [None, 0.5])
def test_kl_soap_equals_its_float64_derivation(kl_exponent) -> None:
    tree, grads = problem({"a": (3, 4), "b": (3, 4), "c": (4, 3, 2)}, 6)
    tx = opttx.precondition_eigenvalue_corrected(
        0.9, 1e-8, 2, preconditioner_dtype=F64, kl_shampoo=True, kl_exponent=kl_exponent)
    ours = run_transform(tx, tree, grads)[0]
    theirs = kl_soap_reference(tree, grads, 0.9, 1e-8, 2, kl_exponent)
    for k in tree:
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-9, atol=1e-12)
    # and KL changes the numbers: plain SOAP (Meta's form) is not the derivation
    plain = run_transform(opttx.precondition_eigenvalue_corrected(
        0.9, 1e-8, 2, preconditioner_dtype=F64), tree, grads)[0]
    assert (plain["a"] - theirs["a"]).abs().max() > 1e-3


def test_shampoo_alias_takes_kl_with_the_eigenvalue_corrected_preconditioner() -> None:
    """``shampoo(kl_shampoo=True, preconditioner="eigenvalue_corrected")`` is KL-SOAP (no
    longer refused): its direction is the transform's, here on a (6, 5) matrix kept whole."""
    tree, grads = problem({"w": (6, 5)}, 5)
    kw = dict(betas=(0.0, 0.9), epsilon=1e-8, precondition_frequency=2,
              preconditioner="eigenvalue_corrected", preconditioner_dtype=F64,
              inv_factor_matrix_dtype=F64, max_preconditioner_dim=8)
    kl = run_transform(opttx.shampoo(1.0, kl_shampoo=True, **kw), tree, grads)[0]
    plain = run_transform(opttx.shampoo(1.0, **kw), tree, grads)[0]
    reference = kl_soap_reference({k: -v for k, v in tree.items()}, grads, 0.9, 1e-8, 2)
    torch.testing.assert_close(kl["w"], -reference["w"], rtol=1e-9, atol=1e-12)
    assert (kl["w"] - plain["w"]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="eigendecomposition"):
        opttx.shampoo(1.0, kl_shampoo=True, preconditioner="eigenvalue_corrected",
                      eigendecomposition="power")
    with pytest.raises(ValueError, match="schedule='meta'"):
        opttx.precondition_eigenvalue_corrected(kl_shampoo=True, schedule="soap")


def polar(x: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    return u @ vh


def soap_orthogonalize_reference(tree, grads, lr, b1, b2, shampoo_beta, eps, freq):
    """The SOAP paper's algorithm (first gradient initialises the factors and the eigh bases,
    zero update; then Adam in the previous bases, the factors, a refresh every ``freq`` Adam
    steps) with each matrix's direction replaced by its polar factor U V^T, float64."""
    params = {k: v.clone() for k, v in tree.items()}
    st = {k: dict(L=torch.zeros(v.shape[0], v.shape[0], dtype=F64),
                  R=torch.zeros(v.shape[1], v.shape[1], dtype=F64),
                  m=torch.zeros_like(v), nu=torch.zeros_like(v)) for k, v in tree.items()}

    def bases(s):
        eye = lambda n: torch.eye(n, dtype=F64)  # noqa: E731
        s["QL"] = torch.linalg.eigh(s["L"] + eps * eye(s["L"].shape[0]))[1]
        s["QR"] = torch.linalg.eigh(s["R"] + eps * eye(s["R"].shape[0]))[1]

    for t, grad in enumerate(grads, start=1):
        for k, g in grad.items():
            s = st[k]
            if t > 1:
                n = t - 1                              # Adam's step count
                rot = s["QL"].T @ g @ s["QR"]
                s["nu"] = b2 * s["nu"] + (1 - b2) * rot ** 2
                s["m"] = b1 * s["m"] + (1 - b1) * g
                x = s["QL"].T @ (s["m"] / (1 - b1 ** n)) @ s["QR"]
                u = s["QL"] @ (x / ((s["nu"] / (1 - b2 ** n)).sqrt() + eps)) @ s["QR"].T
                params[k] = params[k] - lr * polar(u)
            s["L"] = shampoo_beta * s["L"] + (1 - shampoo_beta) * g @ g.T
            s["R"] = shampoo_beta * s["R"] + (1 - shampoo_beta) * g.T @ g
            if t == 1 or (t - 1) % freq == 0:
                bases(s)
    return params


def test_soap_then_orthogonalize_equals_its_float64_derivation() -> None:
    """The chain documented in `opttx.soap`: SOAP's direction, then Muon's orthogonalization
    (here its exact form, the polar factor by SVD), then the learning rate. Square matrices:
    the first bases come from one gradient's factors, whose null space (a non-square
    gradient's larger factor) any two implementations fill differently."""
    tree, grads = problem({"w": (4, 4), "v": (6, 6), "s": (5, 5)}, 7)
    tx = opttx.chain(
        opttx.precondition_eigenvalue_corrected(0.95, 1e-8, 2, beta1=0.9, shampoo_beta=0.9,
                                                schedule="soap", eigendecomposition="eigh",
                                                preconditioner_dtype=F64),
        opttx.orthogonalize(method="svd"), opttx.scale_by_learning_rate(0.1))
    ours = run_transform(tx, tree, grads)[0]
    theirs = soap_orthogonalize_reference(tree, grads, 0.1, 0.9, 0.95, 0.9, 1e-8, 2)
    for k in tree:
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-9, atol=1e-12)
    assert (ours["w"] - tree["w"]).abs().max() > 1e-2
