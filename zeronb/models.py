"""Small deterministic models and data, so that N ranks each training on a slice of a global batch
compute exactly what one process computes on all of it.

Two models: an MLP (a stack of Linear + GELU layers) and a small GPT-style decoder (token and
position embeddings, pre-norm blocks of causal self-attention and an MLP, a final norm and an output
head). Both split into *units* - the groups of parameters that ZeRO-3 and FSDP gather together:
one unit per layer or block, in the order the forward pass uses them.

Data is a pure function of (model kind, step, seed): every rank can build the global batch and
take its own rows, and `--nproc 1` sees exactly the union of what N ranks see.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """Regression MLP: `depth` Linear layers with GELU between them. Each layer is a unit."""

    def __init__(self, d_in: int = 32, hidden: int = 64, d_out: int = 16, depth: int = 4):
        super().__init__()
        dims = [d_in] + [hidden] * (depth - 1) + [d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = F.gelu(x)
        return x

    def units(self) -> list[nn.Module]:
        return list(self.layers)

    @staticmethod
    def loss(output, target):
        return F.mse_loss(output, target)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        # no bias: a key bias adds the same number to every logit of a row, which softmax ignores -
        # its gradient is 0 up to rounding noise, and Adam would amplify that noise into real steps
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.n_head)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Embed(nn.Module):
    def __init__(self, vocab: int, d_model: int, seq_len: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)

    def forward(self, idx):
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Head(nn.Module):
    def __init__(self, d_model: int, vocab: int):
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.lm = nn.Linear(d_model, vocab, bias=False)

    def forward(self, x):
        return self.lm(self.ln(x))


class TinyGPT(nn.Module):
    """A small GPT-style decoder. Units: the embeddings, each block, the head."""

    def __init__(self, vocab: int = 64, d_model: int = 32, n_head: int = 4, n_layer: int = 2, seq_len: int = 16):
        super().__init__()
        self.embed = Embed(vocab, d_model, seq_len)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.head = Head(d_model, vocab)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def units(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    @staticmethod
    def loss(logits, target):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


MODELS = ("mlp", "gpt")  # the two models every chapter trains


@dataclass
class Config:
    """What a model and its data are: change a field, get another (still deterministic) setup."""
    kind: str = "mlp"             # one of MODELS
    global_batch: int = 16        # rows per step, over all ranks together
    seed: int = 0
    # MLP
    d_in: int = 32
    hidden: int = 64
    d_out: int = 16
    depth: int = 4
    # GPT
    vocab: int = 64
    d_model: int = 32
    n_head: int = 4
    n_layer: int = 2
    seq_len: int = 16


WRAPS = ("units", "whole", "layers")


def choose_units(model: nn.Module, wrap: str = "units") -> list[nn.Module]:
    """The modules ZeRO-3 and FSDP gather together ("wrapping"): the model's own choice
    (`model.units()`: a layer or a block each), the whole model as one unit, or every module that
    owns parameters (a Linear, a LayerNorm, an Embedding), in the order forward uses them."""
    if wrap == "units":
        return model.units()
    if wrap == "whole":
        return [model]
    if wrap == "layers":
        return [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    raise ValueError(f"wrap must be one of {', '.join(WRAPS)}, not {wrap!r}")


def checkpoint_activations(model: nn.Module) -> nn.Module:
    """Activation checkpointing, unit by unit: each unit saves only its input in forward, and
    recomputes what it needs from it in backward (torch.utils.checkpoint, non-reentrant). Less
    activation memory, one more forward's worth of compute. The module's own hooks (ZeRO-3's,
    FSDP2's) still fire once per forward and backward: the recompute runs inside the unit's
    backward, when its parameters are already gathered. (zeronb.memory.saved_activations then
    counts, for each unit, the input the checkpoint keeps to recompute from: all it saves.)"""
    from torch.utils.checkpoint import checkpoint

    for unit in model.units():
        forward = unit.forward
        unit.forward = lambda *args, _forward=forward, **kw: checkpoint(_forward, *args, use_reentrant=False, **kw)
    return model


def make_model(cfg: Config = Config(), dtype: torch.dtype = torch.float32, device="cpu") -> nn.Module:
    """The model with the same initial weights on every rank (seeded by cfg.seed)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        if cfg.kind == "mlp":
            model = MLP(cfg.d_in, cfg.hidden, cfg.d_out, cfg.depth)
        elif cfg.kind == "gpt":
            model = TinyGPT(cfg.vocab, cfg.d_model, cfg.n_head, cfg.n_layer, cfg.seq_len)
        else:
            raise ValueError(f"model kind must be one of {', '.join(MODELS)}, not {cfg.kind!r}")
    return model.to(device=device, dtype=dtype)


def global_batch(cfg: Config, step: int, dtype: torch.dtype = torch.float32, device="cpu"):
    """(inputs, targets) of the whole global batch at `step`: the same on every rank."""
    g = torch.Generator().manual_seed(1_000_003 * (cfg.seed + 1) + step)
    if cfg.kind == "mlp":
        x = torch.randn(cfg.global_batch, cfg.d_in, generator=g, dtype=torch.float64)
        # a fixed smooth target function, so that the loss actually falls
        w = torch.randn(cfg.d_in, cfg.d_out, generator=torch.Generator().manual_seed(cfg.seed), dtype=torch.float64)
        y = torch.tanh(x @ w / math.sqrt(cfg.d_in))
        return x.to(device=device, dtype=dtype), y.to(device=device, dtype=dtype)
    tokens = torch.randint(cfg.vocab, (cfg.global_batch, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def local_batch(cfg: Config, step: int, rank: int, world_size: int, dtype: torch.dtype = torch.float32,
                device="cpu"):
    """This rank's rows of the global batch: rows [rank*B/N, (rank+1)*B/N)."""
    if cfg.global_batch % world_size:
        raise ValueError(f"global_batch={cfg.global_batch} must divide evenly over {world_size} ranks")
    per = cfg.global_batch // world_size
    x, y = global_batch(cfg, step, dtype, device)
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
