"""What a rank's failure looks like to the driver: a :class:`WorkerError`
naming the module and rank (Ray alone reports an opaque actor id), and the
collective when one failed (timed out, aborted, mismatched), so that recovery
can tell a bug or broken link from a dead process."""

from __future__ import annotations

from typing import Any

from disagg.runtime.collectives import collective_name, is_collective_error


class WorkerError(RuntimeError):
    """An exception inside an actor, with the module and rank that raised it,
    and the collective when one failed (timed out, aborted, mismatched)."""

    def __init__(
        self, message: str, module: str | None = None, rank: int | None = None, collective: str | None = None
    ) -> None:
        super().__init__(message)
        self.module, self.rank, self.collective = module, rank, collective

    def __reduce__(self) -> tuple:  # the attributes survive Ray's pickling to the driver
        return (type(self), (str(self), self.module, self.rank, self.collective))


def worker_error(exc: Exception, module: str, rank: int, comm: Any = None) -> WorkerError:
    """``exc`` as raised by rank ``rank`` of ``module``; ``comm`` (the group's
    counted communicator, if set up) names the last collective when the
    backend's message does not (gloo)."""
    where = f"module {module!r} rank {rank}"
    if not is_collective_error(exc):
        return WorkerError(f"{where}: {type(exc).__name__}: {exc}", module, rank)
    op = collective_name(str(exc), comm.last_op if comm is not None else None)
    return WorkerError(
        f"{where}: collective {op or 'unknown'!r} failed (a peer skipped it, timed out or NCCL "
        f"failed): {type(exc).__name__}: {exc}",
        module,
        rank,
        op or "unknown",
    )
