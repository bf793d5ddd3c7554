"""Built-in transports: Ray's object store, and Ray Direct Transport (CUDA IPC, NCCL)."""

from __future__ import annotations

import importlib.util
from typing import Any, ClassVar

from disagg.interfaces import Layout, Transport


class ObjectStoreTransport(Transport):
    """Tensors go through Ray's shared-memory object store, from host memory:
    works on every device and placement (the default on CPU, and on CUDA where
    no direct transport fits the layout)."""

    name: ClassVar[str] = "object_store"


class CudaIpcTransport(Transport):
    """Ray Direct Transport over CUDA IPC: the consumer maps the producer's
    GPU memory; one-sided, no collective group. Ray can only do it between
    processes that were given the same GPU."""

    name: ClassVar[str] = "cuda_ipc"
    devices: ClassVar[frozenset[str]] = frozenset({"cuda"})
    on_device: ClassVar[bool] = True

    @classmethod
    def refuse(cls, layout: Layout) -> str | None:
        if layout.placement != "collocated":
            return (
                "CUDA IPC moves tensors only between processes on one GPU, and disaggregated groups "
                "have GPUs of their own; use 'object_store' (or 'nccl' with cupy installed)"
            )
        if not layout.one_gpu:
            big = sorted(m for m, n in layout.ranks.items() if n > 1)
            return (
                "CUDA IPC moves tensors only between processes on one GPU, but with more than one rank "
                f"in a group ({', '.join(big)}) an encoder rank also sends to LLM ranks on other GPUs "
                "(other replicas, every TP rank); use 'object_store', or one rank per group"
            )
        return None

    def call_options(self) -> dict[str, Any]:
        return {"tensor_transport": "cuda_ipc"}


def _cupy_missing() -> str | None:
    if importlib.util.find_spec("cupy") is None:
        return (
            "Ray's NCCL collective group needs cupy, which is not installed: pip install 'disagg-core[nccl]'"
        )
    return None


class DirectTransport(Transport):
    """Ray Direct Transport: tensors stay in the producing actor and move
    actor-to-actor over a Ray collective group (gloo on CPU, nccl on CUDA)
    when the consumer's task receives the ref as a top-level argument; only
    metadata touches the object store."""

    name: ClassVar[str] = "direct"
    backend: ClassVar[str] = "gloo"
    on_device: ClassVar[bool] = True

    @classmethod
    def for_backend(cls, backend: str) -> type[DirectTransport]:
        attrs: dict[str, Any] = {"name": backend, "backend": backend}
        if backend == "nccl":
            attrs["devices"] = frozenset({"cuda"})
            attrs["unavailable_reason"] = _cupy_missing()
        else:
            # Ray's torch_gloo communicator initialises *the* default
            # torch.distributed group of each actor over all actors, but every
            # disagg actor's default group is its own module's world (Megatron
            # and DeepSpeed require that), so the two cannot coexist.
            attrs["devices"] = frozenset()
            attrs["unavailable_reason"] = (
                "Ray's gloo direct transport needs the actors' default torch.distributed group, which disagg "
                "gives to each module's own world; use 'object_store' on CPU (or 'nccl' on CUDA)"
            )
        return type(f"DirectTransport_{backend}", (cls,), attrs)

    @classmethod
    def refuse(cls, layout: Layout) -> str | None:
        if cls.backend == "nccl" and layout.placement == "collocated":
            return (
                "collocated groups share each GPU, and NCCL refuses a communicator with two ranks on one "
                "GPU ('duplicate GPU'); use 'object_store' (or 'cuda_ipc' with one rank per group), or "
                "parallel.placement: disaggregated"
            )
        return None

    def setup(self, actors: list[Any]) -> None:
        from ray.experimental.collective import create_collective_group

        self._group = create_collective_group(actors, backend=_ray_backend(self.backend))

    def call_options(self) -> dict[str, Any]:
        return {"tensor_transport": self.backend}

    def teardown(self, actors: list[Any]) -> None:
        from ray.experimental.collective import destroy_collective_group

        group = getattr(self, "_group", None)
        if group is not None:
            try:
                destroy_collective_group(group)
            except Exception:  # actors may already be gone; nothing left to free
                pass


def auto_transport(layout: Layout, usable: dict[str, type[Transport]]) -> str:
    """``parallel.transport: auto``: the object store on CPU; on CUDA, CUDA IPC
    when every group shares one GPU, NCCL between disaggregated groups when it
    is installed (cupy), else the object store (which always works)."""
    if layout.device != "cuda":
        return "object_store"
    for name in ("cuda_ipc", "nccl"):
        cls = usable.get(name)
        if cls is not None and not cls.unavailable_reason and cls.refuse(layout) is None:
            return name
    return "object_store"


def _ray_backend(backend: str) -> str:
    return {"gloo": "torch_gloo", "nccl": "nccl"}.get(backend, backend)
