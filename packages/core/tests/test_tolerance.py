"""The tolerance policy itself: it catches the errors it claims to (one lr in one parameter element,
1e-4 relative in one gradient element, a bf16 update applied twice) and passes honest rounding noise
(the same computation in another summation order, or in float64 against float32)."""

from __future__ import annotations

import json

import pytest
import torch

from disagg.testing.reference import assert_close_dicts, capture_first_grads
from disagg.testing.tolerance import (
    BF16,
    assert_exact,
    assert_params_close,
    assert_scalar_close,
    assert_tensor_close,
    assert_tensors_close,
    param_bound,
)

LR = 1e-3


def _mlp_step(dtype: torch.dtype, sharded: bool, steps: int = 3, twice: bool = False, seed: int = 0):
    """A small 2-layer MLP trained by AdamW for ``steps`` steps. ``sharded`` computes the same
    loss with the batch split in 4 chunks and the first matmul split over its input dimension (the
    summation orders a data- or tensor-parallel run uses); ``twice`` applies each update twice (a
    strategy's classic bug). Returns first-step gradients and final parameters (as fp32)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 48, generator=g)
    y = torch.randn(64, 8, generator=g)
    model = torch.nn.Sequential(torch.nn.Linear(48, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    model.to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, foreach=False)
    grads = None
    for _ in range(steps):
        opt.zero_grad()
        xs, ys = x.to(dtype), y.to(dtype)
        if not sharded:
            loss = ((model(xs) - ys) ** 2).sum() / 64
        else:
            w, b = model[0].weight, model[0].bias
            loss = 0
            for xc, yc in zip(xs.chunk(4), ys.chunk(4)):
                h = sum(xc[:, i : i + 12] @ w[:, i : i + 12].T for i in range(0, 48, 12)) + b
                loss = loss + ((model[2](torch.tanh(h)) - yc) ** 2).sum()
            loss = loss / 64
        loss.backward()
        if grads is None:
            grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
        for _ in range(2 if twice else 1):
            opt.step()
    params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return float(loss.detach()), grads, params


def test_honest_rounding_noise_passes(tmp_path, monkeypatch):
    log = tmp_path / "margins.jsonl"
    monkeypatch.setenv("DISAGG_MARGIN_LOG", str(log))
    loss_a, g_a, p_a = _mlp_step(torch.float32, sharded=False)
    loss_b, g_b, p_b = _mlp_step(torch.float32, sharded=True)
    loss_d, g_d, p_d = _mlp_step(torch.float64, sharded=False)
    assert any(not torch.equal(g_a[k], g_b[k]) for k in g_a)  # really another rounding, not the same bits
    for got_loss, got_g, got_p in ((loss_b, g_b, p_b), (loss_a, g_a, p_a)):
        assert_scalar_close(got_loss, loss_d, "loss")
        assert_tensors_close(got_g, g_d, "grad ")
        assert_params_close(got_p, p_d, lr=LR, steps=3, grads=g_d, what="param ")
    assert_tensors_close(g_b, g_a, "sharded vs plain grad ")
    assert_params_close(p_b, p_a, lr=LR, steps=3, grads=g_a, what="sharded vs plain param ")
    lines = [json.loads(s) for s in log.read_text().splitlines()]
    assert lines and all(r["margin"] <= 0.5 for r in lines), max(lines, key=lambda r: r["margin"])
    assert lines[0]["test"].endswith("test_honest_rounding_noise_passes")
    assert {"what", "kind", "margin", "n"} <= set(lines[0])


def test_one_lr_in_one_parameter_element_is_caught():
    _, g_d, p_d = _mlp_step(torch.float64, sharded=False)
    _, _, p_a = _mlp_step(torch.float32, sharded=True)
    name = "0.weight"
    idx = int(g_d[name].abs().argmax())  # an element whose gradient the check resolves
    p_a[name].view(-1)[idx] += LR
    with pytest.raises(AssertionError, match=r"param 0\.weight: element \(\d+, \d+\).*> bound"):
        assert_params_close(p_a, p_d, lr=LR, steps=3, grads=g_d, what="param ")
    # Even the element with the median gradient resolves one lr over 3 steps.
    _, _, p_a = _mlp_step(torch.float32, sharded=True)
    med = int(g_d[name].abs().view(-1).argsort()[g_d[name].numel() // 2])
    p_a[name].view(-1)[med] -= LR
    with pytest.raises(AssertionError, match="param 0.weight"):
        assert_params_close(p_a, p_d, lr=LR, steps=3, grads=g_d, what="param ")


def test_parameter_without_reference_gradient_must_not_move():
    _, g_d, p_d = _mlp_step(torch.float64, sharded=False)
    p = {k: v.clone() for k, v in p_d.items()}
    p["2.bias"][0] += LR
    grads = {k: v for k, v in g_d.items() if k != "2.bias"}
    with pytest.raises(AssertionError, match="2.bias"):
        assert_params_close(p, p_d, lr=LR, steps=3, grads=grads)


@pytest.mark.parametrize("name", ["0.weight", "2.bias"])
def test_1e4_relative_in_one_gradient_element_is_caught(name):
    _, g_d, _ = _mlp_step(torch.float64, sharded=False)
    _, g_a, _ = _mlp_step(torch.float32, sharded=True)
    assert_tensors_close(g_a, g_d, "grad ")
    idx = int(g_d[name].abs().argmax())
    g_a[name].view(-1)[idx] = g_d[name].view(-1)[idx] * (1 + 1e-4)
    with pytest.raises(AssertionError, match=f"grad {name}: element"):
        assert_tensors_close(g_a, g_d, "grad ")
    with pytest.raises(AssertionError):  # the old helper delegates to the policy
        assert_close_dicts(g_a, g_d, what="grad ")


def test_bf16_update_applied_twice_is_caught():
    _, g_ref, p_ref = _mlp_step(torch.float32, sharded=False, steps=1)
    _, g_bf, p_bf = _mlp_step(torch.bfloat16, sharded=True, steps=1)
    assert_tensors_close(g_bf, g_ref, "bf16 grad ", BF16)
    assert_params_close(p_bf, p_ref, lr=LR, steps=1, grads=g_ref, what="bf16 param ", precision=BF16)
    _, _, p_twice = _mlp_step(torch.bfloat16, sharded=True, steps=1, twice=True)
    with pytest.raises(AssertionError, match="bf16 param"):
        assert_params_close(p_twice, p_ref, lr=LR, steps=1, grads=g_ref, what="bf16 param ", precision=BF16)


def test_scalar_and_tensor_checks_name_what_failed():
    with pytest.raises(AssertionError, match=r"loss: element \(\): got 1.0001.*bound 1.000e-05"):
        assert_scalar_close(1.0001, 1.0, "loss")
    t = torch.linspace(-1, 1, 12).reshape(3, 4)
    u = t.clone()
    u[2, 1] += 1e-3
    with pytest.raises(AssertionError, match=r"logits: element \(2, 1\)"):
        assert_tensor_close(u, t, "logits")
    with pytest.raises(AssertionError, match="keys differ"):
        assert_tensors_close({"a": t}, {"a": t, "b": t}, "grads ")
    with pytest.raises(AssertionError, match="shape"):
        assert_tensor_close(t[:2], t, "logits")
    nan = t.clone()
    nan[0, 0] = float("nan")
    with pytest.raises(AssertionError):
        assert_tensor_close(nan, t, "logits")


def test_exact_is_bit_exact():
    t = torch.randn(5)
    assert_exact({"a": t}, {"a": t.clone()})
    assert_close_dicts({"a": t}, {"a": t.clone()}, rtol=0, atol=0)
    with pytest.raises(AssertionError, match="exact"):
        assert_exact(t.nextafter(t + 1), t, "resumed")


def test_capture_first_grads_sees_what_the_optimizer_sees():
    """Read-only capture of each parameter's first gradient at the optimizer step, after clipping,
    under every name of a tied weight; a parameter that first trains at step 2 is captured there."""
    lin = torch.nn.Linear(3, 3)
    model = torch.nn.ModuleDict({"a": lin, "b": torch.nn.Linear(3, 1), "tied": lin})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    with capture_first_grads(model) as grads:
        for step in range(2):
            opt.zero_grad(set_to_none=True)
            h = model["a"](x)
            out = model["b"](h).sum() if step == 1 else h.sum()
            out.backward()
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.1)
            if step == 0:
                seen = {k: v.grad.clone() for k, v in lin.named_parameters()}
            opt.step()
    assert set(grads) == {"a.weight", "a.bias", "tied.weight", "tied.bias", "b.weight", "b.bias"}
    assert torch.equal(grads["a.weight"], seen["weight"]) and torch.equal(grads["tied.bias"], seen["bias"])
    assert float(torch.cat([g.view(-1) for k, g in grads.items() if k.startswith("a.")]).norm()) <= 0.1 + 1e-7


def test_eps_and_grad_bound_tighten_the_bound_they_justify():
    _, g_d, p_d = _mlp_step(torch.float64, sharded=False)
    _, _, p_a = _mlp_step(torch.float32, sharded=True)
    loose = param_bound(p_d["0.weight"], g_d["0.weight"], LR, 3)[0]
    tight = param_bound(p_d["0.weight"], g_d["0.weight"], LR, 3, eps=1e-3)[0]
    assert bool((tight <= loose).all()) and bool((tight < loose).any())
    assert_params_close(p_a, p_d, lr=LR, steps=3, grads=g_d, eps=1e-8)
    # no gradients: Adam's limit (~2 lr a step) misses one lr; eps and a gradient bound catch it
    p_a["0.weight"].view(-1)[0] += LR
    assert_params_close(p_a, p_d, lr=LR, steps=3, grads=None)
    with pytest.raises(AssertionError, match="no-grads"):
        assert_params_close(p_a, p_d, lr=LR, steps=3, grads=None, eps=1e-3, grad_bound=1.0)


def _attention_grads(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Gradients of a one-head attention without RoPE: the key bias's gradient is zero in exact
    arithmetic (softmax ignores a shift shared by all keys), so in floating point it is noise."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, 16, generator=g, dtype=torch.float64).to(dtype)
    up = torch.randn(24, 16, generator=g, dtype=torch.float64).to(dtype)
    mods = {k: torch.nn.Linear(16, 16).to(dtype) for k in ("q", "k", "v")}
    for lin in mods.values():
        with torch.no_grad():
            lin.weight.copy_(torch.randn(16, 16, generator=g, dtype=torch.float64) * 0.25)
            lin.bias.copy_(torch.randn(16, generator=g, dtype=torch.float64) * 0.1)
    q, k, v = (mods[n](x) for n in ("q", "k", "v"))
    out = torch.softmax(q @ k.T / 4, dim=-1) @ v
    (out * up).sum().backward()
    return {f"{n}_proj.{p}": getattr(mods[n], p).grad.double() for n in mods for p in ("weight", "bias")}


def test_a_gradient_of_pure_noise_is_bounded_by_its_modules_scale():
    g32, g64 = _attention_grads(torch.float32), _attention_grads(torch.float64)
    bias = g32["k_proj.bias"]
    assert float(g64["k_proj.bias"].abs().max()) < 1e-12 < float(bias.abs().max())  # exact zero vs noise
    assert_tensors_close(g32, g64, "attention grad ")  # its module's (the key weight's) scale bounds it
    with pytest.raises(AssertionError):  # its own scale, the noise itself, cannot
        assert_tensor_close(g32["k_proj.bias"], g64["k_proj.bias"], "k bias alone")
    bad = dict(g32)
    bad["k_proj.bias"] = bias + 1e-4 * float(g64["k_proj.weight"].abs().max())  # a real error is caught
    with pytest.raises(AssertionError, match="k_proj.bias"):
        assert_tensors_close(bad, g64, "attention grad ")
