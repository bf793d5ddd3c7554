"""Core's recomputation (``disagg.kit.recompute``) on a tiny Hugging Face decoder.

The traps the strategies rely on it for, one process each: dropout masks from
the default generator and from a strategy's own ``ShardRNG`` (forked inside a
block, or around the whole forward) replayed, the forward's autocast in a
backward that runs outside it, state captured at the forward re-entered around
the replay, collectives counted at forward time not counted again, and the
saved-bytes count (kept inputs, and one block's replay as a peak).
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from torch import nn

from disagg.kit.recompute import Recompute, replaying
from disagg.kit.recompute.activations import saved_bytes_hooks
from disagg.kit.recompute.rng import ShardRNG

HIDDEN, LAYERS, TOKENS = 32, 3, 12


def _model(dropout: float = 0.3) -> nn.Module:
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM

    cfg = Qwen2Config(
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        attention_dropout=dropout,
    )
    cfg._attn_implementation = "eager"  # dropout on the attention probabilities
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).train()


IDS = torch.randint(0, 100, (2, TOKENS), generator=torch.Generator().manual_seed(1))


def _run(mode: str, rec_kw: dict | None = None, wrap=None, autocast: bool = False):  # noqa: ANN001
    """Loss, gradients, saved bytes (sum of adds) and peaks of one forward+backward."""
    model = _model()
    rec = Recompute(mode, **(rec_kw or {}))
    if wrap is not None:
        wrap(model, rec)
    rec.apply_full(model)
    torch.manual_seed(5)
    added, peaks = [], []
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with saved_bytes_hooks(model, added.append, peaks.append), amp:
        out = model(input_ids=IDS, labels=IDS, use_cache=False)
    out.loss.backward()  # outside autocast, as the encoder backward runs
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return float(out.loss.detach()), grads, sum(added), peaks


def _same(a, b) -> None:  # noqa: ANN001
    assert a[0] == b[0]
    for n in a[1]:
        assert torch.equal(a[1][n], b[1][n]), n


def test_full_replays_default_generator_dropout():
    none, full = _run("none"), _run("full")
    _same(full, none)
    assert _run("none", wrap=None)[0] == none[0]
    model = _model()
    torch.manual_seed(6)  # another seed draws other masks: dropout is live
    assert float(model(input_ids=IDS, labels=IDS).loss) != none[0]


def _fork_attention(rng_holder: list, model: nn.Module, rec: Recompute) -> None:
    """A strategy's own stream forked around each attention module (inside a block)."""
    rng = ShardRNG(1234, torch.device("cpu"))
    rng_holder.append(rng)
    for layer in model.model.layers:
        attn = layer.self_attn
        forward = attn.forward

        def forked(*args, _f=forward, **kwargs):  # noqa: ANN002, ANN003
            with rng.fork():
                return _f(*args, **kwargs)

        attn.forward = forked
    rec.rngs.append(rng)


@pytest.mark.parametrize("replay", [True, False])
def test_full_replays_shard_rng_forked_inside_blocks(replay):
    holder: list = []
    none = _run("none", wrap=functools.partial(_fork_attention, []))
    full = _run("full", wrap=functools.partial(_fork_attention, holder))
    if replay:
        _same(full, none)
    else:
        # the check can fail: without the snapshot the replay draws later masks
        holder2: list = []

        def no_replay(model, rec):  # noqa: ANN001
            _fork_attention(holder2, model, rec)
            rec.rngs.clear()

        bad = _run("full", wrap=no_replay)
        assert bad[0] == none[0]  # the forward is the same ...
        assert any(not torch.equal(bad[1][n], none[1][n]) for n in none[1])  # ... its backward is not


def test_full_replays_shard_rng_forked_around_the_whole_forward():
    def around(model, rec):  # noqa: ANN001
        rng = ShardRNG(99, torch.device("cpu"))
        forward = model.forward
        model.forward = lambda *a, **k: _in(rng, forward, *a, **k)
        rec.rngs.append(rng)

    _same(_run("full", wrap=around), _run("none", wrap=around))


