"""The project's one tolerance policy: how an equivalence test compares a strategy with its reference.

Every equivalence check in every package goes through the helpers below, so "equal to Hugging Face"
means the same thing everywhere, and a bound never depends on which CPU kernels (AVX2, AVX-512, the
thread count) either side happened to use. Each helper computes its *margin* (largest error / bound,
over every element), fails naming the tensor, element index, error and bound, and, when the
environment variable ``DISAGG_MARGIN_LOG`` names a file, appends one JSON line per check
(``{"test", "what", "kind", "margin", "n"}``) so margins can be collected across a run.

Why a per-element bound, and its scale
--------------------------------------
Both sides compute the same real numbers with different rounding: another summation order (a
sharded matmul, a reduce across ranks, another SIMD width or thread split), never another formula.
Rounding error in fp32 (unit roundoff u = 2^-24 ~ 6e-8) of an element ``y_i = sum_k a_k b_k`` is
bounded by ``c * u * sum_k |a_k b_k|`` (Higham, ch. 3; c grows like sqrt(n) for the random-like
rounding of real kernels, n for the worst case). The terms ``|a_k b_k|`` of one tensor come from
the same operands (one weight matrix, one activation), so their size is a property of the *tensor*,
not of the element: an element that is small because its terms cancel carries the same absolute
noise as a large one. Hence every tensor check is

    |got_i - want_i| <= rtol * (|want_i| + max_j |want_j|)        (own scale, per tensor)

The floor is the tensor's *own* largest element, never a global maximum (a global floor would let a
small tensor, e.g. a norm weight's gradient, be wrong by far more than its own size). For a dict of
parameter gradients the "tensor" is the parameter's *module* (its name up to the last dot: a
Linear's weight and bias, a norm's weight and bias): every parameter of a module gets its gradient
from the same backward signal ``delta`` (``dW = sum_t delta_t x_t^T``, ``db = sum_t delta_t``), so
their rounding noise has one scale. This matters for a gradient that cancels to zero in exact
arithmetic: a key bias without RoPE (softmax ignores a shift shared by all keys) has a gradient of
pure noise, ~1e-8 against the key weight's ~0.3 (measured against float64 on the tiny SigLIP); its
own max is noise, so only its module's scale bounds it honestly. Where a module's gradients are
all of one size this is the tensor's own scale. The result is
at least as strict as a whole-tensor relative norm for a single wrong element (a norm hides a few
wrong elements among many right ones; this does not): an error of ``rtol`` relative in any element
within a factor 2 of the tensor's largest is caught.

fp32 bound: ``FP32.rtol = 1e-5`` (~168 u). The compared quantities are compositions of a few
dozen reductions of length <= ~10^3 (tiny models: <= 4 layers, hidden <= 128, vocab <= ~10^3,
sequences <= ~10^2 tokens): c * u with c ~ sqrt(n) * depth stays below 1e-5 on any IEEE-754
binary32 machine, whatever the vector width or thread split, because neither changes the operands'
size, only the order in which rounding happens. The recorded margins (``nox -s kernels``) are
the measurement that backs this.

Losses and grad norms (scalars): ``|got - want| <= rtol * |want|`` (a sum of positive terms, or
a mean of them: no cancellation, so its own size is its scale).

Parameters after AdamW steps, in units of the learning rate
---------------------------------------------------------
AdamW moves element i by ``lr * m_i / (sqrt(v_i) + eps)``: each element is divided by its own
running magnitude, so an element whose gradient is tiny *relative to its tensor* (and therefore
known only to the gradient check's absolute resolution ``2 * rtol * max|g|``) takes a step of up
to ~lr in a direction rounding decides. No relative bound on the parameter holds for it; the bound
that does is the gradient bound carried through Adam, per element:

    |got_i - want_i| <= (2 * steps + 1) * param_unit * |want_i|
                        + lr * sum_t min(2 * R_t, (1 + R_t) * r_i / s_t)
    r_i = 2 * rtol * max|g| / |g_i|      (g: the reference gradient of the element's first step)

* ``(2 * steps + 1) * param_unit * |want_i|``: the rounding of the stored value (the initial cast,
  and each step's decoupled weight decay and update, on both sides; ``FP32.param_unit = 2 * 2^-24``).
* ``r_i``: the relative resolution of element i's gradient *as the gradient check itself allows*:
  the parameter check permits exactly what a passing gradient check implies, no more.
* ``R_t = adam_ratio_limit(t)``: the largest ``|m/sqrt(v)|`` Adam can reach at step t for any
  gradients (Cauchy-Schwarz; 1.00 for t <= 3). A gradient error ``d`` changes ``m/sqrt(v)`` by at
  most ``(1 + R_t) * d / sqrt(v_t)``, and ``sqrt(v_t) >= s_t * |g_1|`` with
  ``s_t = sqrt(b2^(t-1) (1 - b2) / (1 - b2^t))`` (~1/sqrt(t) early on). Two honest runs never
  differ by more than ``2 * R_t`` lr in one step (opposite full steps): that is Adam's hard limit.

An element with a resolved gradient (most of them) is held to a tiny fraction of lr, so one lr in
such an element, or an update applied twice, fails. Elements whose first update the gradient check
cannot resolve (``2 * rtol * max|g| >= |g_i| + eps``; with ``eps = 0``: ``r_i >= 1``, the sign
itself: noise-level elements, e.g. a key bias that only matters through RoPE) get Adam's hard limit:
decided per element from the reference's own gradient, never by name. Their margin is recorded apart
(kind ``... adam-limit``): with ``eps`` negligible, Adam's first step is ``lr * sign(g)``, so a
flipped sign on either side is an error of exactly the limit (margin ~1.0, measured in bf16, where
the resolution is 6% of a module's largest gradient), and no honest run exceeds it. A test that
wants every element held to a bound below the limit runs Adam where its update is Lipschitz in the
gradient (``eps`` above the gradient noise, as the end-to-end configs' ``eps = 1e-3``): then a sign
flip of a noise-level gradient moves the element by ~``|dg| / eps`` lr, and only elements with
``resolution >= |g| + eps`` are left at the limit. Adam's ``eps``, weight decay and clipping only
shrink the sensitivity (clipping scales every element alike, which Adam ignores), so omitting them
keeps the bound safe; passing ``eps`` uses ``sqrt(v_t) + eps >= s_t |g_1| + eps`` in the denominator
(with ``eps = 1e-3``, as the end-to-end configs use, the update is Lipschitz in the gradient). A
parameter absent from ``grads`` got no gradient in the reference: AdamW skips it, so it is held to
the storage term alone (it must not have moved). ``lr`` is the largest learning rate of the steps (a
schedule only lowers it).

bf16
----
bf16 keeps 8 significant bits: ``BF16_EPS = 2^-8``. A stored bf16 value is within half an ulp of
the real one and two nearby reals can round to neighbouring values, one ulp apart: at most
``2 * BF16_EPS * |p|``. Values computed in bf16 (activations, gradients; fp32 accumulation) carry
a few such roundings per layer: ``BF16.rtol = 8 * BF16_EPS`` (3%: ~2 roundings per layer for the
<= 4-layer tiny models, plus the product of the two rounded operands). Parameters after bf16
steps use the same lr-unit rule with ``rtol = BF16.rtol`` and ``param_unit = 2 * BF16_EPS`` (half
an ulp, <= 2^-8 relative, per rounding on each side): an element whose gradient is resolved to a few
percent moves within ~0.2 lr per step of the reference, and a parameter of the usual init scale
(0.02) is stored to ~1e-4, so an update applied twice (a full extra lr) fails.

Bit-exact checks
----------------
These use :func:`assert_exact` (or ``torch.equal``) and stay exact on every CPU:

* resume: a step after loading a checkpoint vs the uninterrupted step (``test_zero_equivalence``'s
  round trip, ``test_run``'s resumed losses), and export round trips (``test_run``,
  ``test_export_manifest``): both sides run the same operations on the same operands in the same
  kind of process on the same machine, so they use the same kernels (the kernel set is chosen per
  process from the CPU and ``ATEN_CPU_CAPABILITY``, identically on both sides) and the same
  reduction order; IEEE-754 arithmetic is deterministic for identical operations on identical
  operands. A save/load or export only moves bits.
* parameters without a gradient (frozen modules, unused layers) and a replayed dropout mask: no
  arithmetic touches them, or the same RNG state produces them.

Two runs that differ in *layout* (another degree, a rebalanced split, another schedule that
reorders sums) are not bit-exact by nature and are compared by the tolerances above, against the
single-process reference wherever one exists.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

FP32_UNIT = 2.0**-24
BF16_EPS = 2.0**-8


@dataclass(frozen=True)
class Precision:
    """Bounds of one arithmetic: ``rtol`` for computed values (losses, logits, gradients);
    ``param_unit`` for stored parameters: per rounding of the stored value (the initial cast and each
    step), the largest relative difference it can put between the two sides (both sides' roundings)."""

    name: str
    rtol: float
    param_unit: float


# ~168 fp32 unit roundoffs: see the module docstring for why this holds on any IEEE binary32 machine.
# A stored fp32 value is rounded by at most 2^-24 relative on each side.
FP32 = Precision("fp32", rtol=1e-5, param_unit=2 * FP32_UNIT)
# 8 bf16 epsilons for computed values; a stored bf16 value is rounded by at most half an ulp, <= 2^-8
# relative, on each side (an fp32 reference rounds 2^16 times finer, within the factor 2).
BF16 = Precision("bf16", rtol=8 * BF16_EPS, param_unit=2 * BF16_EPS)
# bf16 compute with fp32 master weights (core's bf16 rule): bf16 resolution for computed values,
# fp32 rounding for the stored parameters.
BF16_COMPUTE = Precision("bf16 compute, fp32 master weights", rtol=BF16.rtol, param_unit=FP32.param_unit)
#: the bounds of each ``train.precision`` recipe: ``bf16`` computes in bf16 and stores fp32 masters;
#: ``bf16-pure`` also stores bf16 parameters (half an ulp per rounding, as :data:`BF16`)
RECIPE_PRECISION = {"fp32": FP32, "bf16": BF16_COMPUTE, "bf16-pure": BF16}
# A loss (a sum of positive per-token cross-entropies) of two bf16 layouts, at each of a few
# steps: the 2e-2 relative, i.e. 5 bf16 epsilons (2^-8 each). Each token's loss depends on
# logits computed in bf16 whose per-element bound is BF16.rtol of the logits' own scale; summed
# over tokens with no cancellation, the loss's relative error is that of a typical term, and
# later steps add the difference of the parameters (a few lr-units, lr 1e-3): within 5 epsilons.
BF16_LOSS = Precision("bf16 loss over steps", rtol=5 * BF16_EPS, param_unit=BF16.param_unit)


def _log(what: str, kind: str, margin: float, n: int) -> None:
    path = os.environ.get("DISAGG_MARGIN_LOG")
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    rec = {
        "test": test,
        "what": what,
        "kind": kind,
        "margin": margin if math.isfinite(margin) else 1e300,
        "n": n,
    }
    with open(path, "a") as f:  # one short write per line: appends from several processes stay whole lines
        f.write(json.dumps(rec) + "\n")


def _check(
    got: torch.Tensor,
    want: torch.Tensor,
    bound: torch.Tensor,
    what: str,
    kind: str,
    mask: torch.Tensor | None = None,
) -> float:
    """Margin = max |got - want| / bound over the elements (those in ``mask`` if given); fails,
    naming the worst element, above 1."""
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)} != reference {tuple(want.shape)}")
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    n = want.numel() if mask is None else int(mask.sum())
    if n == 0:
        return 0.0
    err = (g - w).abs()
    nan_g, nan_w = torch.isnan(g), torch.isnan(w)
    err = torch.where(nan_g | nan_w, torch.where(nan_g & nan_w, 0.0, math.inf), err)
    b = bound.double().cpu().expand_as(err)
    ratio = torch.where(b > 0, err / b.clamp_min(1e-300), torch.where(err > 0, math.inf, 0.0))
    if mask is not None:
        ratio = torch.where(mask, ratio, -1.0)
    idx = int(ratio.argmax())
    margin = float(ratio.reshape(-1)[idx])
    _log(what, kind, margin, n)
    if not margin <= 1.0:
        pos = tuple(int(i) for i in torch.unravel_index(torch.tensor(idx), err.shape)) if err.dim() else ()
        got_i, want_i = float(g.reshape(-1)[idx]), float(w.reshape(-1)[idx])
        raise AssertionError(
            f"{what}: element {pos}: got {got_i:.9g}, want {want_i:.9g}, "
            f"error {float(err.reshape(-1)[idx]):.3e} > bound {float(b.reshape(-1)[idx]):.3e} "
            f"(margin {margin:.3g}; {kind})"
        )
    return margin


