"""Small models and Lightning wrappers shared by the DeltaMemory tests and benchmark.

``SmallResNet`` is a CIFAR-style ResNet written here (basic blocks, three stages), so the
tests cover convolutional blocks next to the transformers models.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "BasicBlock",
    "CausalLMModule",
    "ImageClassifierModule",
    "SmallResNet",
    "tiny_gpt2",
    "tiny_llama",
]


class BasicBlock(nn.Module):
    """conv-bn-relu-conv-bn plus a (projected) shortcut."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class SmallResNet(nn.Module):
    """Three stages of ``blocks_per_stage`` basic blocks, widths ``width * (1, 2, 4)``."""

    def __init__(self, num_classes: int = 10, width: int = 16, blocks_per_stage: int = 2, dropout: float = 0.1) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        stages = []
        channels = width
        for stage, multiplier in enumerate((1, 2, 4)):
            out_channels = width * multiplier
            blocks = []
            for i in range(blocks_per_stage):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(BasicBlock(channels, out_channels, stride))
                channels = out_channels
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(self.dropout(F.adaptive_avg_pool2d(x, 1).flatten(1)))


def tiny_llama(layers: int = 2, hidden: int = 64, dropout: float = 0.1) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        attention_dropout=dropout,
    )
    return LlamaForCausalLM(config)


def tiny_gpt2(layers: int = 2, hidden: int = 64) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, vocab_size=128, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


class CausalLMModule(pl.LightningModule):
    """Next-token loss of a transformers causal LM on ``(input_ids,)`` batches."""

    def __init__(self, model: nn.Module, lr: float = 1e-3) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (input_ids,) = batch
        return self.model(input_ids=input_ids, labels=input_ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class ImageClassifierModule(pl.LightningModule):
    """Cross-entropy of an image classifier on ``(images, labels)`` batches."""

    def __init__(self, model: nn.Module, lr: float = 1e-2) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self.model(images), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class BenchBlock(nn.Module):
    """Pre-norm transformer block (SDPA attention with dropout, 4x MLP), pure torch."""

    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, seq, hidden))
        return x + F.dropout(self.down(F.gelu(self.up(self.norm2(x)))), self.dropout, self.training)


class BenchGPT(nn.Module):
    """A GPT-style LM without transformers' import cost, for many short benchmark processes."""

    def __init__(
        self, vocab: int = 128, hidden: int = 256, layers: int = 8, heads: int = 4, dropout: float = 0.1
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(BenchBlock(hidden, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
