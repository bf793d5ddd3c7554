"""A strategy's run against the Hugging Face reference, by the suite's tolerance policy
(:mod:`disagg.testing.tolerance`): every check's margin (largest error / bound), and what failed.

- the loss of each step, relative to its own size (``fp32``: 1e-5; ``bf16``: the policy's
  bf16 loss bound, 5 bf16 epsilons);
- each step's gradients per element against their module's scale, at the recipe's bound,
  widened per tensor only where the bf16 reference is itself further than that from the
  float32 reference (:func:`~disagg.testing.tolerance.reference_precisions`);
- the parameters after the last step in units of the learning rate, each element's bound
  from the reference's own first-step gradient (``grads`` given: a skipped or doubled update
  fails, Adam's hard limit only for elements the gradient check cannot resolve).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from disagg.interfaces import OptimSpec
from disagg.testing.tolerance import (
    BF16_LOSS,
    FP32,
    RECIPE_PRECISION,
    Precision,
    assert_params_close,
    assert_scalar_close,
    assert_tensor_close,
    module_scales,
    reference_precisions,
)


def precisions(precision: str, ref: Any, ref32: Any | None) -> dict[str, Precision]:
    """Per parameter, the gradient and parameter bound (module doc)."""
    names = ref.grads[0]
    if precision == "fp32" or ref32 is None:
        return {n: RECIPE_PRECISION[precision] for n in names}
    return reference_precisions(ref.grads[0], ref32.grads[0])


def _margin(fn: Callable[[], float], failures: list[str]) -> float:
    try:
        return float(fn())
    except AssertionError as exc:
        failures.append(str(exc))
        # the policy's message carries the margin that failed; without one, a key or shape mismatch
        found = re.search(r"\(margin ([0-9.e+-]+|inf)", str(exc))
        return float(found.group(1)) if found else float("inf")


def compare(
    got: Any, ref: Any, precision: str, optim: OptimSpec, precs: dict[str, Precision]
) -> dict[str, Any]:
    """``{"margins": {"loss": .., "grads": .., "params": ..}, "failures": [...], "ok": bool}``:
    every check is run (a fault shows which of them see it), the largest margin per kind."""
    failures: list[str] = []
    loss_bound = FP32 if precision == "fp32" else BF16_LOSS
    margins: dict[str, float] = {"loss": 0.0, "grads": 0.0, "params": 0.0}
    if len(got.losses) != len(ref.losses):
        failures.append(f"{len(got.losses)} steps, reference {len(ref.losses)}")
    for t, (a, b) in enumerate(zip(got.losses, ref.losses)):
        m = _margin(
            lambda a=a, b=b, t=t: assert_scalar_close(a, b, f"loss of step {t + 1}", loss_bound), failures
        )
        margins["loss"] = max(margins["loss"], m)
    for t, (g, r) in enumerate(zip(got.grads, ref.grads)):
        if set(g) != set(r):
            failures.append(
                f"step {t + 1} gradients: only in the strategy {sorted(set(g) - set(r))[:5]}, "
                f"only in the reference {sorted(set(r) - set(g))[:5]}"
            )
            margins["grads"] = float("inf")
            continue
        scales = module_scales(r)
        for n in r:
            m = _margin(
                lambda n=n, g=g, r=r, t=t, s=scales: assert_tensor_close(
                    g[n], r[n], f"step {t + 1} grad {n}", precs[n], s[n]
                ),
                failures,
            )
            margins["grads"] = max(margins["grads"], m)
    missing = sorted(set(ref.params) - set(got.params))
    if missing:
        failures.append(f"parameters missing from the strategy's state: {missing[:5]}")
        margins["params"] = float("inf")
    for n in ref.params:
        if n in missing:
            continue
        m = _margin(
            lambda n=n: assert_params_close(
                {n: got.params[n]},
                {n: ref.params[n]},
                lr=optim.lr,
                steps=len(ref.losses),
                grads=ref.grads[0],  # module scales over every gradient, the element's own bound
                what=f"after {len(ref.losses)} steps: ",
                precision=precs.get(n, RECIPE_PRECISION[precision]),
                betas=optim.betas,
                eps=optim.eps,
            ),
            failures,
        )
        margins["params"] = max(margins["params"], m)
    return {"margins": margins, "failures": failures, "ok": not failures}
