"""The driver reaches a group's ranks only through :class:`Group`'s typed methods:
each one's parameters are exactly its :class:`ModuleWorker` method's (plus
``ranks``), so a renamed or re-ordered worker argument fails here, not in a run."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

from disagg.runtime.actor.spec import WorkerSpec
from disagg.runtime.actor.worker import ModuleWorker
from disagg.runtime.groups import Group

#: Group methods whose worker method has another name (``Group.placement`` is its placement group)
_ALIAS = {"placements": "placement"}


#: Ray adds this keyword to an actor class's methods in place once an actor of it is created
#: (tracing support), so a session that already started a group sees it; it is not ours
_RAY_ADDED = "_ray_trace_ctx"


def _params(fn) -> list[tuple[str, object, object]]:
    sig = inspect.signature(fn)
    skip = ("self", "ranks", _RAY_ADDED)
    return [(p.name, p.kind, p.default) for p in sig.parameters.values() if p.name not in skip]


def test_every_group_method_has_its_worker_methods_parameters():
    calls = [n for n, v in vars(Group).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert len(calls) >= 13, calls
    for name in calls:
        worker = getattr(ModuleWorker, _ALIAS.get(name, name), None)
        assert worker is not None, f"Group.{name} calls no ModuleWorker method"
        assert _params(getattr(Group, name)) == _params(worker), name


def test_the_driver_names_no_worker_method_by_string():
    """No ``call("method", ...)``, ``getattr(actor, name)`` or private actor ids in the driver."""
    src = Path(inspect.getfile(Group)).parent
    for path in [src / "groups.py", src / "orchestrator.py", src / "failures.py"]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            is_getattr = isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr"
            if is_getattr and path.name != "failures.py":  # failures reads exception attributes
                raise AssertionError(f"{path.name}:{node.lineno}: getattr names a method by string")
            if isinstance(node, ast.Attribute):
                assert node.attr not in ("call", "_actor_id"), f"{path.name}:{node.lineno}: .{node.attr}"


def test_worker_spec_documents_every_field():
    """One spec object, each field with its docstring (the string after it)."""
    tree = ast.parse(Path(inspect.getfile(WorkerSpec)).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "WorkerSpec")
    documented = {
        a.target.id
        for a, doc in zip(cls.body, cls.body[1:])
        if isinstance(a, ast.AnnAssign)
        and isinstance(doc, ast.Expr)
        and isinstance(doc.value, ast.Constant)
        and isinstance(doc.value.value, str)
    }
    fields = {f.name for f in dataclasses.fields(WorkerSpec)}
    assert fields == documented, fields ^ documented
    assert [p for p in inspect.signature(ModuleWorker).parameters if p != _RAY_ADDED] == ["spec"]
