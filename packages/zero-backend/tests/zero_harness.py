"""Single-process references and per-rank drivers for the ``zero`` equivalence tests.

Rank functions live here (not in the test files) so that spawned ranks can
import them by module name.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from disagg.interfaces import OptimSpec
from disagg.kit.roles.optimizer import make_scheduler
from disagg.testing import ranks
from disagg.testing.reference import reference_adamw
from disagg.testing.tolerance import assert_params_close, first_grads
from disagg.testing.toy import ToyEncoderFamily, ToyLMFamily, toy_samples
from disagg_zero.cost import DEEPSPEED_PERSISTENCE

OPTIM = OptimSpec(
    lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, scheduler="linear", warmup_steps=1, total_steps=4
)
CLIP = 0.5  # small enough that every step clips
STEPS = 3
MICROBATCHES = 2


# -- data -------------------------------------------------------------------------------------------
def llm_batches(world: int, steps: int = STEPS) -> list[list[dict[str, Any]]]:
    """Per step: samples with fixed "encoder" rows as the vision embeddings."""
    out = []
    for s in range(steps):
        samples = toy_samples(2 * world, seed=100 + s, text_only_every=3)
        g = torch.Generator().manual_seed(200 + s)
        for x in samples:
            n = int(x["vision"]["sizes"].sum()) if "vision" in x else 0
            x["embeds"] = {"vision": torch.randn(n, 24, generator=g)} if n else {}
        out.append(samples)
    return out


def encoder_batches(world: int, steps: int = STEPS) -> list[list[dict[str, Any]]]:
    """Per step: samples dealt so that every rank sees the same number of items
    per sample, in the same order (ZeRO-3 gathers per module call, so ranks must
    make the same calls), each with a fixed external output gradient."""
    pool = [x for x in toy_samples(80, seed=7) if "vision" in x]
    by_items = {
        1: [x for x in pool if len(x["vision"]["sizes"]) == 1],
        2: [x for x in pool if len(x["vision"]["sizes"]) == 2],
    }
    out = []
    for s in range(steps):
        samples = []
        for k in range(2):  # two samples per rank: one with 1 item, one with 2
            for _ in range(world):
                samples.append(by_items[1 + (k + s) % 2].pop())
        g = torch.Generator().manual_seed(300 + s)
        for x in samples:
            x["out_grad"] = torch.randn(int(x["vision"]["sizes"].sum()), 24, generator=g) * 0.1
        out.append(samples)
    return out


def label_count(samples: list[dict[str, Any]]) -> int:
    return sum(int((x["llm"]["labels"][1:] != -100).sum()) for x in samples)


def mine(samples: list[Any], rank: int, world: int) -> list[Any]:
    return samples[rank::world]


def split(xs: list[Any], parts: int) -> list[list[Any]]:
    k = math.ceil(len(xs) / parts)
    return [xs[i : i + k] for i in range(0, len(xs), k)]


# -- references -------------------------------------------------------------------------------------
def _ref_step(module: torch.nn.Module, opt: Any, sched: Any, loss: torch.Tensor | None) -> tuple[float, dict]:
    """One reference step; ``loss`` None: a step without samples (no gradient, the optimizer still steps)."""
    opt.zero_grad(set_to_none=True)
    if loss is not None:
        loss.backward()
    # merged gradients are compared before clipping (full_grads runs before step)
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    params = [p for p in module.parameters() if p.requires_grad]
    norm = float(torch.nn.utils.clip_grad_norm_(params, CLIP))
    opt.step()
    sched.step()
    return norm, grads


def _ref_optim(module: torch.nn.Module) -> tuple[Any, Any]:
    opt = reference_adamw(module.parameters(), OPTIM)
    return opt, make_scheduler(opt, OPTIM)


def reference_llm(lm_dir: Path, world: int, steps: int = STEPS) -> dict[str, Any]:
    fam = ToyLMFamily(lm_dir)
    module = fam.build()
    opt, sched = _ref_optim(module)
    out: dict[str, Any] = {"loss": [], "norm": [], "grads": [], "embed_grads": []}
    for samples in llm_batches(world, steps):
        embeds = [{k: v.clone().requires_grad_(True) for k, v in x["embeds"].items()} for x in samples]
        logits, labels = fam.forward(module, [x["llm"] for x in samples], embeds)
        loss = torch.nn.functional.cross_entropy(
            logits, labels, ignore_index=-100, reduction="sum"
        ) / label_count(samples)
        norm, grads = _ref_step(module, opt, sched, loss)
        out["loss"].append(float(loss.detach()))
        out["norm"].append(norm)
        out["grads"].append(grads)
        out["embed_grads"].append([{k: v.grad.clone() for k, v in e.items()} for e in embeds])
    out["params"] = {k: v.detach().clone() for k, v in module.state_dict().items()}
    out["lr"] = opt.param_groups[0]["lr"]
    return out


def reference_encoder(enc_dir: Path, world: int) -> dict[str, Any]:
    fam = ToyEncoderFamily(enc_dir)
    module = fam.build()
    opt, sched = _ref_optim(module)
    out: dict[str, Any] = {"norm": [], "grads": []}
    for samples in encoder_batches(world):
        loss = sum((fam.encode(module, x["vision"]) * x["out_grad"]).sum() for x in samples)
        norm, grads = _ref_step(module, opt, sched, loss)
        out["norm"].append(norm)
        out["grads"].append(grads)
    out["params"] = {k: v.detach().clone() for k, v in module.state_dict().items()}
    out["lr"] = opt.param_groups[0]["lr"]
    return out


def assert_params_match(got: dict[str, torch.Tensor], ref: dict[str, Any], what: str) -> None:
    """Parameters after the reference's steps, by the tolerance policy: lr units per element, each
    element's bound from its first-step reference gradient (``disagg.testing.tolerance``)."""
    grads, steps = first_grads(ref["grads"]), len(ref["grads"])
    betas = OPTIM.betas
    assert_params_close(got, ref["params"], lr=OPTIM.lr, steps=steps, grads=grads, what=what, betas=betas)


