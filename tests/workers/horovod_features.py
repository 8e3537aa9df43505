"""Rank-side code of tests/test_horovod_features.py: Horovod's features with both optimizer
wrappers (issue 11), and Horovod 0.28's own optimizer test scenarios rewritten for them.

Every scenario takes ``wrapper`` ("ours": hvd_gradcomp.DistributedOptimizer with
min_compress_numel=1, so even biases are compressed; "stock": hvd.DistributedOptimizer) and
``kind`` (a compressor), and returns JSON-able facts; the assertions live in the test. Each
scenario prefixes its parameter names with its own tag, so that Horovod's tensor names of one
scenario never meet another's.
"""
from __future__ import annotations

import copy
import io
import os
import warnings
from typing import Any, Dict, List

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvd_gradcomp as gc
from hvd_gradcomp.collectives.exchange import JoinNotSupportedError, RankDivergenceError
from tests.workers.integration import batch, make_model

_checks = iter(range(1 << 30))


def all_ranks_equal(t: torch.Tensor) -> bool:
    """Named, unlike integration.all_ranks_equal: Horovod names unnamed ops by a per-process
    handle count, which differs between ranks once a process set excluded one of them."""
    every = hvd.allgather(t.detach().reshape(1, -1).contiguous(), name=f"check.{next(_checks)}")
    return all(torch.equal(every[0], every[r]) for r in range(every.shape[0]))

KINDS = {"qsgd": lambda: gc.QSGD(bits=8, seed=5), "topk": lambda: gc.TopK(ratio=0.05, seed=5),
         "topkqsgd": lambda: gc.TopKQSGD(ratio=0.05, bits=8, seed=5), "none": lambda: None}


def named(model: torch.nn.Module, tag: str):
    return [(f"{tag}.{n}", p) for n, p in model.named_parameters()]


def build(wrapper: str, kind: str, model: torch.nn.Module, tag: str, base: Any = None, comp: Any = "new",
          **kw: Any):
    """(optimizer, compressor) for one scenario."""
    comp = KINDS[kind]() if comp == "new" else comp
    base = base if base is not None else torch.optim.SGD(model.parameters(), lr=0.1)
    if wrapper == "ours":
        opt = gc.DistributedOptimizer(base, named_parameters=named(model, tag), compression=comp,
                                      min_compress_numel=1, **kw)
    else:
        opt = hvd.DistributedOptimizer(base, named_parameters=named(model, tag),
                                       compression=comp if comp is not None else hvd.Compression.none, **kw)
    return opt, comp


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train_step(model, opt, rank: int, step: int) -> None:
    x, y = batch(rank, step)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def comp_snapshot(comp) -> Dict[str, Any]:
    if comp is None:
        return {"residuals": {}, "steps": {}}
    state = comp.state_dict()
    return {"residuals": state["residuals"], "steps": state["steps"]}


