"""ZeRO-3 the way DeepSpeed runs it: each submodule's parameters gathered by DeepSpeed's own
hooks around its forward and its backward (with prefetch from the recorded trace, under
``stage3_prefetch_bucket_size``, ``stage3_max_live_parameters``, ``stage3_max_reuse_distance``
and ``stage3_param_persistence_threshold``), and gradients reduce-scattered by its hooks as the
backward produces them. :class:`PerLayerCalls` is the component of
:class:`disagg_zero.strategy.ZeroStrategy` that runs the roles' calls so at stage 3 (the strategy
makes it once DeepSpeed's engine exists and hands it the encoder's and the LLM's calls).

The exactness contract (every rank makes the same collectives in the same order whatever its
samples, an empty rank included; gradients summed once; each element once in the norm) rests
on :mod:`disagg.kit.lockstep`: the ranks agree on their root calls (encoder), samples and loss
chunks (LLM) and the short ones run placeholders whose gradient is exactly zero, so every rank
calls the same submodules in the same order and back-propagates the same graph (its
parameters' gradients, hence DeepSpeed's reduction hooks and buckets, come in the same order).
Which parameters really got a gradient is still recorded per rank and agreed in
``reduce_gradients``; DeepSpeed's reduce-scatter averages, so each parameter's gradient is
scaled by the world size on its way in (a tensor hook: the LLM's embedding gradients, which go
back to the encoders, are not scaled).

``full_state_dict``, ``load_full_state`` and the full gradients keep one whole-module
``GatheredParameters`` (they need every tensor whole); training and evaluation do not.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from disagg.interfaces import EmbeddingShard
from disagg.interfaces.strategy import DEFAULT_CHUNK_TOKENS
from disagg.kit import chunked_loss
from disagg.kit.lockstep import (
    RootCalls,
    agreed_max,
    padded_spans,
    placeholder_sample,
    without_dropout,
)
from disagg_zero import runtime
from disagg_zero.comm import counted

if TYPE_CHECKING:
    from disagg_zero.strategy import ZeroStrategy


class _CallDone(torch.autograd.Function):
    """Identity on one input of one module call; its backward (which runs just before
    DeepSpeed's post-backward function on the same input) sets DeepSpeed's per-module counter
    of pending input gradients to this call's own count, so that DeepSpeed releases the
    module's parameters after each call's backward. DeepSpeed resets the counter at every
    forward call of the module, so a module called several times before its backward (the
    encoder once per sample, the loss head once per chunk) would otherwise stay gathered from
    the backward of its last call to the end of the backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, module: nn.Module, pending: list[int]) -> torch.Tensor:  # type: ignore[override]
        ctx.module, ctx.pending = module, pending
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None]:  # type: ignore[override]
        ctx.pending[0] -= 1
        ctx.module.ds_grads_remaining = ctx.pending[0] + 1  # DeepSpeed's decrement comes next
        return grad, None, None


def _per_call_release(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Forward pre-hook after DeepSpeed's: wrap the inputs it counted (tensors requiring a
    gradient) in :class:`_CallDone`, with this call's count."""
    if not torch.is_grad_enabled():
        return None
    from deepspeed.runtime.zero.utils import apply_to_tensors_only

    found: list[int] = [0]
    apply_to_tensors_only(lambda t: found.__setitem__(0, found[0] + int(t.requires_grad)) or t, list(args))
    if not found[0]:
        return None
    pending = [found[0]]

    def wrap(t: torch.Tensor) -> torch.Tensor:
        return _CallDone.apply(t, module, pending) if t.requires_grad else t

    return tuple(apply_to_tensors_only(wrap, list(args)))


