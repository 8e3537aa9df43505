"""One run of the wrapper check's task with one thing a user might write differently: the probes
of the search for issue 48's gap between ``hvd_gradcomp.DistributedOptimizer`` and stock
``hvd.DistributedOptimizer`` (none found; the variants and their results are in the session's
closing note). Prints one ``RESULT {json}`` line on rank 0: the held-out loss after ``--steps``
steps and whether the replicas are identical.

The baseline is :mod:`benchmarks.study.wrapper_check`'s loop (AdamW lr 2e-3, weight decay 0.1,
30-step warm-up then cosine to a tenth set through ``param_groups``, 16 sequences of 64
characters per rank, the broadcasts after wrapping, ``TopKQSGD(ratio=0.01, bits=8, seed=s)``)::

    horovodrun --gloo -np 2 python benchmarks/study/wrapper_variants.py --wrapper gc --arch encoder
    horovodrun --gloo -np 2 python benchmarks/study/wrapper_variants.py --wrapper stock --arch gpt --groups --beta2 0.95
    horovodrun --gloo -np 2 python benchmarks/study/wrapper_variants.py --wrapper gc --micro 8
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, List

ROOT = Path(__file__).resolve().parents[2]
VOCAB, WIDTH, HEADS, LAYERS, BATCH, PEAK, WARMUP = 128, 128, 4, 2, 16, 2e-3, 30


def parse(argv: List[str]) -> argparse.Namespace:
    """The variant's switches (each off by default: the wrapper check's loop).

    >>> a = parse(["--wrapper", "stock", "--micro", "8"]); (a.wrapper, a.micro, a.arch)
    ('stock', 8, 'blocks')
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wrapper", choices=("none", "stock", "gc"), default="gc",
                   help="none: uncompressed hvd.DistributedOptimizer; stock: TopKQSGD inside it; gc: ours")
    p.add_argument("--arch", choices=("blocks", "encoder", "gpt"), default="blocks",
                   help="pre-norm blocks with nn.MultiheadAttention; nn.TransformerEncoder (dropout 0.1, post-norm); "
                        "nanoGPT-style (N(0, 0.02) init, SDPA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--tie", action="store_true", help="tie the embedding and the head")
    p.add_argument("--groups", action="store_true", help="weight decay on matrices only, in a second param group")
    p.add_argument("--beta2", type=float, default=0.999)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--fused", action="store_true", help="AdamW(fused=True)")
    p.add_argument("--lr-from-zero", action="store_true", help="the warm-up's first rate is 0")
    p.add_argument("--same-data", action="store_true", help="every rank samples the same batches")
    p.add_argument("--zero-grad", choices=("start", "end"), default="start", help="before backward or after step")
    p.add_argument("--eval-every", type=int, default=0, help="rank 0 evaluates every N steps (changes timing)")
    p.add_argument("--micro", type=int, default=0,
                   help="N micro-batches per step through GradientAccumulator(steps=N), as the README's gc road")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (0: torch's default)")
    return p.parse_args(argv)


def lr_at(step: int, steps: int, from_zero: bool = False) -> float:
    """Linear warm-up to ``PEAK`` over ``WARMUP`` steps, then cosine to a tenth of it.

    >>> round(lr_at(0, 300) / PEAK, 4), lr_at(0, 300, from_zero=True), round(lr_at(300, 300) / PEAK, 4)
    (0.0333, 0.0, 0.1)
    """
    if step < WARMUP:
        return PEAK * (step + (0 if from_zero else 1)) / WARMUP
    return PEAK * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, (step - WARMUP) / (steps - WARMUP)))))