def assert_scalar_close(got: float, want: float, what: str, precision: Precision = FP32) -> float:
    """A loss or grad norm (a sum or mean of positive terms): within ``rtol`` of its own size."""
    w = torch.tensor(float(want), dtype=torch.float64)
    return _check(torch.tensor(float(got), dtype=torch.float64), w, precision.rtol * w.abs(), what, "scalar")


def tensor_bound(want: torch.Tensor, rtol: float, scale: float | None = None) -> torch.Tensor:
    """``rtol * (|want_i| + scale)``, ``scale`` by default the tensor's own largest element."""
    w = want.detach().double().abs()
    if scale is None:
        scale = float(w.max()) if w.numel() else 0.0
    return rtol * (w + scale)


def module_scales(tensors: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Each named parameter's gradient scale: the largest element among the gradients of the
    parameters of its own module (the name up to its last dot; a name without a dot is its own
    module). Module doc: a module's parameters share the backward signal that sets their noise."""
    peak: dict[str, float] = {}
    for name, t in tensors.items():
        group = name.rsplit(".", 1)[0] if "." in name else name
        peak[group] = max(peak.get(group, 0.0), float(t.detach().abs().max()) if t.numel() else 0.0)
    return {name: peak[name.rsplit(".", 1)[0] if "." in name else name] for name in tensors}


def assert_tensor_close(
    got: torch.Tensor, want: torch.Tensor, what: str, precision: Precision = FP32, scale: float | None = None
) -> float:
    """Logits, activations, gradients: per element, against the tensor's own scale (see module doc);
    ``scale`` only for a gradient whose module scale :func:`module_scales` gives."""
    return _check(got, want, tensor_bound(want, precision.rtol, scale), what, f"tensor {precision.name}")


def _same_keys(got: Mapping, want: Mapping, what: str) -> None:
    if set(got) != set(want):
        only_got, only_want = sorted(set(got) - set(want)), sorted(set(want) - set(got))
        raise AssertionError(
            f"{what}: keys differ: only in result {only_got[:10]}, only in reference {only_want[:10]}"
        )


def assert_tensors_close(
    got: Mapping[str, torch.Tensor],
    want: Mapping[str, torch.Tensor],
    what: str = "",
    precision: Precision = FP32,
    partials: Mapping[str, float] | None = None,
) -> float:
    """The same names (a reference ``None`` gradient is absent and must stay absent, never zeros),
    each tensor per element, its floor from its module's scale (:func:`module_scales`: a dict of
    parameter gradients; a name without a dot, e.g. a modality, is its own). ``partials``: per
    name, the largest element of the per-rank partial sums a gradient was summed from (rounded
    each at its own scale, which cancellation can put above the sum's); a module's floor is then
    the larger of the two scales. Returns the largest margin."""
    _same_keys(got, want, what)
    scales = module_scales(want)
    if partials:
        peaks = module_scales({k: torch.tensor([partials.get(k, 0.0)]) for k in want})
        scales = {k: max(scales[k], peaks[k]) for k in want}
    return max(
        (assert_tensor_close(got[k], want[k], f"{what}{k}", precision, scales[k]) for k in want), default=0.0
    )


def adam_ratio_limit(t: int, betas: tuple[float, float]) -> float:
    """The largest ``|m_t / sqrt(v_t)|`` (bias-corrected) AdamW can reach at step ``t``, whatever the
    gradients (Cauchy-Schwarz): 1 at step 1, ~1 for the first steps, (1-b1)/sqrt(1-b2) eventually."""
    b1, b2 = betas
    geo = sum((b1 * b1 / b2) ** j for j in range(t))
    return (1 - b1) / (1 - b1**t) * math.sqrt((1 - b2**t) / (1 - b2) * geo)


def param_bound(
    want: torch.Tensor,
    grad: torch.Tensor | None,
    lr: float,
    steps: int,
    precision: Precision = FP32,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 0.0,
    grad_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-element bound on a parameter after ``steps`` AdamW steps (module doc: lr units), and the
    mask of elements whose gradient sign the gradient check cannot resolve (bound = Adam's limit).
    ``grad_scale``: the gradient check's floor scale (its module's; default the tensor's own)."""
    w = want.detach().double().abs()
    # the initial cast, and each step's decay and update, round the stored value
    bound = (2 * steps + 1) * precision.param_unit * w
    if grad is None or steps == 0:
        return bound, torch.zeros(w.shape, dtype=torch.bool)  # no gradient: AdamW left it alone
    g = grad.detach().double().abs().reshape(w.shape)
    if grad_scale is None:
        grad_scale = float(g.max()) if g.numel() else 0.0
    resolution = 2 * precision.rtol * grad_scale  # the gradient check's absolute bound
    r = torch.where(g > 0, resolution / g.clamp_min(1e-300), math.inf)
    b2 = betas[1]
    for t in range(1, steps + 1):
        limit = adam_ratio_limit(t, betas)
        floor = math.sqrt(b2 ** (t - 1) * (1 - b2) / (1 - b2**t))  # sqrt(v_t) >= floor * |g_1|
        # Adam's eps only enlarges the denominator: sqrt(v_t) + eps >= floor * |g_1| + eps
        sens = (1 + limit) * resolution / (floor * g + eps) if eps > 0 else (1 + limit) * r / floor
        bound = bound + lr * torch.clamp(sens, max=2 * limit)
    # At Adam's hard limit: the first update's sensitivity reaches it, i.e. the gradient check's
    # resolution reaches the update's denominator |g_1| + eps (eps = 0: r_i >= 1, the sign itself)
    return bound, resolution >= g + eps


def assert_params_close(
    got: Mapping[str, torch.Tensor],
    want: Mapping[str, torch.Tensor],
    *,
    lr: float,
    steps: int,
    grads: Mapping[str, torch.Tensor] | None,
    what: str = "",
    precision: Precision = FP32,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 0.0,
    grad_bound: float | None = None,
) -> float:
    """Parameters (a state dict) after ``steps`` AdamW steps at learning rate <= ``lr``.

    ``grads``: the reference's first-step gradients (:func:`first_grads`); a name absent from it
    got no gradient and is held to the storage rounding (it must not have moved). ``grads=None``
    means unknown: every element gets Adam's limit (~2 lr per step), which only catches gross
    errors; pass the gradients wherever the harness has them. Without them, ``grad_bound`` (a bound
    on every gradient element Adam saw, e.g. ``clip_grad_norm``: a clipped gradient's elements are
    at most its norm) and ``eps`` give ``(1 + R_t) * 2 * rtol * grad_bound / eps`` lr per step.
    Buffers (non-parameters in a state
    dict, e.g. rotary tables) are held to the storage rounding. ``betas``/``eps``: the AdamW
    settings (``eps=0`` ignores eps, which is always safe; a large eps, e.g. 1e-3, makes the update
    Lipschitz in the gradient and the bound tighter). ``grads`` may be taken before clipping: a
    clip coefficient c <= 1 turns ``res / (s|g| + eps)`` into ``res / (s|g| + eps / c)``, smaller.
    Returns the largest margin of the elements with a resolved gradient."""
    _same_keys(got, want, what)
    worst = 0.0
    kind = f"param {precision.name} lr-units"
    scales = module_scales(grads) if grads is not None else {}
    for k in want:
        if grads is None:  # unknown gradients: Adam's limit, or the eps-Lipschitz bound if tighter
            bound, _ = param_bound(want[k], None, lr, steps, precision, betas)
            for t in range(1, steps + 1):
                limit = adam_ratio_limit(t, betas)
                per_step = 2 * limit
                if grad_bound is not None and eps > 0:
                    per_step = min(per_step, (1 + limit) * 2 * precision.rtol * grad_bound / eps)
                bound = bound + lr * per_step
            _check(got[k], want[k], bound, f"{what}{k}", kind + " no-grads")
            continue
        bound, unresolved = param_bound(
            want[k], grads.get(k), lr, steps, precision, betas, eps, scales.get(k)
        )
        # Two checks, two margins: elements with a resolved gradient against the propagated bound, the
        # rest against Adam's hard limit (which rounding can reach, but no honest run exceed).
        worst = max(worst, _check(got[k], want[k], bound, f"{what}{k}", kind, ~unresolved))
        _check(got[k], want[k], bound, f"{what}{k}", kind + " adam-limit", unresolved)
    return worst


def first_grads(steps: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each parameter's reference gradient at the first step it got one (the ``grads`` of
    :func:`assert_params_close` for a parameter that first trains at a later step)."""
    out: dict[str, torch.Tensor] = {}
    for step in steps:
        for k, g in step.items():
            out.setdefault(k, g)
    return out


def assert_exact(got: Mapping[str, torch.Tensor] | torch.Tensor, want, what: str = "") -> float:
    """Bit-exact (same kernels on both sides; module doc). Dicts must have the same keys."""
    if isinstance(want, Mapping):
        _same_keys(got, want, what)
        for k in want:
            assert_exact(got[k], want[k], f"{what}{k}")
        return 0.0
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    return _check(got, want, torch.zeros(()), what, "exact")


def reference_precisions(g16: dict[str, torch.Tensor], g32: dict[str, torch.Tensor]) -> dict[str, Precision]:
    """Per gradient tensor: the policy's bf16 bound, unless the reference's own bf16
    gradient is further than that from the same reference's fp32 gradient (a tensor that
    is zero in exact arithmetic, where only rounding is left: a key bias, which softmax
    ignores, e.g. SigLIP's), in which case twice that error, relative to the tensor's own largest element:
    no honest bf16 run can be asked to be closer to the reference than the reference is
    to itself. Decided from the reference alone, per tensor, never by name."""
    out = {}
    for n, g in g16.items():
        scale = float(g.abs().max())
        err = float((g.double() - g32[n].double()).abs().max())
        rtol = max(BF16.rtol, 2 * err / scale) if scale > 0 else BF16.rtol
        name = BF16_COMPUTE.name if rtol == BF16.rtol else f"bf16 at the reference's own error ({err:.1e})"
        out[n] = Precision(name, rtol=rtol, param_unit=FP32.param_unit)
    return out