@contextlib.contextmanager
def embeddings_need_grad(module: nn.Module) -> Iterator[None]:
    """Inside the block the LLM's input embeddings (the root call's ``inputs_embeds``, or its
    first floating tensor argument) require a gradient on every rank.

    DeepSpeed fetches a submodule for its backward only where its output requires a gradient.
    With a frozen embedding (LoRA, ``freeze``) that depends on the data: the hidden states
    require one on a rank whose samples scatter encoder rows (leaves that do) and not on a
    text-only or placeholder rank, whose backward then skips the fetches of the frozen linears
    before the first adapter, and the group's gathers no longer line up (gloo aborts on the
    mismatched sizes). Making the embeddings a leaf that requires a gradient gives every rank
    the same backward; its gradient is computed and dropped (the frozen linears' input
    gradients: a frozen base's share of the backward). The hook runs before DeepSpeed's, which
    count the root's inputs that require a gradient."""
    if not torch.is_grad_enabled():
        yield
        return

    def needs_grad(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x = kwargs.get("inputs_embeds")
        if torch.is_tensor(x):
            if x.is_floating_point() and not x.requires_grad:
                return args, {**kwargs, "inputs_embeds": x.detach().requires_grad_(True)}
            return None
        for i, a in enumerate(args):
            if torch.is_tensor(a) and a.is_floating_point():
                if a.requires_grad:
                    return None
                return (*args[:i], a.detach().requires_grad_(True), *args[i + 1 :]), kwargs
        return None

    handle = module.register_forward_pre_hook(needs_grad, prepend=True, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


class PerLayerCalls:
    """The roles' calls under per-layer ZeRO-3 (stage 3 with an engine), for its strategy
    (``owner``: module, engine, family, the language role's loss functions and the step's
    gradient book-keeping); made by the strategy once DeepSpeed's engine exists, which arms
    the per-call release and, with an optimizer, the per-parameter gradient hooks."""

    def __init__(self, owner: ZeroStrategy) -> None:
        self.owner = owner
        #: this rank's last input that made exactly one root call (the fallback placeholder)
        self._one_call: dict[str, torch.Tensor] | None = None
        #: DeepSpeed backwards this step (0 when no rank had a pass in any microbatch)
        self.engine_backwards = 0
        #: inside a placeholder's forward (:func:`without_dropout`; its replays see it too)
        self._quiet = False
        self._hooks: list[Any] = []
        self._arm_call_release()
        if owner.optimizer is not None:
            self._arm_grad_hooks()

    @property
    def module(self) -> nn.Module:
        assert self.owner.module is not None
        return self.owner.module

    @contextlib.contextmanager
    def _placeholder_forward(self) -> Iterator[None]:
        self._quiet = True
        try:
            with without_dropout(self.module):
                yield
        finally:
            self._quiet = False

    def _replay_quiet(self) -> Any:
        """A :class:`disagg.kit.recompute.Recompute` capture: a region recomputed from a
        placeholder's forward replays without dropout too."""
        if not self._quiet:
            return contextlib.nullcontext
        module = self.module
        return lambda: without_dropout(module)

    def _arm_call_release(self) -> None:
        """:func:`_per_call_release` on every submodule DeepSpeed hooks (after its hooks), and
        :func:`disagg_zero.runtime.keep_replayed` on its coordinator."""
        self._hooks += [m.register_forward_pre_hook(_per_call_release) for m in self.module.modules()]
        runtime.keep_replayed(self.owner.engine)
        self.owner.recompute.captures.append(self._replay_quiet)

    def _arm_grad_hooks(self) -> None:
        """Per trainable parameter: note that it got a gradient, and scale it by the world size
        (DeepSpeed's ZeRO-3 reduce-scatter averages; core's loss is already divided by the
        global label count, so the sum is wanted)."""
        self._hooks += [
            p.register_hook(functools.partial(self._grad_in, i)) for i, p in enumerate(self.owner._params)
        ]

    def _grad_in(self, i: int, g: torch.Tensor) -> torch.Tensor:
        # under train.precision bf16 / bf16-pure ``g`` is the microbatch's bf16 gradient: the
        # scale is exact for a power-of-two group (DeepSpeed then divides in fp32 under bf16),
        # one bf16 rounding of the product otherwise
        owner = self.owner
        owner._got[i] = True
        return g * owner._seed_scale if owner._seed_scale != 1.0 else g

    # -- encoder role -----------------------------------------------------------------------------
    def _placeholder_encode(self) -> Any:
        """One root call whose gradient will be zero: the family's placeholder image (one
        black image), or, for a family that cannot preprocess one, this rank's last input
        that made one root call."""
        owner = self.owner
        try:
            image = owner.lockstep.placeholder()
        except Exception as exc:  # before any root call: the peers wait at this rank's vote
            if self._one_call is None:
                raise RuntimeError(
                    f"ZeRO-3 group {owner.ctx.module!r}: rank {owner.ctx.rank} must make a placeholder "
                    f"call but has had no one-call input yet, and family {owner.family.name!r} "
                    f"cannot preprocess the placeholder image: {exc}"
                ) from exc
            image = self._one_call
        with self._placeholder_forward():
            return owner.family.encode(self.module, image)

    def encode(self, mb: int, inputs: list[dict[str, torch.Tensor]]) -> list[EmbeddingShard]:
        owner = self.owner
        roots = RootCalls(self.module, owner.ctx.device, self._placeholder_encode)
        outs = []
        with counted(owner.ctx.comm), roots:
            for x in inputs:
                before = roots.real_calls
                outs.append(owner.family.encode(self.module, x))
                if roots.real_calls - before == 1:
                    self._one_call = x
            owner.lockstep.keep(mb, roots.finish())
        return [EmbeddingShard.whole(o) for o in outs]

    # -- LLM role ---------------------------------------------------------------------------------
    def _padded(
        self, inputs: list[dict[str, torch.Tensor]], embeds: list[dict[str, torch.Tensor]], n: int
    ) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
        extra = n - len(inputs)
        if extra <= 0:
            return list(inputs), list(embeds)
        return list(inputs) + [placeholder_sample(self.owner.family)] * extra, list(embeds) + [{}] * extra

    def loss_and_backward(
        self,
        mb: int,
        inputs: list[dict[str, torch.Tensor]],
        embeds: list[dict[str, torch.Tensor]],
        loss_scale: float,
    ) -> float:
        owner = self.owner
        leaves = [t for e in embeds for t in e.values() if t.requires_grad]
        with counted(owner.ctx.comm):
            n = agreed_max(len(inputs), owner.ctx.device)
            if n == 0:  # no rank has a sample: nothing is called anywhere
                self.backward([], None, leaves)
                return 0.0
            # a rank without samples forwards placeholders only: without dropout (lockstep)
            quiet = self._placeholder_forward() if not inputs else contextlib.nullcontext()
            with quiet:
                loss_sum = self._chunked_loss(*self._padded(inputs, embeds, n))
        self.backward([loss_sum * loss_scale], None, leaves)
        return float(loss_sum.detach())

    def _chunked_loss(
        self, inputs: list[dict[str, torch.Tensor]], embeds: list[dict[str, torch.Tensor]]
    ) -> torch.Tensor:
        """Core's chunked loss (:mod:`disagg.kit.chunked_loss`, the same operations)
        with the group's number of chunks: empty ones past this rank's tokens."""
        owner = self.owner
        head = chunked_loss.output_head(owner.family, self.module)
        if head is None:  # the head runs inside the root call, once per forward
            with embeddings_need_grad(self.module):
                return owner.loss_sum(*owner.llm_forward(inputs, embeds))
        with (
            chunked_loss.deferred(head),
            runtime.without_zero3_hooks(owner.engine, head),
            embeddings_need_grad(self.module),
        ):
            hidden, labels = owner.llm_forward(inputs, embeds)
        spans = padded_spans(hidden.shape[0], self._chunk(), owner.ctx.device)

        def one(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return owner.token_losses(head(h), y)

        if len(spans) == 1:
            return chunked_loss.total(one(hidden, labels), labels)
        parts = [owner.recompute.checkpoint(one, hidden[s:e], labels[s:e]) for s, e in spans]
        return chunked_loss.total(torch.cat(parts), labels)

    def _chunk(self) -> int | None:
        return getattr(self.owner.options, "loss_chunk_tokens", DEFAULT_CHUNK_TOKENS)

    def evaluate(
        self, inputs: list[dict[str, torch.Tensor]], embeds: list[dict[str, torch.Tensor]]
    ) -> tuple[float, int, int]:
        owner = self.owner
        with counted(owner.ctx.comm):
            n = agreed_max(len(inputs), owner.ctx.device)
            if n == 0:
                return 0.0, 0, 0
            inputs, embeds = self._padded(inputs, embeds, n)
            head = chunked_loss.output_head(owner.family, self.module)
            if head is None:
                logits, labels = owner.llm_forward(inputs, embeds)
                loss = owner.loss_sum(logits, labels)
                right = owner.correct_predictions(logits, labels)
            else:
                with chunked_loss.deferred(head), runtime.without_zero3_hooks(owner.engine, head):
                    hidden, labels = owner.llm_forward(inputs, embeds)
                parts, right = [], 0
                for s, e in padded_spans(hidden.shape[0], self._chunk(), owner.ctx.device):
                    logits, y = head(hidden[s:e]), labels[s:e]
                    parts.append(owner.token_losses(logits, y))
                    right += owner.correct_predictions(logits, y)
                loss = chunked_loss.total(torch.cat(parts), labels)
            return float(loss), right, int((labels != -100).sum())

    # -- backward ---------------------------------------------------------------------------------
    def backward(
        self, tensors: list[torch.Tensor], grads: list[torch.Tensor] | None, leaves: list[torch.Tensor]
    ) -> None:
        """One backward of this rank's whole graph for the call: DeepSpeed's hooks gather each
        submodule's parameters before its backward and reduce-scatter gradients as they are
        accumulated. Every rank has the same graph (placeholders included) or none."""
        owner = self.owner
        owner._backwards += 1
        seeds = [t for t in tensors if t.requires_grad]
        if not seeds:
            return  # no pass anywhere in the group (the passes agree)
        if grads is None:
            root = sum(seeds[1:], seeds[0])
        else:
            # d/dt sum(t * g) is g exactly: the seeded backward of torch.autograd.backward(t, g)
            pairs = [(t, g) for t, g in zip(tensors, grads) if t.requires_grad]
            root = sum(((t * g).sum() for t, g in pairs[1:]), (pairs[0][0] * pairs[0][1]).sum())
        with counted(owner.ctx.comm):
            if owner.optimizer is None:
                # frozen (e.g. a frozen LLM sending embedding gradients back): DeepSpeed's
                # module hooks still gather per layer; nothing is reduced
                if leaves:
                    torch.autograd.backward(root, inputs=leaves)
                return
            # what engine.forward() does first (the strategy never calls it): a new micro-step,
            # so ZeRO-3 accumulates into the previous micro-step's gradient partitions
            owner.engine.optimizer.clear_backward_seen_flag()
            owner.engine.set_gradient_accumulation_boundary(False)
            owner.engine.backward(root)
        self.engine_backwards += 1
