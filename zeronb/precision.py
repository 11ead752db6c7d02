"""The precisions a run trains in, and what each keeps per parameter: the one place for these facts.

- "float32" / "float64": parameters and gradients in that dtype; the optimizer updates the
  parameters themselves, and Adam keeps its momentum and variance in the same dtype.
- "bf16-mixed": parameters and gradients in bf16; the optimizer keeps an fp32 *master* copy of the
  parameters and updates that (a bf16 parameter cannot take a small update: it would round
  away), and Adam keeps fp32 momentum and variance: the ZeRO paper's 2 + 2 + 12 bytes per parameter.

The stages train with Adam or plain SGD (no momentum: no state at all). SGD is there for parity
checks: Adam's update barely changes when every gradient is multiplied by the same factor, SGD's
does. The memory calculator also knows SGD with momentum.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# per-parameter tensors of optimizer state, besides a master copy: momentum and variance; momentum; none
OPTIMIZER_STATES = {"adam": 2, "sgd-momentum": 1, "sgd": 0}
OPTIMIZERS = ("adam", "sgd")  # what the stages train with


@dataclass(frozen=True)
class Precision:
    name: str
    dtype: torch.dtype   # of the parameters and the gradients
    master: bool         # the optimizer keeps an fp32 master copy of the parameters

    @property
    def param_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def grad_bytes(self) -> int:
        return self.param_bytes

    def optimizer_bytes(self, optimizer: str = "adam") -> int:
        """Bytes of optimizer state per parameter: K (12 for mixed-precision Adam)."""
        state = 4 if self.master else self.param_bytes
        if optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_STATES)}, not {optimizer!r}")
        return OPTIMIZER_STATES[optimizer] * state + (4 if self.master else 0)

    def bytes_per_parameter(self, optimizer: str = "adam") -> tuple[int, int, int]:
        """(p, g, K): bytes of parameter, gradient and optimizer state for each parameter."""
        return self.param_bytes, self.grad_bytes, self.optimizer_bytes(optimizer)


PRECISIONS = {p.name: p for p in (Precision("float32", torch.float32, False),
                                  Precision("float64", torch.float64, False),
                                  Precision("bf16-mixed", torch.bfloat16, True))}


def precision(name: str) -> Precision:
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}, not {name!r}")
    return PRECISIONS[name]


def check_optimizer(name: str) -> str:
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, not {name!r}")
    return name


def optimizer_class(name: str) -> type:
    """torch's optimizer of that name: Adam, or plain SGD (no momentum: its update shows a gradient
    scaled by a constant, which Adam's hides)."""
    return torch.optim.Adam if check_optimizer(name) == "adam" else torch.optim.SGD
