"""The GPT the training job trains (nanoGPT's shapes: pre-norm blocks, tied head) and its size presets."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# Model sizes; --n_layer, --n_head, --n_embd, --block_size override them one by one.
MODEL_PRESETS = {
    "tiny": {"n_layer": 3, "n_head": 4, "n_embd": 128, "block_size": 64},  # 0.6 M parameters on bytes
    "gpt2": {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024},  # 124 M
    "gpt2-medium": {"n_layer": 24, "n_head": 16, "n_embd": 1024, "block_size": 1024},  # 350 M
    "gpt2-large": {"n_layer": 36, "n_head": 20, "n_embd": 1280, "block_size": 1024},  # 774 M
    "gpt2-xl": {"n_layer": 48, "n_head": 25, "n_embd": 1600, "block_size": 1024},  # 1558 M
}


class Block(nn.Module):
    """One transformer block: causal self-attention and an MLP, each behind a LayerNorm and a residual."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        self.drop = nn.Dropout(dropout)

    def attn(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """Token and position embeddings, `n_layer` blocks, a head tied to the token embedding.
    `forward(idx, targets)` returns the mean next-token cross-entropy (in fp32)."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float):
        super().__init__()
        assert n_embd % n_head == 0
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.apply(self._init)
        for name, prm in self.named_parameters():  # GPT-2 scaled init of residual projections
            if name.endswith(("proj.weight", "mlp.2.weight")):
                nn.init.normal_(prm, 0.0, 0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x)).float()  # the loss in fp32 also when the model is bf16 (DeepSpeed)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def gpt_from_args(args, vocab_size: int | None = None) -> GPT:
    """The GPT of the parsed flags (`vocab_size` overrides --vocab_size)."""
    vocab = args.vocab_size if vocab_size is None else vocab_size
    return GPT(vocab, args.block_size, args.n_layer, args.n_head, args.n_embd, args.dropout)


def flops_per_token(n_params: int, args) -> float:
    """Training FLOPs per token (PaLM, appendix B; nanoGPT's estimate_mfu): 6 N for the weights plus
    12 L d T for attention; N without the position embedding, which costs no matmul."""
    n = n_params - args.block_size * args.n_embd
    return 6 * n + 12 * args.n_layer * args.n_embd * args.block_size