def same_snapshot(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    return a["steps"] == b["steps"] and a["residuals"].keys() == b["residuals"].keys() and \
        all(torch.equal(a["residuals"][k], b["residuals"][k]) for k in a["residuals"])


# ---------------------------------------------------------------- GradScaler (case 3)
def gradscaler(wrapper: str, kind: str, tag: str, bad_step: int = 2, steps: int = 5) -> Dict[str, Any]:
    """Horovod's documented GradScaler pattern; at ``bad_step`` rank 1's loss is multiplied by inf."""
    model = make_model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt, comp = build(wrapper, kind, model, tag, base)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    rows = []
    for step in range(steps):
        x, y = batch(hvd.rank(), step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        if step == bad_step and hvd.rank() == 1:
            loss = loss * float("inf")
        snap, params = comp_snapshot(comp), flat_params(model).clone()
        velocity = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters() if p in opt.state]
        scaler.scale(loss).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.synchronize()
        grads_finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scale = scaler.get_scale()
        scaler.update()
        velocity_after = [opt.state[p]["momentum_buffer"] for p in model.parameters() if p in opt.state]
        rows.append({"skipped": scaler.get_scale() < scale, "grads_finite": grads_finite,
                     "warned_not_finite": any("not finite" in str(w.message) for w in caught),
                     "params_unchanged": torch.equal(params, flat_params(model)),
                     "compressor_unchanged": same_snapshot(snap, comp_snapshot(comp)),
                     "velocity_unchanged": len(velocity) == len(velocity_after) > 0 and
                     all(torch.equal(a, b) for a, b in zip(velocity, velocity_after))})
    return {"rows": rows, "params_equal_across_ranks": all_ranks_equal(flat_params(model)),
            "finite": bool(torch.isfinite(flat_params(model)).all())}


# ---------------------------------------------------------------- state broadcast (cases 15, 5)
def rank0_resume(wrapper: str, kind: str, tag: str) -> Dict[str, Any]:
    """Train, save on rank 0, rebuild everything, load on rank 0 only, broadcast, train on."""
    model = make_model()
    opt, _ = build(wrapper, kind, model, tag, torch.optim.Adam(model.parameters(), lr=0.01))
    for step in range(2):
        train_step(model, opt, hvd.rank(), step)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    model = make_model(seed=hvd.rank() + 1)  # ranks start apart: the broadcast must align them
    opt, _ = build(wrapper, kind, model, tag + "r", torch.optim.Adam(model.parameters(), lr=0.01))
    if hvd.rank() == 0:
        buf.seek(0)
        saved = torch.load(buf)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    bytes_after_broadcast = opt.comm_stats.bytes_out if wrapper == "ours" else 0
    state_steps = [float(s["step"]) for s in opt.state_dict()["state"].values()]
    for step in range(2, 4):
        train_step(model, opt, hvd.rank(), step)
    moments = torch.cat([s["exp_avg"].reshape(-1) for s in opt.state_dict()["state"].values()])
    return {"state_steps": state_steps, "bytes_after_broadcast": bytes_after_broadcast,
            "params_equal_across_ranks": all_ranks_equal(flat_params(model)),
            "moments_equal_across_ranks": all_ranks_equal(moments)}


def broadcast_bytes(kind: str, tag: str) -> Dict[str, Any]:
    """Case 5: the bytes of one training step, after Horovod's state-broadcast dummy step."""
    model = make_model()
    opt, comp = build("ours", kind, model, tag, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    after_broadcast = (opt.comm_stats.bytes_out, opt.comm_stats.calls, comp.stats.calls if comp else 0)
    train_step(model, opt, hvd.rank(), 0)
    return {"after_broadcast": after_broadcast, "total": opt.comm_stats.bytes_out,
            "last_step_bytes": opt.last_step_bytes}


# ---------------------------------------------------------------- process sets (case 16)
def process_set_excluding(wrapper: str, kind: str, tag: str) -> Dict[str, Any]:
    """A process set of rank 0 only: rank 1 must train locally, exactly like a plain optimizer."""
    ps = hvd.add_process_set([0])
    try:
        model, ref = make_model(), make_model()
        opt, _ = build(wrapper, kind, model, tag, process_set=ps)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(2):
            train_step(model, opt, hvd.rank(), step)
            train_step(ref, ref_opt, hvd.rank(), step)
        return {"equals_local": torch.equal(flat_params(model), flat_params(ref)),
                "moved": (flat_params(model) - flat_params(make_model())).abs().max().item(),
                "finite": bool(torch.isfinite(flat_params(model)).all())}
    finally:
        hvd.remove_process_set(ps)


# ---------------------------------------------------------------- elastic reset (case 18)
def elastic_reset(wrapper: str, kind: str, tag: str) -> Dict[str, Any]:
    """A HorovodInternalError in the middle of a step (exchanges in flight), then hvd.elastic's
    restore: model.load_state_dict + optimizer.load_state_dict of the last commit; training goes on."""
    model = make_model()
    opt, _ = build(wrapper, kind, model, tag)
    train_step(model, opt, hvd.rank(), 0)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    x, y = batch(hvd.rank(), 1)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()        # exchanges start ... and the step dies here
    hvd.allreduce(torch.zeros(1), name=f"{tag}.barrier")  # every rank has submitted them
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    errors = []
    try:
        for step in range(2, 4):
            train_step(model, opt, hvd.rank(), step)
    except Exception as e:  # noqa: BLE001 (reported to the test)
        errors.append(f"{type(e).__name__}: {e}")
    return {"errors": errors, "params_equal_across_ranks": all_ranks_equal(flat_params(model))}


# ---------------------------------------------------------------- step after synchronize (case 19)
def step_after_synchronize(wrapper: str, kind: str, tag: str) -> Dict[str, Any]:
    model = make_model()
    opt, _ = build(wrapper, kind, model, tag)
    x, y = batch(hvd.rank(), 0)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.synchronize()
    grads = [p.grad.clone() for p in model.parameters()]
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    relevant = [str(w.message) for w in caught if "skip_synchronize" in str(w.message)]
    applied_once = all(torch.allclose(p, b - 0.1 * g) for p, b, g in zip(model.parameters(), before, grads))
    return {"warnings": relevant, "applied_once": applied_once}


# ---------------------------------------------------------------- Horovod's optimizer tests
def dynamic_requires_grad(wrapper: str, kind: str, tag: str) -> Dict[str, Any]:
    """Horovod's test_dynamic_requires_grad: a generator and a discriminator trained in turn."""
    torch.manual_seed(0)
    gen, disc = torch.nn.Conv2d(1, 10, 1), torch.nn.Conv2d(10, 1, 1)
    inp = torch.rand(1, 1, 10, 10, generator=torch.Generator().manual_seed(hvd.rank()))
    gen_opt, _ = build(wrapper, kind, gen, tag + ".gen")
    disc_opt, _ = build(wrapper, kind, disc, tag + ".disc")
    grads_as_expected = True
    for _ in range(3):
        for train_gen in (True, False):
            for p in gen.parameters():
                p.requires_grad_(train_gen)
            for p in disc.parameters():
                p.requires_grad_(not train_gen)
            gen_opt.zero_grad()
            disc_opt.zero_grad()
            disc(gen(inp)).sum().backward()
            for p in gen.parameters():
                grads_as_expected &= train_gen == (p.grad is not None and bool(p.grad.abs().max() > 0))
            for p in disc.parameters():
                grads_as_expected &= (not train_gen) == (p.grad is not None and bool(p.grad.abs().max() > 0))
            (gen_opt if train_gen else disc_opt).step()
    params = torch.cat([flat_params(gen), flat_params(disc)])
    return {"grads_as_expected": grads_as_expected, "params_equal_across_ranks": all_ranks_equal(params)}


def requires_grad_changes(wrapper: str, kind: str, tag: str, at: int = 2, steps: int = 5) -> Dict[str, Any]:
    """Momentum SGD through hvd_gradcomp.DistributedOptimizer (default min_compress_numel: fc1's bias goes
    in the fused allreduce of small tensors, its weight is compressed), classic error feedback:

    * fc1 built frozen (requires_grad=False) and unfrozen at step ``at``, as when fine-tuning, against fc1
      trainable from the start with its output detached before ``at`` (no gradient: exchanged as zeros,
      and zero momentum moves nothing): the same parameters, bit for bit;
    * fc1 trainable, then frozen from step ``at``: it no longer moves, momentum or not, as in PyTorch.
    """
    comp_of = {"topk": lambda: gc.TopK(ratio=0.05, seed=5, feedback="classic"), "none": lambda: None}[kind]

    def run(sub: str, frozen_from_start: bool, detach_before: bool, freeze_at: bool) -> torch.nn.Module:
        model = make_model()
        if frozen_from_start:
            model.fc1.requires_grad_(False)
        opt = gc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                      named_parameters=named(model, f"{tag}.{sub}"), compression=comp_of())
        for step in range(steps):
            if step == at:
                model.fc1.requires_grad_(not freeze_at)
            x, y = batch(hvd.rank(), step)
            h = model.act(model.fc1(x))
            opt.zero_grad()
            F.cross_entropy(model.fc2(h.detach() if detach_before and step < at else h), y).backward()
            opt.step()
            if freeze_at and step == at - 1:
                fc1_when_frozen = flat_params(model.fc1).clone()
        if freeze_at:
            model.fc1_when_frozen = fc1_when_frozen
        return model

    late, ref = run("late", True, False, False), run("ref", False, True, False)
    froze = run("froze", False, False, True)
    return {"late_equals_reference": torch.equal(flat_params(late), flat_params(ref)),
            "late_fc1_moved": not torch.equal(flat_params(late.fc1), flat_params(make_model().fc1)),
            "frozen_fc1_still": torch.equal(flat_params(froze.fc1), froze.fc1_when_frozen),
            "params_equal_across_ranks": all(all_ranks_equal(flat_params(m)) for m in (late, ref, froze))}


def param_group_added_later(wrapper: str, kind: str, tag: str, at: int = 2, steps: int = 4) -> Dict[str, Any]:
    """Progressive unfreezing: the optimizer starts with fc2 only; at step ``at`` fc1 is unfrozen and
    added with its own rate (``add_param_group`` on the wrapped optimizer). Momentum SGD (DGC's correction
    must read the new group's momentum) and AdamW (``frozen`` must know the new parameters), TopKQSGD."""
    out: Dict[str, Any] = {}
    for opt_name in ("sgd", "adamw"):
        model = make_model()
        model.fc1.requires_grad_(False)
        head = list(model.fc2.parameters())
        base = (torch.optim.SGD(head, lr=0.1, momentum=0.9) if opt_name == "sgd" else torch.optim.AdamW(head, lr=1e-3))
        opt = gc.DistributedOptimizer(base, named_parameters=named(model, f"{tag}.{opt_name}"),
                                      compression=gc.TopKQSGD(ratio=0.05, seed=5))
        fc1_before = flat_params(model.fc1).clone()
        for step in range(steps):
            if step == at:
                model.fc1.requires_grad_(True)
                opt.add_param_group({"params": list(model.fc1.parameters()),
                                     "lr": 0.01 if opt_name == "sgd" else 3e-4, "momentum": 0.5} if opt_name == "sgd"
                                    else {"params": list(model.fc1.parameters()), "lr": 3e-4})
            train_step(model, opt, hvd.rank(), step)
        fb = opt.compression.feedback
        name = f"{tag}.{opt_name}.fc1.weight"
        out[opt_name] = {"policy": fb.key, "fc1_moved": not torch.equal(fc1_before, flat_params(model.fc1)),
                         "momentum_read": fb._coefficients(name)[0] if opt_name == "sgd" else None,
                         "bound": not fb.needs_optimizer_state(name) if opt_name == "adamw" else None,
                         "params_equal_across_ranks": all_ranks_equal(flat_params(model))}
        opt.remove_hooks()
    model = make_model()
    opt = gc.DistributedOptimizer(torch.optim.SGD(model.fc2.parameters(), lr=0.1),
                                  named_parameters=named(model.fc2, f"{tag}.only"), compression=None)
    try:
        opt.add_param_group({"params": list(model.fc1.parameters())})
        out["unnamed"] = ""
    except ValueError as e:
        out["unnamed"] = str(e)
    return out


def small_early_after_freeze(wrapper: str, kind: str, tag: str, steps: int = 5) -> Dict[str, Any]:
    """AdamW through TopKQSGD with FrozenVariance(warmup=2): whether the small tensors' fused allreduce
    left during backward (before synchronize()) at each step, dense warm-up and compressed steps alike."""
    model = make_model()
    opt = gc.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), named_parameters=named(model, tag),
                                  compression=gc.TopKQSGD(ratio=0.05, seed=5, feedback=gc.FrozenVariance(warmup=2)))
    early = []
    for step in range(steps):
        x, y = batch(hvd.rank(), step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        early.append(opt._early_fused is not None)
        opt.step()
    return {"early": early, "params_equal_across_ranks": all_ranks_equal(flat_params(model))}


def gradient_clipping(wrapper: str, kind: str, tag: str) -> Dict[str, Any]:
    """synchronize(); clip_grad_norm_(); with skip_synchronize(): step()."""
    model = make_model()
    opt, _ = build(wrapper, kind, model, tag)
    norms = []
    for step in range(2):
        x, y = batch(hvd.rank(), step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
        norms.append(torch.norm(torch.stack([p.grad.norm() for p in model.parameters()])).item())
        with opt.skip_synchronize():
            opt.step()
    return {"norms": norms, "params_equal_across_ranks": all_ranks_equal(flat_params(model))}


class _WithUnused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = make_model()
        self.unused = torch.nn.Linear(4, 4)
        self.rank0_only = torch.nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        return self.rank0_only(out) if hvd.rank() == 0 else out


def unused_parameters(wrapper: str, kind: str, tag: str) -> Dict[str, Any]:
    """Parameters unused everywhere, or used on rank 0 only: zeros are exchanged, nothing hangs."""
    torch.manual_seed(0)
    model = _WithUnused()
    unused_before = flat_params(model.unused).clone()
    opt, _ = build(wrapper, kind, model, tag)
    for step in range(2):
        train_step(model, opt, hvd.rank(), step)
    return {"unused_unchanged": torch.equal(unused_before, flat_params(model.unused)),
            "params_equal_across_ranks": all_ranks_equal(flat_params(model))}


def names(wrapper: str, kind: str, tag: str) -> Dict[str, Any]:
    """Duplicate and missing names are refused at construction; no names at all still trains."""
    model = make_model()
    errors = {}
    params = list(model.named_parameters())
    cases = {"duplicate": [(params[0][0], p) for _, p in params],
             "missing": params[1:]}
    for case, named_params in cases.items():
        try:
            base = torch.optim.SGD(model.parameters(), lr=0.1)
            comp = KINDS[kind]()
            if wrapper == "ours":
                gc.DistributedOptimizer(base, named_parameters=named_params, compression=comp, min_compress_numel=1)
            else:
                hvd.DistributedOptimizer(base, named_parameters=named_params,
                                         compression=comp if comp is not None else hvd.Compression.none)
            errors[case] = None
        except ValueError as e:
            errors[case] = str(e)
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    comp = KINDS[kind]()
    if wrapper == "ours":
        opt = gc.DistributedOptimizer(base, compression=comp, min_compress_numel=1)
    else:
        opt = hvd.DistributedOptimizer(base, compression=comp if comp is not None else hvd.Compression.none)
    train_step(model, opt, hvd.rank(), 0)
    return {"errors": errors, "params_equal_across_ranks": all_ranks_equal(flat_params(model))}


def sparse_embedding(wrapper: str, kind: str, tag: str, sparse_as_dense: bool = False) -> Dict[str, Any]:
    """nn.Embedding(sparse=True): Horovod's sparse allreduce, or dense and compressed."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8, sparse=True), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 3, 4))
    emb_before = model[0].weight.detach().clone()
    opt, _ = build(wrapper, kind, model, tag, sparse_as_dense=sparse_as_dense)
    g = torch.Generator().manual_seed(hvd.rank())
    for _ in range(2):
        idx = torch.randint(0, 50, (5, 3), generator=g)
        opt.zero_grad()
        model(idx).pow(2).mean().backward()
        opt.step()
    return {"params_equal_across_ranks": all_ranks_equal(flat_params(model)),
            "embedding_moved": not torch.equal(emb_before, model[0].weight),
            "grad_is_sparse": model[0].weight.grad.is_sparse}


# ---------------------------------------------------------------- one owner (case 4)
def one_owner(wrapper: str, kind: str, tag: str) -> Dict[str, Any]:
    """One compressor, two optimizers: refused, naming the fix."""
    model_a, model_b = make_model(), make_model(seed=1)
    opt_a, comp = build(wrapper, kind, model_a, tag + ".a")
    train_step(model_a, opt_a, hvd.rank(), 0)
    try:
        opt_b, _ = build(wrapper, kind, model_b, tag + ".b", comp=comp)
        train_step(model_b, opt_b, hvd.rank(), 0)   # the stock path binds at its first exchange
        error = None
    except ValueError as e:
        error = str(e)
    reused = None
    if wrapper == "ours":  # after remove_hooks() the compressor may serve a new optimizer
        opt_a.remove_hooks()
        model_c = make_model(seed=2)
        opt_c, _ = build(wrapper, kind, model_c, tag + ".c", comp=comp)
        train_step(model_c, opt_c, hvd.rank(), 0)
        reused = all_ranks_equal(flat_params(model_c))
    return {"error": error, "reused": reused}


# ---------------------------------------------------------------- divergence
def rank_restarts_alone(wrapper: str, kind: str, tag: str) -> Dict[str, Any]:
    """Rank 1 alone reloads its state mid-run (restarting its step count, as a rank that resumed
    while the others went on would): every rank must stop with a message naming ranks and steps."""
    model = make_model()
    opt, comp = build(wrapper, kind, model, tag)
    for step in range(2):
        train_step(model, opt, hvd.rank(), step)
    if hvd.rank() == 1:
        comp.load_state_dict(comp.state_dict())
    try:
        train_step(model, opt, hvd.rank(), 2)
        error = None
    except RankDivergenceError as e:
        error = str(e)
    return {"error": error}


# ---------------------------------------------------------------- join (case 17)
def join_uneven(wrapper: str, kind: str, tag: str) -> Dict[str, Any]:
    """Rank 0 has 3 batches, rank 1 has 2 and then calls hvd.join(); then the replicas are made alike
    (sync_after_join on ours, Horovod's broadcasts on stock)."""
    model = make_model()
    opt, _ = build(wrapper, kind, model, tag)
    error = None
    for step in range(3 if hvd.rank() == 0 else 2):
        try:
            train_step(model, opt, hvd.rank(), step)
        except JoinNotSupportedError as e:
            error = str(e)
            break
    last = hvd.join()
    if hvd.allreduce(torch.tensor([float(error is not None)]), op=hvd.Sum, name=f"{tag}.failed").item():
        return {"error": error, "replicas_identical": None}
    if wrapper == "ours":
        opt.sync_after_join(last)
    else:
        hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    return {"error": error, "replicas_identical": all_ranks_equal(flat_params(model))}


# ---------------------------------------------------------------- checkpoints (case 6)
def checkpoint_checks(kind: str, tag: str, ckpt_dir: str) -> Dict[str, Any]:
    """GradientAccumulator checkpoints: mid-window refusal, full validation, this rank's stream."""
    out: Dict[str, Any] = {}
    model = make_model()
    opt, comp = build("ours", kind, model, tag, backward_passes_per_step=2)
    acc = gc.GradientAccumulator(opt, steps=2)
    x, y = batch(hvd.rank(), 0)
    acc.backward(F.cross_entropy(model(x), y))
    try:
        acc.state_dict()
    except ValueError as e:
        out["mid_window_save"] = str(e)
    acc.backward(F.cross_entropy(model(x), y))
    state = acc.state_dict()
    torch.save(state, os.path.join(ckpt_dir, f"{tag}-rank{hvd.rank()}.pt"))
    mid = dict(state, pending=1)
    try:
        acc.load_state_dict(mid)
    except ValueError as e:
        out["mid_window_load"] = str(e)

    def fingerprint():
        return (torch.cat([t.reshape(-1) for s in opt.state_dict()["state"].values() for t in s.values()
                           if isinstance(t, torch.Tensor)] or [torch.zeros(1)]),
                comp_snapshot(comp))

    acc.backward(F.cross_entropy(model(x), y))
    acc.backward(F.cross_entropy(model(x), y))      # one more step: state differs from the file
    before = fingerprint()
    broken = copy.deepcopy(state)
    broken["optimizer"]["state"] = {k: {"momentum_buffer": torch.ones(3)} for k in broken["optimizer"]["state"]}
    del broken["compression"]["steps"]
    try:
        acc.load_state_dict(broken)
    except ValueError as e:
        out["malformed"] = str(e)
    other = copy.deepcopy(state)
    other_kind = "TopK" if kind == "qsgd" else "QSGD"
    other["compression"]["kind"], other["compression"]["compressor"] = other_kind, f"{other_kind}(of another run)"
    try:
        acc.load_state_dict(other)
    except ValueError as e:
        out["other_kind"] = str(e)
    after = fingerprint()
    out["unchanged_after_refusals"] = torch.equal(before[0], after[0]) and same_snapshot(before[1], after[1])
    # Rank 1 loads rank 0's file: warned, and it keeps its own stream.
    theirs = torch.load(os.path.join(ckpt_dir, f"{tag}-rank0.pt")) if hvd.rank() == 1 else state
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.load_state_dict(theirs)
    out["stream_warnings"] = [str(w.message) for w in caught if "stream" in str(w.message)]
    out["stream"] = comp.stream
    out["rank"] = hvd.rank()
    return out


def battery(scenarios: List[Dict[str, Any]]) -> List[Any]:
    """Run several scenarios in one job: [{"fn": name, **kwargs}]; the tag is the scenario's index."""
    import faulthandler
    faulthandler.dump_traceback_later(float(os.environ.get("HVDGC_TEST_TRACEBACK_AFTER", 400)), exit=False)
    results = []
    for i, sc in enumerate(scenarios):
        sc = dict(sc)
        fn = globals()[sc.pop("fn")]
        print(f"[rank {hvd.rank()}] s{i} {fn.__name__} {sc}", flush=True)  # on a hang: where it was
        results.append(fn(tag=f"s{i}", **sc))
    return results
