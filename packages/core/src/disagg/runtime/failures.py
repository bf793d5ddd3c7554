"""How the driver learns that a rank failed: the first error to arrive wins,
a stall (no call finishing for too long) is an error too, and each failure
names its module and rank, and the collective when one failed, so that
recovery (:mod:`disagg.runtime.recovery`) restarts only for a dead process.
"""

from __future__ import annotations

import re
from typing import Any

import ray


class GroupFailure(RuntimeError):
    """A rank of a module group failed; the message names module and rank, and
    ``collective`` the collective when one failed (timeout, NCCL abort,
    mismatch): a bug or a broken link, not a dead node, so no restart."""

    def __init__(
        self, message: str, module: str | None = None, rank: int | None = None, collective: str | None = None
    ) -> None:
        super().__init__(message)
        self.module, self.rank, self.collective = module, rank, collective


class ActorDied(GroupFailure):
    """A rank's process (or its node) is gone: the run may recover from a checkpoint."""

    def __init__(self, message: str, who: str = "") -> None:
        super().__init__(message)
        self.who = who


def wait_all(refs: list[Any], stall_s: float | None = None) -> list[Any]:
    """``ray.get`` of ``refs`` that raises :class:`GroupFailure` on the first
    error to arrive, naming the ranks that had already finished and those
    still running (a mismatched collective: the first are who skipped it)."""
    pending, finished = list(refs), []
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=stall_s)
        if not ready:
            raise GroupFailure(
                f"no rank finished a call for {stall_s:.0f} s: a rank waits for something that will "
                f"not come (a collective its peers skipped?); still running: {_callers(pending)}"
                + (f"; finished: {_callers(finished)}" if finished else "")
            )
        try:
            ray.get(ready[0])
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            context = f" (finished this phase: {_callers(finished)})" if finished else ""
            raise GroupFailure(
                _last_line(cause) + context,
                getattr(cause, "module", None),
                getattr(cause, "rank", None),
                getattr(cause, "collective", None),
            ) from None
        except ray.exceptions.RayActorError as exc:
            raise actor_failure(exc, _ACTOR_NAMES.get(getattr(exc, "actor_id", None) or "")) from None
        finished += ready
    return ray.get(list(refs))


def actor_failure(exc: BaseException, who: str | None) -> GroupFailure:
    """A rank's process is gone: :class:`ActorDied` (recoverable from a
    checkpoint), unless what killed it was a collective (the NCCL watchdog
    tearing a process down on a timeout): then the same step would fail
    again, and it is a plain :class:`GroupFailure` naming the collective."""
    from disagg.runtime.collectives import collective_name, is_collective_error

    who = who or "an actor of unknown module"
    text = str(exc)
    if is_collective_error(text):
        op = collective_name(text) or "unknown"
        m = re.match(r"module '([^']+)' rank (\d+)", who)
        return GroupFailure(
            f"{who}: its process was aborted by a failed collective {op!r} (NCCL watchdog; a peer "
            f"skipped it, timed out or NCCL failed), not restarted: {_last_line(exc)}",
            m.group(1) if m else None,
            int(m.group(2)) if m else None,
            op,
        )
    return ActorDied(f"{who} died: {_last_line(exc)}", who)


def _callers(refs: list[Any]) -> str:
    """'module 'x' rank n, ...' for the actor calls behind ``refs``."""
    names = []
    for ref in refs:
        try:
            names.append(_ACTOR_NAMES.get(ref.task_id().actor_id().hex(), "?"))
        except Exception:  # a ref not made by an actor task
            continue
    return ", ".join(sorted(set(names))) or "unknown"


#: actor id (hex) -> "module 'x' rank n", so a dead process is reported by name
_ACTOR_NAMES: dict[str, str] = {}


def name_actors(names: dict[str, str]) -> None:
    """Remember each actor id's "module 'x' rank n" (the driver's groups, once started)."""
    _ACTOR_NAMES.update(names)


def _last_line(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    named = [ln for ln in lines if "module '" in ln and "rank" in ln]
    return (named[-1] if named else (lines[-1] if lines else repr(exc))).strip()
