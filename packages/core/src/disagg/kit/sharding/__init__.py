"""``parallel.<module>.shard``: a replicated strategy's state sharded over its group
(``ddp``, ``ulysses``), ZeRO semantics over all ``degree x replicas`` ranks.

- ``optimizer`` (ZeRO-1): torch's ``ZeroRedundancyOptimizer`` around AdamW. Each rank keeps
  the AdamW moments of its partition (whole parameters, balanced by size) and steps them;
  the updated parameters are broadcast from their owners. Parameters and gradients stay
  whole on every rank (gradients summed by the default reduction, norm of whole gradients).
- ``gradients`` (ZeRO-2) and ``parameters`` (ZeRO-3): torch FSDP2, one unit per block
  (:mod:`disagg.kit.sharding.fsdp`); gradients reduce-scattered (summed) in backward, AdamW
  on the shards, the norm summed over the shards (each element once).

Per rank, with P elements of fp32 state and N ranks: ``none`` 16P; ``optimizer`` 8P + 8P/N
(the moments of its partition); ``gradients`` 4P + 12P/N (the whole parameters are held from
a forward to its backward); ``parameters`` 16P/N plus one block gathered at a time.

FSDP's all-gathers follow the module's forwards, so every rank of the group must run the same
forwards: a rank with fewer samples than another in a microbatch (none included) runs
:func:`placeholder_input` forwards whose output gradient is zero (they add exact zeros), by
:mod:`disagg.kit.lockstep`. The group's ranks agree on the count with one small all-reduce
(``ddp``); ``ulysses`` runs one forward per replica and microbatch, so only an empty replica
needs one.
"""

from disagg.kit.lockstep import placeholder_input
from disagg.kit.sharding.cost import comm, shard_rows, state_bytes, step_comm, zero1_partition, zero1_tensors
from disagg.kit.sharding.modes import FSDP_MODES, MODES, ShardMode, module_key, shard_problems
from disagg.kit.sharding.optimizer import build_optimizer

__all__ = [
    "FSDP_MODES",
    "MODES",
    "ShardMode",
    "build_optimizer",
    "comm",
    "module_key",
    "placeholder_input",
    "shard_problems",
    "shard_rows",
    "state_bytes",
    "step_comm",
    "zero1_partition",
    "zero1_tensors",
]