def build_model(arch: str, context: int, tie: bool) -> Any:
    """A 2-layer character transformer of 437,760 parameters (untied, context 64)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
            self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

        def forward(self, x: Any, mask: Any) -> Any:
            h = self.ln1(x)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class GptBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
            self.c_attn, self.c_proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
            self.c_fc, self.m_proj = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

        def forward(self, x: Any, mask: Any) -> Any:
            b, t, c = x.shape
            q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in self.c_attn(self.ln_1(x)).split(c, 2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
            x = x + self.c_proj(y)
            return x + self.m_proj(F.gelu(self.c_fc(self.ln_2(x))))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(context, WIDTH)
            if arch == "encoder":
                layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, batch_first=True)
                self.body = nn.TransformerEncoder(layer, LAYERS, norm=nn.LayerNorm(WIDTH), enable_nested_tensor=False)
                self.ln = nn.Identity()
            else:
                self.blocks = nn.ModuleList((GptBlock if arch == "gpt" else Blocks)() for _ in range(LAYERS))
                self.ln = nn.LayerNorm(WIDTH)
            self.head = nn.Linear(WIDTH, VOCAB, bias=False)
            if tie:
                self.head.weight = self.tok.weight
            if arch == "gpt":
                for m in self.modules():
                    if isinstance(m, (nn.Linear, nn.Embedding)):
                        nn.init.normal_(m.weight, 0.0, 0.02)
                    if isinstance(m, nn.Linear) and m.bias is not None:
                        nn.init.zeros_(m.bias)
            self.register_buffer("mask", torch.triu(torch.ones(context, context, dtype=torch.bool), 1),
                                 persistent=False)

        def forward(self, x: Any) -> Any:
            t = x.shape[1]
            h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
            if arch == "encoder":
                h = self.body(h, mask=nn.Transformer.generate_square_subsequent_mask(t), is_causal=True)
            else:
                for block in self.blocks:
                    h = block(h, self.mask[:t, :t])
            return self.head(self.ln(h))

    return Model()


def main(argv: List[str]) -> None:
    a = parse(argv)
    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT / "examples"))
    import data as datasets
    import hvd_gradcomp as gc

    hvd.init()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    model = build_model(a.arch, a.context, a.tie)
    train, val = datasets.load_text(400_000)
    params = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": a.weight_decay},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}] \
        if a.groups else model.parameters()
    opt = torch.optim.AdamW(params, lr=PEAK, weight_decay=a.weight_decay, betas=(0.9, a.beta2),
                            **({"fused": True} if a.fused else {}))
    kw: dict = {"named_parameters": model.named_parameters(), "backward_passes_per_step": max(1, a.micro)}
    if a.wrapper != "none":
        kw["compression"] = gc.TopKQSGD(ratio=0.01, bits=8, seed=a.seed)
    opt = (gc.DistributedOptimizer if a.wrapper == "gc" else hvd.DistributedOptimizer)(opt, **kw)
    acc = gc.GradientAccumulator(opt, steps=a.micro, micro_batch=BATCH // a.micro) if a.micro else None
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    sampler = torch.Generator().manual_seed(100 * a.seed + (0 if a.same_data else hvd.rank()))
    offsets = torch.arange(a.context)
    held_out = torch.randint(0, len(val) - a.context - 1, (256,), generator=torch.Generator().manual_seed(1))

    def loss_of(text: Any, starts: Any) -> Any:
        out = model(text[starts[:, None] + offsets])
        return F.cross_entropy(out.reshape(-1, VOCAB), text[starts[:, None] + offsets + 1].reshape(-1))

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            loss = loss_of(val, held_out).item()
        model.train()
        return loss

    for step in range(a.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, a.steps, a.lr_from_zero)
        if acc is not None:
            for _ in range(a.micro):
                acc.backward(loss_of(train, torch.randint(0, len(train) - a.context - 1, (BATCH // a.micro,),
                                                          generator=sampler)))
        else:
            if a.zero_grad == "start":
                opt.zero_grad()
            loss_of(train, torch.randint(0, len(train) - a.context - 1, (BATCH,), generator=sampler)).backward()
            opt.step()
            if a.zero_grad == "end":
                opt.zero_grad()
        if a.eval_every and step % a.eval_every == 0 and hvd.rank() == 0:
            print(f"step {step} held-out {evaluate():.4f}", flush=True)
    firsts = torch.cat([p.detach().reshape(-1)[:5] for p in model.parameters()])[None]
    every = hvd.allgather(firsts)
    if hvd.rank() == 0:
        print("RESULT " + json.dumps({**vars(a), "params": sum(p.numel() for p in model.parameters()),
                                      "held_out": round(evaluate(), 4),
                                      "replicas_identical": bool((every == every[0]).all())}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
