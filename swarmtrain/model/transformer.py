"""A causal pre-norm byte-level transformer (vocab 256) whose block boundaries can host exits.

An exit is a final LayerNorm plus a readout to 256 byte logits. The last exit (after block ``depth``) always
exists; ``ModelConfig.exits`` adds exits at earlier boundaries so that stages of the model can be trained on
local losses. With ``shared_readout`` every exit uses the same readout matrix (the last exit's).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from swarmtrain.config import ModelConfig

VOCAB = 256


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, width: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, mlp_ratio * width, bias=False)
        self.out = nn.Linear(mlp_ratio * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class ByteTransformer(nn.Module):
    """Byte-level language model. ``forward(idx)`` returns the last exit's logits, shape (batch, length, 256)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(VOCAB, config.width)
        self.pos = nn.Embedding(config.context, config.width)
        self.blocks = nn.ModuleList(Block(config.width, config.heads, config.mlp_ratio) for _ in range(config.depth))
        self.exit_points: tuple[int, ...] = tuple(sorted(set(config.exits) | {config.depth}))
        self.exit_norms = nn.ModuleDict({str(e): nn.LayerNorm(config.width) for e in self.exit_points})
        readout_points = (config.depth,) if config.shared_readout else self.exit_points
        self.readouts = nn.ModuleDict({str(e): nn.Linear(config.width, VOCAB, bias=False) for e in readout_points})
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 style: N(0, 0.02), residual output projections scaled down by depth.
        residual_std = 0.02 / math.sqrt(2 * self.config.depth)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            std = residual_std if name.endswith(("attn.proj.weight", "out.weight")) else 0.02
            nn.init.normal_(p, mean=0.0, std=std)

    def embed_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        """Token plus position embeddings of a (batch, length) byte tensor."""
        if idx.shape[1] > self.config.context:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds model.context {self.config.context}")
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.embed(idx) + self.pos(positions)

    def run_blocks(self, h: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Hidden states after blocks ``start..end-1`` (0-based, end exclusive), given the input of block ``start``."""
        for block in self.blocks[start:end]:
            h = block(h)
        return h

    def readout_for(self, exit_point: int) -> nn.Linear:
        key = str(exit_point) if str(exit_point) in self.readouts else str(self.config.depth)
        return self.readouts[key]

    def exit_logits(self, h: torch.Tensor, exit_point: int) -> torch.Tensor:
        """Logits of the exit at block boundary ``exit_point`` applied to hidden states ``h``."""
        return self.readout_for(exit_point)(self.exit_norms[str(exit_point)](h))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.run_blocks(self.embed_tokens(idx), 0, self.config.depth)
        return self.exit_logits(h, self.config.depth)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, object]]:
    """AdamW groups: decay on 2-D weights of linear layers, none on norms and embeddings."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        is_embedding = name.startswith(("embed.", "pos."))
        (decay if p.dim() >= 2 and not is_embedding else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
