"""In-process simulator of P ranks, to choose the error-feedback recipe fast (issue 9).

Each batch is split into P shards; each simulated rank has its own policy state; what the
ranks "send" is encoded and decoded by the library's own codecs and averaged, and the
(unmodified) optimizer steps on the result. No Horovod, one process: a run takes seconds.

    PYTHONPATH=. python benchmarks/study/simulate.py --task tf --opt adamw --policies none,classic,ef21 --seeds 0,1

The policies here are the candidates; the one chosen lives in hvd_gradcomp/feedback/__init__.py.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import data as datasets  # noqa: E402

import hvd_gradcomp as gc  # noqa: E402


# ------------------------------------------------------------------ tasks
class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    def __init__(self, vocab=128, d=64, layers=4, heads=4, context=64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)
        self.register_buffer("mask", torch.triu(torch.ones(context, context, dtype=torch.bool), 1))

    def forward(self, x):
        t = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(t))
        for b in self.blocks:
            h = b(h, self.mask[:t, :t])
        return self.head(self.ln(h))


def cnn():
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(512, 128), nn.ReLU(), nn.Linear(128, 10))


def make_task(name, seed):
    g = torch.Generator().manual_seed(seed)
    if name == "tf":
        train, val = datasets.load_text(600_000)
        ctx = 64
        vs = torch.randint(0, len(val) - ctx - 1, (256,), generator=torch.Generator().manual_seed(1))
        vx = val[vs[:, None] + torch.arange(ctx)]
        vy = val[vs[:, None] + torch.arange(ctx) + 1]

        def batch(n):
            s = torch.randint(0, len(train) - ctx - 1, (n,), generator=g)
            return train[s[:, None] + torch.arange(ctx)], train[s[:, None] + torch.arange(ctx) + 1]

        def loss_fn(model, x, y):
            return F.cross_entropy(model(x).reshape(-1, 128), y.reshape(-1))
        torch.manual_seed(seed)
        return CharTransformer(context=ctx), batch, loss_fn, (vx, vy)
    xtr, ytr, xte, yte = datasets.load_digits_split(seed=0)

    def batch(n):
        i = torch.randint(0, len(xtr), (n,), generator=g)
        return xtr[i].view(-1, 1, 8, 8), ytr[i]

    def loss_fn(model, x, y):
        return F.cross_entropy(model(x), y)
    torch.manual_seed(seed)
    return cnn(), batch, loss_fn, (xte.view(-1, 1, 8, 8), yte)


def make_opt(name, params, lr):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


# ------------------------------------------------------------------ policies (per rank, per tensor)
def send(codec, x):
    """What a rank sends for x: (dense tensor of the decoded payload, bytes)."""
    payload = codec.encode(x)
    idx, vals = codec.decode_parts(payload)
    if idx is None:
        return vals.view_as(x), payload.numel()
    out = torch.zeros(x.numel())
    out[idx] = vals
    return out.view_as(x), payload.numel()


class Policy:
    """Per tensor: state for P ranks; __call__(grads of each rank) -> (what the optimizer gets, bytes)."""

    def __init__(self, kind, codec, P, momentum=0.9, eta=0.1):
        self.kind, self.codec, self.P, self.m, self.eta = kind, codec, P, momentum, eta
        self.s = {}

    def st(self, key, like):
        if key not in self.s:
            self.s[key] = torch.zeros_like(like)
        return self.s[key]

    def __call__(self, name, gs):
        k, P = self.kind, self.P
        nbytes = 0
        if k == "none":
            return sum(gs) / P, sum(g.numel() * 4 for g in gs) / P
        sent = []
        for r, g in enumerate(gs):
            key = (name, r)
            if k in ("classic", "noef", "spread", "hold"):
                e = self.st(("e",) + key, g)
                a = g + e if k != "noef" else g
                c, b = send(self.codec, a)
                if k != "noef":
                    e.copy_(a - c)
            elif k in ("ef21", "ef21m"):
                h = self.st(("h",) + key, g)
                if k == "ef21m":
                    v = self.st(("v",) + key, g)
                    v.mul_(1 - self.eta).add_(g, alpha=self.eta)
                    g = v
                c, b = send(self.codec, g - h)
                h.add_(c)
            elif k in ("dgc", "dgcnomask"):
                u = self.st(("u",) + key, g)
                e = self.st(("e",) + key, g)
                u.mul_(self.m).add_(g)
                a = e + u
                c, b = send(self.codec, a)
                e.copy_(a - c)
                if k == "dgc":
                    hit = c != 0
                    u[hit] = 0
                    e[hit] = 0
            else:
                raise ValueError(k)
            sent.append(c)
            nbytes += b
        avg = sum(sent) / P
        if k in ("ef21", "ef21m"):
            G = self.st(("G", name), avg)
            G.add_(avg)
            return G.clone(), nbytes / P
        if k == "spread":
            return self.spread(name, avg), nbytes / P
        if k == "hold":
            return self.hold(name, avg), nbytes / P
        if k in ("dgc", "dgcnomask"):
            prev = self.st(("D", name), avg)
            out = avg - self.m * prev
            prev.copy_(avg)
            return out, nbytes / P
        return avg, nbytes / P


    def spread(self, name, avg):
        """Mass spreading: what arrives for a coordinate after L steps without is applied as a rate
        over the next L steps (exactly the mass that arrived, never more)."""
        R = self.st(("R", name), avg)
        rate = self.st(("rate", name), avg)
        last = self.s.setdefault(("last", name), torch.full_like(avg, -1.0))
        t = self.s[("t", name)] = self.s.get(("t", name), 0) + 1
        hit = avg != 0
        L = t - last[hit]
        R[hit] += avg[hit]
        rate[hit] = R[hit] / L
        last[hit] = t
        out = torch.where(rate.abs() < R.abs(), rate, R)
        R.sub_(out)
        return out


    def hold(self, name, avg):
        """Zero-order hold of the rate: what arrives after L steps without, divided by L, is what the
        optimizer sees every step until the next arrival (a dense, delayed mean-gradient estimate)."""
        rate = self.st(("rate", name), avg)
        last = self.s.setdefault(("last", name), torch.full_like(avg, -1.0))
        t = self.s[("t", name)] = self.s.get(("t", name), 0) + 1
        hit = avg != 0
        rate[hit] = avg[hit] / (t - last[hit])
        last[hit] = t
        return rate.clone()


def make_codec(spec):
    if spec == "topk":
        return gc.TopK(0.01, seed=1)
    if spec.startswith("tq"):
        return gc.TopKQSGD(float(spec[2:]), 8, seed=1)
    if spec.startswith("q"):
        return gc.QSGD(int(spec[1:]), seed=1)
    raise ValueError(spec)


def run(task, optname, policy, codec_spec, seed, steps, lr, batch, P=2, min_numel=1024, warmup=0.1, eta=0.1,
        warm=0.0):
    if policy.startswith("frozen"):
        return run_frozen(task, optname, policy, codec_spec, seed, steps, lr, batch, P, min_numel, warmup, warm)
    if policy == "update":
        return run_update(task, optname, codec_spec, seed, steps, lr, batch, P, min_numel, warmup, warm)
    model, next_batch, loss_fn, (vx, vy) = make_task(task, seed)
    opt = make_opt(optname, model.parameters(), lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(steps, warmup))
    pol = Policy(policy, make_codec(codec_spec) if policy != "none" else None, P, eta=eta)
    params = [(n, p) for n, p in model.named_parameters()]
    late_bytes = late_raw = 0.0
    for step in range(steps):
        if pol.codec is not None:
            set_ratio(pol.codec, codec_spec, step, steps, warm)
        x, y = next_batch(batch * P)
        grads = []
        for r in range(P):
            model.zero_grad()
            loss_fn(model, x[r::P], y[r::P]).backward()
            grads.append([p.grad.detach().clone() for _, p in params])
        for i, (n, p) in enumerate(params):
            gs = [g[i] for g in grads]
            if p.numel() < min_numel:
                p.grad = sum(gs) / P
                b = p.numel() * 4
            else:
                p.grad, b = pol(n, gs)
            if step >= steps // 2:
                late_bytes += b
                late_raw += p.numel() * 4
        opt.step()
        sched.step()
    return evaluate(task, model, vx, vy) + (late_raw / max(late_bytes, 1),)


def lr_lambda(steps, warmup):
    wu = int(warmup * steps)
    return lambda s: (s + 1) / wu if s < wu else 0.5 * (1 + math.cos(math.pi * (s - wu) / max(1, steps - wu)))


def set_ratio(codec, spec, step, steps, warm):
    """DGC sparsity warm-up: ratio falls geometrically from 25% to the target over warm*steps."""
    if not hasattr(codec, "ratio"):
        return
    target = 0.01 if spec == "topk" else float(spec[2:])
    w = int(warm * steps)
    codec.ratio = target if step >= w else 0.25 * (target / 0.25) ** (step / w)


def run_update(task, optname, codec_spec, seed, steps, lr, batch, P, min_numel, warmup, warm=0.0):
    """(d) compress the update: each rank steps its own optimizer (own state) on its own gradient
    from the shared parameters; the parameter deltas go through error feedback and are averaged."""
    import copy
    model, next_batch, loss_fn, (vx, vy) = make_task(task, seed)
    reps = [copy.deepcopy(model) for _ in range(P)]
    opts = [make_opt(optname, m.parameters(), lr) for m in reps]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(steps, warmup)) for o in opts]
    codec = make_codec(codec_spec)
    err = {}
    late_bytes = late_raw = 0.0
    for step in range(steps):
        set_ratio(codec, codec_spec, step, steps, warm)
        x, y = next_batch(batch * P)
        shared = [p.detach().clone() for p in model.parameters()]
        deltas = []
        for r in range(P):
            with torch.no_grad():
                for q, s in zip(reps[r].parameters(), shared):
                    q.copy_(s)
            reps[r].zero_grad()
            loss_fn(reps[r], x[r::P], y[r::P]).backward()
            opts[r].step()
            scheds[r].step()
            deltas.append([q.detach() - s for q, s in zip(reps[r].parameters(), shared)])
        with torch.no_grad():
            for i, (n, p) in enumerate(model.named_parameters()):
                ds = [d[i] for d in deltas]
                if p.numel() < min_numel:
                    avg, b = sum(ds) / P, p.numel() * 4
                else:
                    sent, b = [], 0
                    for r, d in enumerate(ds):
                        e = err.setdefault((n, r), torch.zeros_like(d))
                        a = d + e
                        c, nb = send(codec, a)
                        e.copy_(a - c)
                        sent.append(c)
                        b += nb / P
                    avg = sum(sent) / P
                p.add_(avg)
                if step >= steps // 2:
                    late_bytes += b
                    late_raw += p.numel() * 4
    return evaluate(task, model, vx, vy) + (late_raw / max(late_bytes, 1),)


FLOOR = float(__import__("os").environ.get("FLOOR", "0.1"))


def run_frozen(task, optname, policy, codec_spec, seed, steps, lr, batch, P, min_numel, warmup, warm):
    """1-bit-Adam style: exact (dense) Adam for the first ``warm`` share of the steps, then the
    second moment is frozen and each rank's momentum goes through error feedback.

    policy "frozen": DGC form (each rank keeps its own velocity u_i = b1*u_i + (1-b1)*g_i);
    "frozenw": the same, but top-k and error feedback act on u_i / sqrt(v) (the update direction);
    "frozen1b": 1-bit Adam form (u_i = b1*m_shared + (1-b1)*g_i, m_shared = average sent)."""
    model, next_batch, loss_fn, (vx, vy) = make_task(task, seed)
    opt = make_opt(optname, model.parameters(), lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(steps, warmup))
    codec = make_codec(codec_spec)
    params = list(model.named_parameters())
    W = int(warm * steps)
    st = {}
    late_bytes = late_raw = 0.0
    b1, b2 = opt.param_groups[0]["betas"]
    eps, wd = opt.param_groups[0]["eps"], opt.param_groups[0]["weight_decay"]
    spw = int(float(__import__("os").environ.get("SPW", "0")) * steps)
    target = codec.ratio
    for step in range(steps):
        if spw and step >= W:
            k = step - W
            codec.ratio = target if k >= spw else 0.25 * (target / 0.25) ** (k / spw)
        x, y = next_batch(batch * P)
        grads = []
        for r in range(P):
            model.zero_grad()
            loss_fn(model, x[r::P], y[r::P]).backward()
            grads.append([p.grad.detach().clone() for _, p in params])
        lr_t = opt.param_groups[0]["lr"]
        for i, (n, p) in enumerate(params):
            gs = [g[i] for g in grads]
            if step < W or p.numel() < min_numel:
                p.grad = sum(gs) / P
                b = p.numel() * 4
            else:
                s = opt.state[p]
                if n not in st:   # freeze: take over Adam's moments
                    t = int(s["step"])
                    sv = (s["exp_avg_sq"] / (1 - b2 ** t)).sqrt()
                    st[n] = {"v": sv.clamp(min=FLOOR * sv.mean().item()).add_(eps), "m": s["exp_avg"].clone(),
                             "u": [s["exp_avg"].clone() for _ in range(P)], "e": [torch.zeros_like(p) for _ in range(P)]}
                    s["exp_avg"].zero_()
                z = st[n]
                sent, b = [], 0
                for r, g in enumerate(gs):
                    if policy == "frozen1b":
                        z["u"][r] = z["m"] * b1 + (1 - b1) * g
                    else:
                        z["u"][r].mul_(b1).add_(g, alpha=1 - b1)
                    a = (z["u"][r] / z["v"] if policy == "frozenw" else z["u"][r]) + z["e"][r]
                    c, nb = send(codec, a)
                    z["e"][r] = a - c
                    sent.append(c)
                    b += nb / P
                D = sum(sent) / P
                z["m"] = D
                with torch.no_grad():
                    if optname == "adamw":
                        p.mul_(1 - lr_t * wd)
                    p.add_(D if policy == "frozenw" else D / z["v"], alpha=-lr_t)
                p.grad = torch.zeros_like(p) if optname != "adamw" else None
            if step >= steps // 2:
                late_bytes += b
                late_raw += p.numel() * 4
        opt.step()
        sched.step()
    return evaluate(task, model, vx, vy) + (late_raw / max(late_bytes, 1),)


def evaluate(task, model, vx, vy):
    with torch.no_grad():
        model.eval()
        out = model(vx)
        if task == "tf":
            vl = F.cross_entropy(out.reshape(-1, 128), vy.reshape(-1)).item()
            acc = (out.argmax(-1) == vy).float().mean().item()
        else:
            vl = F.cross_entropy(out, vy).item()
            acc = (out.argmax(-1) == vy).float().mean().item()
    model.train()
    return vl, acc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="tf")
    ap.add_argument("--opt", default="adamw")
    ap.add_argument("--policies", default="none,classic,ef21")
    ap.add_argument("--codecs", default="tq0.01")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--eta", type=float, default=0.1)
    ap.add_argument("--warm", type=float, default=0.0, help="sparsity warm-up, fraction of the steps")
    a = ap.parse_args()
    torch.set_num_threads(1)
    lr = a.lr or {"adamw": 3e-3, "adam": 1e-3, "sgd": 0.05}[a.opt]
    base = {}
    for seed in map(int, a.seeds.split(",")):
        for pol in a.policies.split(","):
            for codec in (a.codecs.split(",") if pol != "none" else ["-"]):
                t0 = time.time()
                vl, acc, ratio = run(a.task, a.opt, pol, codec, seed, a.steps, lr, a.batch, eta=a.eta, warm=a.warm)
                if pol == "none":
                    base[seed] = vl
                gap = (vl / base[seed] - 1) * 100 if seed in base else float("nan")
                print(f"{a.task} {a.opt} warm={a.warm} seed={seed} {pol:10s} {codec:8s} loss={vl:.4f} acc={acc:.3f} "
                      f"gap={gap:+.2f}% bytes_ratio_2nd_half={ratio:.0f}x ({time.time() - t0:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