def portable(x: Any) -> Any:
    """Tensors -> numpy, recursively: run_ranks pickles results through a
    torch.multiprocessing queue, which shares tensor storage by file
    descriptor and breaks once the rank process has exited."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    if isinstance(x, dict):
        return {k: portable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [portable(v) for v in x]
    return x


def tensors(x: Any) -> Any:
    """Inverse of :func:`portable`."""
    if hasattr(x, "__array__") and not isinstance(x, (dict, list, float, int)):
        return torch.from_numpy(x)
    if isinstance(x, dict):
        return {k: tensors(v) for k, v in x.items()}
    if isinstance(x, list):
        return [tensors(v) for v in x]
    return x


# -- ranks ------------------------------------------------------------------------------------------
def _strategy(
    rank: int, world: int, module: str, family: Any, options: dict[str, Any], optim: OptimSpec | None = OPTIM
) -> Any:
    """``zero`` on one of ``world`` data-parallel ranks (degree 1)."""
    from disagg_zero import ZeroStrategy

    ctx = ranks.rank_context(module, rank, 1, world)
    return ranks.strategy_rank(ZeroStrategy, family, ctx, options=options, optim=optim)


def _finish_step(strat: Any, rec: dict[str, Any]) -> None:
    nsq = ranks.reduce(strat)
    rec["norm"].append(math.sqrt(nsq))
    rec["grads"].append(ranks.full_grads(strat))
    ranks.step(strat, nsq, CLIP, zero_grad=False)
    # the accounting the bench reports, read where the worker reads it (after the step)
    rec.setdefault("calls", []).append(strat.ctx.comm.calls())
    rec.setdefault("comm", []).append(strat.ctx.comm.reset())
    rec.setdefault("state_bytes", []).append(ranks.state_bytes(strat))
    ranks.zero_grad(strat)


def rank_llm(
    rank: int, lm_dir: Path, world: int, options: dict[str, Any], sharded: Path | None = None
) -> dict[str, Any]:
    """The toy LM's steps; ``sharded``: a sharded checkpoint saved there before the last step
    and resumed from (:func:`resume_sharded`)."""
    fam = ToyLMFamily(lm_dir)
    strat = _strategy(rank, world, "llm", fam, options)
    rec: dict[str, Any] = {"loss_sum": [], "norm": [], "grads": [], "embed_grads": []}
    batches = llm_batches(world)
    for step, samples in enumerate(batches):
        if sharded is not None and step == len(batches) - 1:
            schedule = _save(strat, sharded)
            saved = {"saved": _state(strat), "file": (sharded / f"__{rank}_0.distcp").stat().st_size}
        _llm_step(strat, samples, rank, world, rec)
    rec["params"] = ranks.full_state(strat)
    rec["lr"] = ranks.current_lr(strat)
    if sharded is not None:
        rec["sharded"] = {**saved, "uninterrupted": _state(strat)}
        rec["sharded"].update(resume_sharded(rank, fam, world, options, sharded, schedule, strat))
    return portable(rec)


def rank_encoder(rank: int, enc_dir: Path, world: int, options: dict[str, Any]) -> dict[str, Any]:
    fam = ToyEncoderFamily(enc_dir)
    strat = _strategy(rank, world, "vision", fam, options)
    rec: dict[str, Any] = {"norm": [], "grads": []}
    for samples in encoder_batches(world):
        for part in split(mine(samples, rank, world), MICROBATCHES):
            shards = ranks.encode(strat, 0, [x["vision"] for x in part])
            for s, x in zip(shards, part):
                assert s.total == x["out_grad"].shape[0] and s.positions.tolist() == list(range(s.total))
            ranks.backward(strat, 0, shards, [x["out_grad"] for x in part])
        _finish_step(strat, rec)
    rec["params"] = ranks.full_state(strat)
    rec["lr"] = ranks.current_lr(strat)
    return portable(rec)


# -- accounting -------------------------------------------------------------------------------------
def assert_accounting(
    rec: dict[str, Any],
    named: list[tuple[str, tuple[int, ...]]],
    stage: int,
    world: int,
    microbatches: list[int],
    persistence_threshold: int = DEEPSPEED_PERSISTENCE,
    uses: list[list[int]] | None = None,
    votes: list[int] | None = None,
    reuse: bool = False,
    unreduced: tuple[str, ...] = (),
) -> None:
    """What ``zero`` reported after each step (``_finish_step``) equals its own
    cost formulas (:mod:`disagg_zero.cost`): the bytes DeepSpeed's storages hold (up to per-tensor
    scalars: step counters, norms), and DeepSpeed's collectives as they ran
    (counted by wrapping ``torch.distributed``, ``disagg_zero.comm``): the
    calls and sent bytes of every kind equal ``zero_calls`` and ``zero_comm``.
    ``microbatches``: per step, how many the rank ran (0: a step without
    samples gathers and updates nothing, so only the state is checked).

    Stage 3 (per-layer gathering): ``uses[step][i]`` gathers of tensor ``i`` and ``votes[step]``
    agreement all-reduces in that step. Gathers and reduce-scatters are exact when nothing is
    kept for reuse nor prefetched (``reuse`` False: the tests' threshold, prefetch and reuse
    0), at most the model's otherwise; the all-reduces are at least the model's, DeepSpeed's
    trace checks (all-reduces and broadcasts while it records) coming on top (the cost
    module's docstring). ``unreduced``: tensors that never get a gradient, which stage 3's
    per-layer backward never reduces (DeepSpeed's hooks fire for gradients only)."""
    from disagg.interfaces.cost import ParamTensor, Workload
    from disagg_zero.cost import zero_calls, zero_comm, zero_state_bytes

    tensors = [ParamTensor(n, s) for n, s in named]
    numels = [t.numel for t in tensors]
    state = zero_state_bytes(numels, stage, world, persistence_threshold)
    for step, m in enumerate(microbatches):
        got = rec["state_bytes"][step]
        assert 0 <= got - state <= 16 + 8 * len(numels), f"step {step}: {got} vs {state}"
        if not m:
            continue
        work = Workload(degree=1, replicas=world, seq_len=1, samples=world, microbatches=m)
        u = None if stage < 3 else uses[step]  # type: ignore[index]
        v = 0 if stage < 3 else votes[step]  # type: ignore[index]
        want = zero_comm(numels, stage, work, persistence_threshold, u, v)
        calls = zero_calls(tensors, stage, work, persistence_threshold=persistence_threshold, uses=u, votes=v)
        got_bytes, got_calls = rec["comm"][step], rec["calls"][step]
        where = f"step {step}: measured {got_bytes} in {got_calls}, model {want} in {calls}"
        if stage < 3:
            assert got_bytes == want and got_calls == calls, where
            continue
        assert set(got_bytes) <= set(want) | {"broadcast"}, where
        kind = "reduce_scatter"
        reduced = [k for (n, _), k in zip(named, numels) if n not in unreduced]
        want_rs = zero_comm(reduced, stage, work, persistence_threshold, [0] * len(reduced))[kind]
        assert got_bytes[kind] == want_rs and got_calls[kind] == calls[kind], where
        kind = "all_gather"
        if reuse:
            # fewer gathers for what is kept or prefetched; tensors under the persistence
            # threshold DeepSpeed may gather again at any fetch (measured, not modelled)
            persistent = [k for k in numels if k <= persistence_threshold]
            fetches = max(uses[step])  # type: ignore[index]
            extra = fetches * sum((world - 1) * -(-k // world) * 4 for k in persistent)
            assert got_bytes[kind] <= want[kind] + extra, where
            assert got_calls[kind] <= calls[kind] + fetches * len(persistent), where
        else:
            assert got_bytes[kind] == want[kind] and got_calls[kind] == calls[kind], where
        kind = "all_reduce"
        assert got_bytes[kind] >= want[kind] and got_calls[kind] >= calls[kind], where


# -- one spawn per world size: every configuration in the same ranks ----------------------------
#: ZeRO-3 as the tests run it: every tensor partitioned, gathered per submodule with nothing
#: prefetched or kept for reuse, so each fetch is one gather (exact accounting)
PER_LAYER = {
    "stage3_param_persistence_threshold": 0,
    "stage3_prefetch_bucket_size": 0,
    "stage3_max_reuse_distance": 0,
}


def configs(world: int) -> dict[str, dict[str, Any]]:
    """Label -> options. Stage 3 partitions every parameter (no persistence
    threshold), so the gathering hooks run on the tiny toy modules too."""
    z3 = {"zero_optimization": PER_LAYER}
    out = {"1": {"stage": 1}, "2": {"stage": 2}, "3": {"stage": 3, "ds_config": z3}}
    if world == 2:
        out["2-offload"] = {"stage": 2, "offload_optimizer": True}
        out["3-offload"] = {"stage": 3, "offload_optimizer": True, "ds_config": z3}
    return out


def rank_all(rank: int, enc_dir: Path, lm_dir: Path, world: int, ckpt_root: Path | None) -> dict[str, Any]:
    out = {}
    for label, options in configs(world).items():
        out[label] = {
            "llm": rank_llm(rank, lm_dir, world, options, sharded_ckpt(ckpt_root, label)),
            "encoder": rank_encoder(rank, enc_dir, world, options),
        }
        if ckpt_root is not None and label in ("2", "3"):
            out[label]["checkpoint"] = checkpoint_roundtrip(
                rank, lm_dir, world, options, Path(ckpt_root) / label
            )
    return out


def checkpoint_roundtrip(
    rank: int, lm_dir: Path, world: int, options: dict[str, Any], path: Path
) -> dict[str, Any]:
    """Train 2 steps, save, train a 3rd; a fresh strategy that loads the
    checkpoint and trains the same 3rd step must end identical. Saved and loaded the
    way core's checkpoint does it (this rank's ``sharded_state`` pieces through DCP,
    the schedule beside them)."""
    fam = ToyLMFamily(lm_dir)
    batches = llm_batches(world)

    def one_step(strat: Any, samples: list[dict[str, Any]]) -> None:
        n = label_count(samples)
        part = mine(list(range(len(samples))), rank, world)
        embeds = ranks.leaves([samples[i]["embeds"] for i in part])
        ranks.loss_and_backward(strat, 0, [samples[i]["llm"] for i in part], embeds, 1.0 / n)
        ranks.step(strat, ranks.reduce(strat), CLIP)

    a = _strategy(rank, world, "llm", fam, options)
    one_step(a, batches[0])
    one_step(a, batches[1])
    schedule = _save(a, path)
    saved = ranks.full_state(a)
    one_step(a, batches[2])
    b = _strategy(rank, world, "llm", fam, options)
    _resume(b, path, schedule)
    loaded = ranks.full_state(b)
    lr_loaded = ranks.current_lr(b)
    one_step(b, batches[2])
    return portable(
        {
            "saved": saved,
            "loaded": loaded,
            "after_a": ranks.full_state(a),
            "after_b": ranks.full_state(b),
            "lr_a": ranks.current_lr(a),
            "lr_b": ranks.current_lr(b),
            "lr_loaded": lr_loaded,
        }
    )


def sharded_ckpt(ckpt_root: Path | None, label: str) -> Path | None:
    """Where the LLM of stage ``label`` saves its sharded checkpoint (stages 1-3 of the 2-rank set)."""
    return (
        Path(ckpt_root) / f"sharded-{label}" if ckpt_root is not None and label in ("1", "2", "3") else None
    )


def _llm_step(strat: Any, samples: list[dict[str, Any]], rank: int, world: int, rec: dict[str, Any]) -> None:
    """One step of :func:`rank_llm` (its microbatches of this rank's samples), recorded in ``rec``."""
    n = label_count(samples)
    idx = list(range(len(samples)))
    loss_sum, egrads = 0.0, {}
    for part in split(mine(idx, rank, world), MICROBATCHES):
        embeds = ranks.leaves([samples[i]["embeds"] for i in part])
        loss_sum += ranks.loss_and_backward(strat, 0, [samples[i]["llm"] for i in part], embeds, 1.0 / n)
        egrads.update({i: {k: v.grad.clone() for k, v in e.items()} for i, e in zip(part, embeds)})
    rec.setdefault("loss_sum", []).append(loss_sum)
    rec.setdefault("embed_grads", []).append(egrads)
    _finish_step(strat, rec)


def _state(strat: Any) -> dict[str, torch.Tensor]:
    """Merged parameters and AdamW state, one flat dict (a sharded checkpoint's names)."""
    out = {f"param/{k}": v for k, v in ranks.full_state(strat).items()}
    for name, st in strat.full_optimizer_state().items():
        out.update({f"optim/{name}/{k}": v for k, v in st.items()})
    return out


def _ddp(rank: int, world: int, fam: Any) -> Any:
    from disagg.builtin.ddp import DDPStrategy

    return ranks.strategy_rank(DDPStrategy, fam, ranks.rank_context("llm", rank, 1, world), optim=OPTIM)


def _save(strat: Any, where: Path) -> dict[str, Any]:
    """This rank's pieces into the DCP dir ``where`` (collective); the schedule, which core's
    checkpoint keeps beside them (``schedule.json``), returned."""
    from disagg.kit.checkpoint import save_pieces

    save_pieces(strat.sharded_state(), where)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in strat.optimizer.param_groups]
    return {"scheduler": strat.scheduler.state_dict(), "param_groups": groups}


def _resume(strat: Any, where: Path, schedule: dict[str, Any]) -> Any:
    """``strat`` filled from the sharded checkpoint ``where`` as core's worker fills it: its
    own pieces through DCP (collective), the schedule, then ``refresh_weights``. Returns the
    tensor bytes this rank read."""
    from disagg.kit.checkpoint import load_pieces

    read = load_pieces(strat.sharded_state, where, str(where))
    _set_schedule(strat, schedule)
    strat.refresh_weights()
    return read


def _set_schedule(strat: Any, schedule: dict[str, Any]) -> None:
    strat.scheduler.load_state_dict(schedule["scheduler"])
    for group, saved in zip(strat.optimizer.param_groups, schedule["param_groups"]):
        group.update(saved)


def resume_sharded(
    rank: int, fam: Any, world: int, options: dict[str, Any], path: Path, schedule: dict, first: Any
) -> dict[str, Any]:
    """A fresh group of the same layout resumes from the sharded checkpoint ``path`` (saved by
    ``first`` before its last step) and takes the same last step; then takes the same state in
    the full form (``load_full_state``) and the last step again. Stage 3 reshards both ways
    too: ``ddp`` resumes from it and takes the last step, then saves, and the resumed zero group
    resumes from that (a load over a trained state) and both take a 4th step."""
    batches = llm_batches(world)
    b = _strategy(rank, world, "llm", fam, options)
    out: dict[str, Any] = {"read": _resume(b, path, schedule), "loaded": _state(b)}
    rec: dict[str, Any] = {"norm": [], "grads": []}
    _llm_step(b, batches[-1], rank, world, rec)
    out["resumed"], out["lr"] = _state(b), (ranks.current_lr(b), ranks.current_lr(first))
    # the same state in the full form (``checkpoint.format: full``), over the stepped one
    saved = out["loaded"]
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in saved.items():
        if k.startswith("optim/"):
            name, _, key = k[len("optim/") :].rpartition("/")
            optim.setdefault(name, {})[key] = v
    b.load_full_state({k[6:]: v for k, v in saved.items() if k.startswith("param/")}, optim)
    _set_schedule(b, schedule)
    b.refresh_weights()
    out["full/loaded"] = _state(b)
    _llm_step(b, batches[-1], rank, world, {"norm": [], "grads": []})
    out["full/resumed"] = _state(b)
    if options["stage"] != 3:
        return out
    d = _ddp(rank, world, fam)
    _resume(d, path, schedule)
    out["ddp/loaded"] = _state(d)
    ddp: dict[str, Any] = {"norm": [], "grads": []}
    _llm_step(d, batches[-1], rank, world, ddp)
    out["ddp/stepped"] = _state(d)
    _resume(b, path / "ddp", _save(d, path / "ddp"))
    out["ddp->zero/loaded"] = _state(b)
    for strat, r in ((b, rec), (d, ddp)):
        _llm_step(strat, batches[0], rank, world, r)
    out["ddp->zero/stepped"], out["ddp/stepped4"] = _state(b), _state(d)
    out["grads"] = {"zero": rec["grads"], "ddp": ddp["grads"]}
    return out
