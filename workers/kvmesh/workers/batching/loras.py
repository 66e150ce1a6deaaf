"""The LoRA adapters an engine has loaded: a bounded set, least recently used unloaded first.

vLLM's `--max-loras` bounds the adapters of one batch and `--max-cpu-loras` the ones kept
loaded; here one bound (`max_loras`) covers both: loading one more adapter than the bound
unloads the one used least recently (by a request or a load). Requests already running on an
unloaded adapter keep its weights (they hold a reference) and finish normally; new requests
naming it get NOT_FOUND, as for any adapter that is not loaded.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

from kvmesh.runtime.errors import InvalidRequest, NotFound

__all__ = ["LoraSlots"]

T = TypeVar("T")


class LoraSlots(Generic[T]):
    """Loaded adapters by name, in least-recently-used order (see the module docstring)."""

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        self.max_loras = max_loras
        self._items: OrderedDict[str, T] = OrderedDict()
        self.num_evicted = 0
        """Adapters unloaded to make room for another."""

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def __len__(self) -> int:
        return len(self._items)

    def names(self) -> tuple[str, ...]:
        """Loaded adapter names, sorted."""
        return tuple(sorted(self._items))

    def use(self, name: str) -> T:
        """The adapter `name`, now the most recently used; NotFound when it is not loaded."""
        item = self._items.get(name)
        if item is None:
            raise NotFound(f"LoRA adapter {name!r} is not loaded", param="model")
        self._items.move_to_end(name)
        return item

    def check_new(self, name: str) -> None:
        """Raise InvalidRequest when `name` cannot be loaded (empty or already loaded)."""
        if not name:
            raise InvalidRequest("lora_name must not be empty", param="lora_name")
        if name in self._items:
            raise InvalidRequest(
                f"LoRA adapter {name!r} is already loaded (unload it first)", param="lora_name"
            )

    def add(self, name: str, item: T) -> list[str]:
        """Load `item` as `name` (see `check_new`); returns the names unloaded to make room."""
        self.check_new(name)
        evicted: list[str] = []
        while len(self._items) >= self.max_loras:
            old, _ = self._items.popitem(last=False)
            evicted.append(old)
        self.num_evicted += len(evicted)
        self._items[name] = item
        return evicted

    def remove(self, name: str) -> None:
        """Unload `name`; NotFound when it is not loaded."""
        if self._items.pop(name, None) is None:
            raise NotFound(f"LoRA adapter {name!r} is not loaded", param="lora_name")
