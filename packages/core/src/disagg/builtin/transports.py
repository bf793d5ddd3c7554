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
        attrs: dict[str, Any] = {"name": backend, "backend": backend}
        if backend == "nccl":
            attrs["devices"] = frozenset({"cuda"})
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
