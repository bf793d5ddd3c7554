"""Telling a failed collective from other errors, on gloo and on NCCL.

A rank whose collective times out or fails (a peer skipped it, NCCL broke)
raises in its own call: the error names the module, the rank and the
collective, and it is a :class:`~disagg.runtime.failures.GroupFailure`,
never a dead node, so recovery does not restart into the same failure. NCCL
names the collective in its own words (``OpType=ALLREDUCE``); gloo does not,
so the rank's last counted collective stands in.
"""

from __future__ import annotations

import re

#: NCCL's OpType names -> the names CommCounter counts under
_NCCL_OPS = {
    "ALLREDUCE": "all_reduce",
    "ALLREDUCE_COALESCED": "all_reduce",
    "ALLGATHER": "all_gather",
    "_ALLGATHER_BASE": "all_gather",
    "ALLGATHER_COALESCED": "all_gather",
    "REDUCE_SCATTER": "reduce_scatter",
    "_REDUCE_SCATTER_BASE": "reduce_scatter",
    "ALLTOALL": "all_to_all",
    "ALLTOALL_BASE": "all_to_all",
    "BROADCAST": "broadcast",
    "BARRIER": "barrier",
    "SEND": "send",
    "RECV": "recv",
    "REDUCE": "reduce",
    "GATHER": "gather",
    "SCATTER": "scatter",
}

#: words of torch.distributed's gloo and NCCL errors (timeouts, aborts, watchdog)
_COLLECTIVE_WORDS = re.compile(
    r"NCCL|ncclComm|Watchdog|collective operation timeout|ProcessGroupNCCL|ProcessGroupGloo|"
    r"gloo/|Timed out waiting|Connection closed by peer|communicator was aborted",
    re.IGNORECASE,
)


def is_collective_error(exc: BaseException | str) -> bool:
    """Whether an error (or its text) comes from a collective of torch.distributed."""
    if not isinstance(exc, str):
        try:
            import torch.distributed as dist

            if isinstance(exc, dist.DistError):
                return True
        except (ImportError, AttributeError):
            pass
    return bool(_COLLECTIVE_WORDS.search(str(exc)))


def collective_name(text: str, last_counted: str | None = None) -> str | None:
    """The collective an error is about: NCCL's ``OpType`` when it names one,
    else the rank's last counted collective (gloo's errors do not say)."""
    m = re.search(r"OpType=(\w+)", text)
    if m:
        return _NCCL_OPS.get(m.group(1).upper(), m.group(1).lower())
    return last_counted
