"""AdamW and gradient-norm clipping on torch's multi-tensor (``_foreach``) kernels, without ``torch.optim``.

The arithmetic is ``torch.optim.AdamW``'s (decoupled weight decay, bias-corrected moments, ``eps`` added after
the square root; tests compare the two step by step). The reason to have it: the first step of any
``torch.optim`` optimizer imports ``torch._dynamo`` (and sympy, mpmath, ...), about 70 MiB of private memory in
*every* process. A stage process has nothing else to gain from that import, and global backprop uses this same
class when it runs as the benchmark's reference, so both sides pay the same per-process cost.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch


class AdamW:
    """Minimal AdamW over parameter groups ``[{"params": [...], "weight_decay": wd}, ...]``."""

    def __init__(
        self,
        groups: list[dict[str, Any]],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        self.param_groups: list[dict[str, Any]] = [
            {"params": list(g["params"]), "weight_decay": float(g.get("weight_decay", 0.0)), "lr": lr} for g in groups
        ]
        self.betas, self.eps = betas, eps
        self.steps = 0
        self.exp_avg: list[list[torch.Tensor]] = [
            [torch.zeros_like(p) for p in g["params"]] for g in self.param_groups
        ]
        self.exp_avg_sq: list[list[torch.Tensor]] = [
            [torch.zeros_like(p) for p in g["params"]] for g in self.param_groups
        ]

    @torch.no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient."""
        self.steps += 1
        beta1, beta2 = self.betas
        bias1 = 1 - beta1**self.steps
        bias2_sqrt = math.sqrt(1 - beta2**self.steps)
        for group, avgs, sqs in zip(self.param_groups, self.exp_avg, self.exp_avg_sq, strict=True):
            chosen = [i for i, p in enumerate(group["params"]) if p.grad is not None]
            if not chosen:
                continue
            params = [group["params"][i] for i in chosen]
            grads = [group["params"][i].grad for i in chosen]
            exp_avg = [avgs[i] for i in chosen]
            exp_avg_sq = [sqs[i] for i in chosen]
            lr = float(group["lr"])
            if group["weight_decay"]:
                torch._foreach_mul_(params, 1 - lr * float(group["weight_decay"]))
            torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
            torch._foreach_mul_(exp_avg_sq, beta2)
            torch._foreach_addcmul_(exp_avg_sq, grads, grads, 1 - beta2)
            denom = torch._foreach_sqrt(exp_avg_sq)
            torch._foreach_div_(denom, bias2_sqrt)
            torch._foreach_add_(denom, self.eps)
            torch._foreach_addcdiv_(params, exp_avg, denom, -lr / bias1)

    def zero_grad(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The moments by (group, index), for checkpoints."""
        out = {}
        for g, (avgs, sqs) in enumerate(zip(self.exp_avg, self.exp_avg_sq, strict=True)):
            for i, (a, s) in enumerate(zip(avgs, sqs, strict=True)):
                out[f"{g}.{i}.exp_avg"], out[f"{g}.{i}.exp_avg_sq"] = a, s
        return out


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> float:
    """Scale gradients so their total 2-norm is at most ``max_norm`` (as ``torch.nn.utils.clip_grad_norm_``)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef)
    return float(total)