def _in(rng: ShardRNG, fn, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
    with rng.fork():
        return fn(*args, **kwargs)


def test_full_replays_the_forwards_autocast():
    none, full = _run("none", autocast=True), _run("full", autocast=True)
    _same(full, none)


def test_captured_state_is_active_during_the_replay_and_counts_skip_it():
    seen: list[tuple[str, bool, bool]] = []
    state = {"v": "forward"}

    def capture():  # noqa: ANN202
        at_forward = state["v"]

        @contextlib.contextmanager
        def restored():  # noqa: ANN202
            previous, state["v"] = state["v"], at_forward
            try:
                yield
            finally:
                state["v"] = previous

        return restored

    def wrap(model, rec):  # noqa: ANN001
        rec.captures.append(capture)
        for layer in model.model.layers:
            mlp = layer.mlp
            forward = mlp.forward

            def spy(x, _f=forward):  # noqa: ANN001
                seen.append((state["v"], replaying()))
                return _f(x)

            mlp.forward = spy

    model = _model()
    rec = Recompute("full")
    wrap(model, rec)
    rec.apply_full(model)
    out = model(input_ids=IDS, labels=IDS, use_cache=False)
    state["v"] = "changed after the forward"
    out.loss.backward()
    assert seen[:LAYERS] == [("forward", False)] * LAYERS
    assert seen[LAYERS:] == [("forward", True)] * LAYERS
    assert state["v"] == "changed after the forward" and not replaying()


def test_saved_bytes_count_kept_inputs_and_one_block_replay():
    _, _, saved_none, peaks_none = _run("none")
    _, _, saved_full, peaks_full = _run("full")
    assert peaks_none == []
    kept = LAYERS * IDS.numel() * HIDDEN * 4  # each block's input, fp32
    # what is held outside the blocks (embedding ids, final norm, logits) is the same
    outside = saved_none - LAYERS * peaks_full[0]
    assert saved_full == kept + outside
    assert len(peaks_full) == LAYERS and len(set(peaks_full)) == 1
    assert 0 < peaks_full[0] < saved_none


def test_unknown_mode_and_a_module_without_blocks_are_refused():
    with pytest.raises(ValueError, match="not one of: none, full, selective"):
        Recompute("fast")
    with pytest.raises(ValueError, match="no Hugging Face gradient-checkpointing layers"):
        Recompute("full").apply_full(nn.Linear(2, 2))
    assert Recompute("none").apply_full(nn.Linear(2, 2)) == 0


@pytest.mark.parametrize("side", [32, 64])  # 1k and 4k vision tokens
def test_saved_bytes_under_full_recompute_are_the_kept_input_figure(side):
    """The tiny Qwen2.5-VL tower (test_cost's config): what a full-recompute forward
    holds (the kept block inputs, patches and merger) plus one block's replay, as
    measured, against the analytic figure (memory.recomputed_activation_bytes)."""
    from test_cost import VISION, shape
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    from disagg.cost import predict

    cfg = Qwen2_5_VLConfig(vision_config=VISION).vision_config
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    tower = Qwen2_5_VisionTransformerPretrainedModel(cfg).train()
    assert Recompute("full").apply_full(tower) == VISION["depth"]
    n = side * side
    added, peaks = [], []
    with saved_bytes_hooks(tower, added.append, peaks.append):
        out = tower(torch.randn(n, 3 * 2 * 4 * 4), grid_thw=torch.tensor([[1, side, side]])).pooler_output
    out.square().sum().backward()
    measured = sum(added) + max(peaks)
    want = predict(shape(), "ddp", 1, 1, n, recompute="full").activation_bytes
    none = predict(shape(), "ddp", 1, 1, n).activation_bytes
    assert abs(measured - want) <= 0.10 * want, (measured, want)
    assert measured < 0.5 * none  # and it is what recomputation saves
