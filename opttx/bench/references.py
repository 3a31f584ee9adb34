"""The counterparts of opttx's optimizers in other libraries (``--references``): torch.optim,
transformers, heavyball and torchao optimizers, run eagerly (torchao compiles its own step)
beside opttx on the same model and batches.

Each reference is configured like the opttx alias it stands beside (`HYPERPARAMS` in
``optimizers.py``) as far as its library allows; where the two compute different numbers the
`Reference.note` says how. A reference whose library is not installed is skipped with the
reason printed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

import opttx

NamedParams = list[tuple[str, torch.nn.Parameter]]


class Composite:
    """Two ``torch.optim.Optimizer`` s stepped together, as one (Muon on the hidden matrices,
    AdamW on the other parameters): ``step``, ``zero_grad`` and ``state`` of both."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = [o for o in optimizers if o is not None]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad()

    @property
    def state(self) -> list[Any]:
        return [dict(o.state) for o in self.optimizers]


@dataclass(frozen=True)
class Reference:
    """One counterpart: its library, the opttx alias it stands beside and how it is built."""

    name: str                 # row name in the report, e.g. "torch.AdamW"
    counterpart: str          # the opttx alias it is compared with
    module: str               # the package it needs
    hyperparams: dict[str, Any]
    make: Callable[[NamedParams, dict[str, Any]], Any]
    note: str = ""            # how its numbers differ from the opttx alias's, if they do

    def build(self, named: NamedParams) -> Any:
        """The optimizer of the model's ``named_parameters()``."""
        return self.make(named, self.hyperparams)


def _split_hidden(named: NamedParams) -> tuple[list, list]:
    """The parameters `opttx.muon_hidden_matrices` gives to Muon, and the others."""
    flags = opttx.muon_hidden_matrices({n: p for n, p in named})
    hidden = [p for n, p in named if flags[n]]
    return hidden, [p for n, p in named if not flags[n]]


def _torch_adamw(named: NamedParams, hp: dict[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for _, p in named], **hp)


def _torch_muon(named: NamedParams, hp: dict[str, Any]) -> Composite:
    hidden, rest = _split_hidden(named)
    hp = dict(hp)
    adam_lr = hp.pop("adam_lr")
    return Composite(torch.optim.Muon(hidden, **hp),
                     torch.optim.AdamW(rest, lr=adam_lr, weight_decay=0.0) if rest else None)


def _hf_adafactor(named: NamedParams, hp: dict[str, Any]) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor
    return Adafactor([p for _, p in named], **hp)


def _eager_heavyball() -> Any:
    import heavyball
    heavyball.utils.compile_mode = None   # its kernels run eagerly, like every reference
    return heavyball


def _heavyball_muon(named: NamedParams, hp: dict[str, Any]) -> Composite:
    heavyball = _eager_heavyball()
    hidden, rest = _split_hidden(named)
    hp = dict(hp)
    adam_lr = hp.pop("adam_lr")
    return Composite(heavyball.Muon(hidden, **hp),
                     torch.optim.AdamW(rest, lr=adam_lr, weight_decay=0.0) if rest else None)


def _heavyball_soap(named: NamedParams, hp: dict[str, Any]) -> torch.optim.Optimizer:
    return _eager_heavyball().SOAP([p for _, p in named], **hp)


