"""Peak memory: micro-batch 4 x 8 accumulation steps against one batch of 32.

    .venv/bin/python benchmarks/bench_accumulation_memory.py [--image 96] [--channels 32]

The model is a small all-convolutional network on large images, so activations (which
grow with the batch) dominate its memory, not parameters (which do not). Each setting runs
in a fresh subprocess; on CUDA the figure is torch.cuda.max_memory_allocated, on CPU the
growth of the process's peak resident set (ru_maxrss) over its state after building the
model. Gradients are identical either way (tests/test_integration.py checks it).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build(channels: int) -> torch.nn.Module:
    layers, c_in = [], 3
    for _ in range(4):
        layers += [torch.nn.Conv2d(c_in, channels, 3, padding=1), torch.nn.ReLU()]
        c_in = channels
    layers += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(channels, 10)]
    return torch.nn.Sequential(*layers)


def measure(micro: int, steps: int, image: int, channels: int) -> dict:
    """One optimizer step over ``steps`` micro-batches of ``micro`` images; peak memory in MiB."""
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build(channels).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    params = sum(p.numel() for p in model.parameters())
    x = torch.randn(micro * steps, 3, image, image, device=device)
    y = torch.randint(0, 10, (micro * steps,), device=device)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    for i in range(steps):
        xb, yb = x[i * micro:(i + 1) * micro], y[i * micro:(i + 1) * micro]
        (torch.nn.functional.cross_entropy(model(xb), yb) / steps).backward()
    opt.step()
    if device.type == "cuda":
        peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    return {"micro": micro, "steps": steps, "peak_mib": peak_mib, "params": params, "device": device.type}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--image", type=int, default=96)
    ap.add_argument("--channels", type=int, default=32)
    ap.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1], args.image, args.channels)))
        return
    rows = []
    for micro, steps in [(32, 1), (4, 8)]:
        out = subprocess.run([sys.executable, __file__, "--image", str(args.image), "--channels", str(args.channels),
                              "--child", str(micro), str(steps)], capture_output=True, text=True, timeout=600,
                             check=True)
        rows.append(json.loads(out.stdout))
    print(f"model: 4 conv layers x {args.channels} channels on {args.image}x{args.image} images, "
          f"{rows[0]['params']:,} parameters ({rows[0]['params'] * 4 / 2**20:.2f} MiB), device {rows[0]['device']}")
    print()
    print("| setting | samples per step | peak memory growth (MiB) |")
    print("| --- | --- | --- |")
    for r in rows:
        print(f"| micro-batch {r['micro']} x {r['steps']} steps | {r['micro'] * r['steps']} | {r['peak_mib']:.0f} |")
    print()
    print(f"accumulation uses {rows[1]['peak_mib'] / rows[0]['peak_mib']:.2f}x the memory of the single batch "
          f"({rows[0]['peak_mib'] / max(rows[1]['peak_mib'], 1e-9):.1f}x less)")


if __name__ == "__main__":
    main()
