"""Every private (or undocumented internal) DeepSpeed and transformers name ``disagg_zero`` touches,
checked against the installed releases: a release that drops or renames one fails here, naming it,
instead of in a user's first ZeRO step. ``deepspeed`` is bounded (``<0.20``) at the newest minor this
passed on; raise the bound after this test passes on the next.

The list is kept complete by a scan of ``disagg_zero``'s source: any underscored attribute it uses
that it does not define itself must be listed here (or be torch's, pinned by the noxfile)."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "disagg_zero"

#: "module:Class" (or "module") -> names it must have as attributes (methods, functions)
ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3": (
        "_get_fp32_opt_state_partition",  # layout.py, fullstate.py: a parameter's fp32/state slice
        "_reassign_or_swap_out_partitioned_parameters",  # layout.py: masters -> weights after a load
        "_get_param_partition_world_size",  # fullstate.py: uneven partitions
        "_get_param_partition_rank",
        "_get_norm_groups",  # runtime.global_grad_norm at stage 3
        "get_param_id",
    ),
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer": (
        "_lazy_init_hp_params_optimizer_state",  # fullstate._link_optimizer_state
        "update_lp_params",
        "get_param_id",
        "scaled_global_norm",
        "backward_prologue",  # strategy._hand_to_engine: what engine.forward's hook runs
    ),
    "deepspeed.runtime.bf16_optimizer:BF16_Optimizer": (
        "get_grads_for_norm",
        "backward_prologue",  # strategy._hand_to_engine: zeroes the bf16 .grad it re-adds otherwise
    ),
    "deepspeed.runtime.zero.partition_parameters:Init": (
        "_zero_init_param",  # build.py: partition without initialising (patched during the build)
        "_convert_to_deepspeed_param",
    ),
    "deepspeed.utils.tensor_fragment:tensor_fragment": ("get_hp_fragment",),
    "transformers.modeling_utils": ("_load_state_dict_into_zero3_model",),  # build.py (patched)
    "transformers.integrations.deepspeed": ("_apply_weight_conversions_to_state_dict", "HfDeepSpeedConfig"),
}

#: instance attributes, set in ``__init__`` (or a linking function): the module's source must assign them
ASSIGNED: dict[str, tuple[str, ...]] = {
    "deepspeed.runtime.zero.stage3": ("grad_position", "fp32_partitioned_groups_flat", "fp16_groups"),
    "deepspeed.runtime.zero.stage_1_and_2": ("_hp_optimizer_states_linked",),
    "deepspeed.utils.mixed_precision_linkage": ("_hp_mapping",),  # param._hp_mapping (layout, runtime)
    "deepspeed.utils.tensor_fragment": ("lp_fragment_address",),
}
#: read by transformers, set by build.py (its init functions skip a flagged tensor)
READ_BY = {"transformers.modeling_utils": ("_is_hf_initialized",)}
#: torch's own (torch is pinned in the noxfile, not bounded here)
TORCH = {"_forward_pre_hooks", "_forward_hooks"}


def _resolve(where: str) -> object:
    module, _, cls = where.partition(":")
    obj: object = importlib.import_module(module)
    return getattr(obj, cls) if cls else obj


def missing_names() -> list[str]:
    missing = [f"{w}.{n}" for w, names in ATTRIBUTES.items() for n in names if not hasattr(_resolve(w), n)]
    for where, names in ASSIGNED.items():  # assigned (``x.name = ``) or a dataclass field (``name: T``)
        source = inspect.getsource(_resolve(where))
        missing += [
            f"{where}.{n}" for n in names if not re.search(rf"(\.{n}\s*=[^=]|^\s*{n}\s*:)", source, re.M)
        ]
    for where, names in READ_BY.items():
        source = inspect.getsource(_resolve(where))
        missing += [f"{where}.{n}" for n in names if not re.search(rf"\b{n}\b", source)]
    return missing


def test_deepspeed_and_transformers_still_have_every_name() -> None:
    import deepspeed

    missing = missing_names()
    assert not missing, f"deepspeed {deepspeed.__version__}: gone: {', '.join(missing)}"


def test_a_dropped_name_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Injected: a release without ``_get_param_partition_world_size``."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    monkeypatch.delattr(Stage3, "_get_param_partition_world_size")
    assert missing_names() == [
        "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._get_param_partition_world_size"
    ]


def test_every_deepspeed_import_resolves() -> None:
    """``from deepspeed.x import y`` anywhere in disagg_zero (internal module paths included)."""
    missing = []
    for f in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("deepspeed"):
                module = importlib.import_module(node.module)
                missing += [
                    f"{node.module}.{a.name} ({f.name}:{node.lineno})"
                    for a in node.names
                    if not hasattr(module, a.name)
                ]
    assert not missing, missing


def _used_private_names() -> dict[str, str]:
    """Underscored attributes disagg_zero uses (``x._y``, ``getattr(x, "_y")``) but does not define."""
    used: dict[str, str] = {}
    own: set[str] = set()
    for f in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and re.match(r"_[^_]", node.attr):
                if (
                    isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "self"
                ):
                    own.add(node.attr)
                used.setdefault(node.attr, f"{f.name}:{node.lineno}")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr")
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and re.match(r"_[^_]", str(node.args[1].value))
            ):
                used.setdefault(str(node.args[1].value), f"{f.name}:{node.lineno}")
    return {n: w for n, w in used.items() if n not in own}


def test_the_list_holds_every_private_name_disagg_zero_uses() -> None:
    listed = {n for names in (*ATTRIBUTES.values(), *ASSIGNED.values(), *READ_BY.values()) for n in names}
    unlisted = {n: w for n, w in _used_private_names().items() if n not in listed | TORCH}
    assert not unlisted, f"private names used but not checked here: {unlisted}"
