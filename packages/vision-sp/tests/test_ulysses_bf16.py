"""ulysses under core's bf16 rule (``compute_dtype``: fp32 parameters, gradients
and optimizer state; the forward autocast to bf16 on the CPU) equals the
single-process Hugging Face LLaVA vision path run under the same rule
(``ulysses_bf16_reference``): every output row and parameter gradient per element within
the policy's bf16 bound, and parameters after the AdamW step in units of the
learning rate, a bound tight enough that a skipped update or one applied twice
fails (shown). Parameters, gradients and optimizer state stay fp32."""

from __future__ import annotations

import pytest
import torch
from ulysses_bf16_reference import BF16_COMPUTE, OPTIM, hf_bf16_step
from ulysses_cases import bf16_rank, loads

from disagg.testing.dist import run_ranks
from disagg.testing.tolerance import BF16, assert_params_close, assert_tensor_close
from disagg_vision_sp.families.llava import LlavaVision
from disagg_vision_sp.testing import assemble, random_images, upstream_grads

SAMPLES = [[(50, 40), (20, 30)], [(64, 64)]]


@pytest.fixture(scope="module")
def bf16_case(tiny_llava):
    family = LlavaVision(tiny_llava)
    inputs = [family.preprocess(random_images(s, seed=i)) for i, s in enumerate(SAMPLES)]
    grads = upstream_grads(family, inputs)
    outs = [loads(r) for r in run_ranks(bf16_rank, 2, 2, str(tiny_llava), inputs, grads)]
    return family, outs, hf_bf16_step(str(tiny_llava), inputs, grads)


def _assert_step_matches(family, ranks: list[dict], ref: dict) -> None:  # noqa: ANN001
    n = len(ref["outs"])
    shards = [
        {"samples": list(range(n)), "shards": [(p, v.float(), t) for p, v, t in r["shards"]]} for r in ranks
    ]
    for i, (o, w) in enumerate(zip(assemble(shards, n, family.hidden_size()), ref["outs"])):
        assert_tensor_close(o, w, f"bf16 output of sample {i}", BF16)
    prec = ref["precisions"]
    for r in ranks:
        assert set(r["grads"]) == set(ref["grads"]), sorted(set(r["grads"]) ^ set(ref["grads"]))
        for k, g in ref["grads"].items():
            assert_tensor_close(r["grads"][k], g, f"bf16 grad {k}", prec[k])
        assert set(r["params"]) == set(ref["params"]), sorted(set(r["params"]) ^ set(ref["params"]))
        for k, want in ref["params"].items():
            g = ref["grads"].get(k)
            assert_params_close(
                {k: r["params"][k]},
                {k: want},
                lr=OPTIM.lr,
                steps=1,
                grads={} if g is None else {k: g},
                what="bf16 ",
                precision=prec.get(k, BF16_COMPUTE),
            )


def test_bf16_step_equals_hf_in_bf16(bf16_case):
    family, outs, ref = bf16_case
    bf16 = [o["bf16"] for o in outs]
    assert sum(o["bf16"]["dot"] for o in outs) != sum(o["fp32"]["dot"] for o in outs), "bf16 must really run"
    for b in bf16:
        assert b["out_dtypes"] == {torch.bfloat16}
        for key in ("param_dtypes", "grad_dtypes", "state_dtypes"):
            assert b[key] == {torch.float32}, key
    _assert_step_matches(family, bf16, ref)


@pytest.mark.parametrize("wrong", ["skipped", "applied twice"])
def test_a_wrong_bf16_update_is_caught(bf16_case, wrong):
    """The same comparison fails for an update that was skipped or applied twice."""
    family, outs, ref = bf16_case
    p0, factor = ref["initial"], (0.0 if wrong == "skipped" else 2.0)
    ranks = [
        {**o["bf16"], "params": {n: p0[n] + factor * (p - p0[n]) for n, p in o["bf16"]["params"].items()}}
        for o in outs
    ]
    with pytest.raises(AssertionError, match="lr-units"):
        _assert_step_matches(family, ranks, ref)
