"""The parts a :class:`~disagg.kit.Strategy` is made of, one role per
file, each with defaults for a module that every rank holds whole:

- :class:`~.parallelizer.Parallelizer`: set-up (``parallelize``, the only
  method a strategy must write), gradient reduction, norm and step;
- :class:`~.encoder.EncoderRole`: forward of an encoder's shards, their backward;
- :class:`~.language.LanguageRole`: the language model's loss, backward, evaluation;
- :class:`~.state.StateAdapter`: the layout-free full form (weights, gradients,
  optimizer state) and a rank's own random streams;
- :mod:`~.optimizer`: ``build_optimizer`` callables (AdamW) and the schedule.

The roles meet in two hooks every call into the module goes through:
:meth:`~.parallelizer.Parallelizer.module_call` (a context around each forward
and backward, e.g. gathering sharded parameters) and
:meth:`~.parallelizer.Parallelizer.backprop` (how gradients reach the
parameters, e.g. handed to an engine).
"""

from disagg.kit.roles.encoder import EncoderRole
from disagg.kit.roles.language import LanguageRole
from disagg.kit.roles.optimizer import OptimizerBuilder, adamw, make_scheduler
from disagg.kit.roles.parallelizer import Parallelizer
from disagg.kit.roles.state import StateAdapter

__all__ = [
    "EncoderRole",
    "LanguageRole",
    "OptimizerBuilder",
    "Parallelizer",
    "StateAdapter",
    "adamw",
    "make_scheduler",
]
