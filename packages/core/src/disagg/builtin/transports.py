"""Built-in transports: Ray's object store, and Ray Direct Transport."""

from __future__ import annotations

from typing import Any, ClassVar

from disagg.interfaces import Transport


class ObjectStoreTransport(Transport):
    """Tensors go through Ray's shared-memory object store (default on CPU)."""

    name: ClassVar[str] = "object_store"


class DirectTransport(Transport):
    """Ray Direct Transport: tensors stay in the producing actor and move
    actor-to-actor over a Ray collective group (gloo on CPU, nccl on CUDA)
    when the consumer resolves the ref; only metadata touches the object store."""

    name: ClassVar[str] = "direct"
    backend: ClassVar[str] = "gloo"

    @classmethod
    def for_backend(cls, backend: str) -> type[DirectTransport]:
        devices = frozenset({"cuda"}) if backend == "nccl" else frozenset({"cpu", "cuda"})
        return type(f"DirectTransport_{backend}", (cls,), {"name": backend, "backend": backend, "devices": devices})

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


def _ray_backend(backend: str) -> str:
    return {"gloo": "torch_gloo", "nccl": "nccl"}.get(backend, backend)