class _TorchaoRun:
    """A torchao low-bit optimizer as the bench runs it: its step compiles itself
    (``torch.compile``), which refuses to run under a torch dispatch mode, so the step runs
    with the bench's live-tensor tracker popped (its peak then omits the step's own
    temporaries); ``state`` shows each compressed moment as the tensors it stores (codes,
    scales, map), so the state's bytes are what it holds, not its fp32 appearance."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt

    def step(self) -> None:
        from torch.utils._python_dispatch import _disable_current_modes
        with _disable_current_modes():
            self.opt.step()

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    @property
    def state(self) -> list[Any]:
        def stored(x: Any) -> Any:
            names = getattr(x, "tensor_attrs", None)
            return [getattr(x, n) for n in names] if names else x
        return [{k: stored(v) for k, v in s.items()} for s in self.opt.state.values()]


def _torchao(cls: str) -> Callable[[NamedParams, dict[str, Any]], _TorchaoRun]:
    def make(named: NamedParams, hp: dict[str, Any]) -> _TorchaoRun:
        from torchao import optim
        return _TorchaoRun(getattr(optim, cls)([p for _, p in named], **hp))
    return make


_TORCHAO = ("torchao compiles its per-parameter step (torch.compile, Inductor) even in this "
            "eager loop, and runs it outside the live-tensor tracker (a compiled step refuses "
            "a dispatch mode: its peak omits the step's temporaries); it compresses tensors of "
            ">= 4096 elements whose size is a multiple of the block (every matrix here), the "
            "others stay fp32, as opttx's min_size")


_MUON_SPLIT = ("Muon on the hidden matrices (opttx.muon_hidden_matrices), torch AdamW "
               "(no Nesterov) on embeddings and vectors")
REFERENCES: tuple[Reference, ...] = (
    Reference("torch.AdamW", "adamw", "torch", {"lr": 1e-3, "weight_decay": 1e-4}, _torch_adamw,
              "same numbers as opttx.adamw (weight decay set to opttx's default 1e-4)"),
    Reference("torch.Muon", "muon", "torch",
              {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "adam_lr": 1e-3}, _torch_muon,
              _MUON_SPLIT + "; no momentum bias correction and a bfloat16 Newton-Schulz (opttx "
              "defaults: optax's, debiased, float32)"),
    Reference("heavyball.Muon", "muon", "heavyball",
              {"lr": 0.02, "betas": (0.95, 0.99), "weight_decay": 0.0, "adam_lr": 1e-3},
              _heavyball_muon, _MUON_SPLIT + "; heavyball's own Newton-Schulz and shape scaling"),
    Reference("hf.Adafactor", "adafactor", "transformers",
              {"lr": 1e-2, "relative_step": False, "scale_parameter": True,
               "warmup_init": False}, _hf_adafactor,
              "factors every >= 2-D tensor (opttx: those with both dims >= 128, every matrix of "
              "the default model); otherwise the same rule"),
    Reference("heavyball.SOAP", "soap", "heavyball",
              {"lr": 3e-3, "betas": (0.95, 0.95), "weight_decay": 0.01,
               "precondition_frequency": 10}, _heavyball_soap,
              "opttx.soap's rates and frequency; heavyball's own basis refresh, "
              "max_precond_dim 2048 and merged dims"),
    Reference("torchao.AdamW8bit", "adamw_8bit", "torchao",
              {"lr": 1e-3, "weight_decay": 1e-4}, _torchao("AdamW8bit"),
              _TORCHAO + "; the same maps and block 256"),
    Reference("torchao.AdamW4bit", "adamw_4bit", "torchao",
              {"lr": 1e-3, "weight_decay": 1e-4}, _torchao("AdamW4bit"),
              _TORCHAO + "; second moment block-wise (128) where opttx's is rank-1 on matrices, "
              "fp32 scales (opttx: bfloat16)"),
    Reference("torchao.AdamWFp8", "adamw_fp8", "torchao",
              {"lr": 1e-3, "weight_decay": 1e-4}, _torchao("AdamWFp8"),
              _TORCHAO + "; e4m3 with one scale per block of 256, as opttx's 'e4m3' format, "
              "which keeps second moments at least at the smallest subnormal (torchao: "
              "round to nearest, down to 0)"),
)


def select_references(requested: Iterable[str]) -> tuple[list[Reference], list[str]]:
    """The references of the ``requested`` opttx aliases whose library is installed, and a
    reason for each one left out."""
    requested = set(requested)
    chosen, skipped = [], []
    for ref in REFERENCES:
        if ref.counterpart not in requested:
            skipped.append(f"{ref.name}: its counterpart {ref.counterpart!r} is not among "
                           "--optimizers")
        elif importlib.util.find_spec(ref.module) is None:
            skipped.append(f"{ref.name}: {ref.module} is not installed")
        elif ref.name == "torch.Muon" and not hasattr(torch.optim, "Muon"):
            skipped.append(f"{ref.name}: torch {torch.__version__} has no torch.optim.Muon")
        else:
            chosen.append(ref)
    return chosen, skipped
