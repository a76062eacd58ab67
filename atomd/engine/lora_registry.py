"""LoraRegistry: which LoRA adapters an engine knows, which are resident, which are in use.

Torch-free: the loader is a callable (atomd/model/lora.py's load_adapter bound to the model).
An adapter is *known* once `--lora-modules` or `load_lora_adapter` named it (name -> path);
at most `max_loras` known adapters are *resident* (weights in memory). A request takes its
adapter (`acquire`: loaded again from its path if it was evicted) and gives it back when it
ends (`release`). Loading past `max_loras` evicts the least recently used resident adapter
that no request holds; when every resident one is held, the load is refused (LoraBusy), never
an eviction under a running request. Unloading an adapter in use forgets its name at once (new
requests get a 404) and drops its weights when the last request holding it ends.
"""
from __future__ import annotations

import collections
from typing import Any, Callable

from contracts.lora import check_name

MAX_KNOWN = 1024  # adapter names one engine keeps (each load by the admin API adds one)


class LoraBusy(RuntimeError):
    """Every resident adapter slot is held by a running request."""


class LoraNotLoaded(Exception):
    """A request names an adapter this engine does not know (its 404)."""


class LoraRegistry:
    def __init__(self, max_loras: int, load: Callable[[str, str], Any]):
        """load(name, path) -> the adapter's weights (ValueError naming what is wrong)."""
        self.max_loras = max_loras
        self._load = load
        self.paths: dict[str, str] = {}  # known: name -> path
        self.ids: dict[str, int] = {}  # name -> int id (vLLM's lora_int_id; KV events' lora_id), 1-based
        self.resident: collections.OrderedDict[str, Any] = collections.OrderedDict()  # LRU first
        self.in_use: collections.Counter[str] = collections.Counter()
        self.request_loads = 0  # loads a request waited for (its adapter had been evicted)
        self._next_id = 1

    def add(self, name: str, path: str) -> None:
        """Know and load adapter `name` now (ValueError: bad name or adapter, or name taken)."""
        check_name(name)
        if name in self.paths:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        if name in self.resident:  # unloaded while requests still hold it
            raise ValueError(f"LoRA adapter {name!r} is still in use by running requests after its unload")
        if len(self.paths) >= MAX_KNOWN:
            raise ValueError(f"{MAX_KNOWN} LoRA adapters are loaded already: unload one first")
        weights = self._load(name, path)
        self._make_room()
        self.paths[name] = path
        self.ids[name] = self._next_id
        self._next_id += 1
        self.resident[name] = weights

    def remove(self, name: str) -> None:
        """Forget `name` (KeyError when unknown); its weights go once no request holds them."""
        del self.paths[name]
        if not self.in_use[name]:
            self._drop(name)

    def acquire(self, name: str) -> Any:
        """The weights of `name` for one request (LoraNotLoaded: unknown; LoraBusy: no slot free)."""
        if name not in self.paths:
            raise LoraNotLoaded(f"LoRA adapter {name!r} is not loaded on this engine")
        if name not in self.resident:
            weights = self._load(name, self.paths[name])
            self._make_room()
            self.resident[name] = weights
            self.request_loads += 1
        self.resident.move_to_end(name)
        self.in_use[name] += 1
        return self.resident[name]

    def release(self, name: str) -> None:
        self.in_use[name] -= 1
        if self.in_use[name] <= 0:
            del self.in_use[name]
            if name not in self.paths:
                self._drop(name)

    def lora_id(self, name: str | None) -> int | None:
        return None if name is None else self.ids.get(name)

    def info(self) -> list[dict[str, Any]]:
        """Known adapters: name, id, path, resident, requests holding it."""
        return [{"name": n, "id": self.ids[n], "path": p, "resident": n in self.resident, "in_use": self.in_use[n]}
                for n, p in self.paths.items()]

    def _make_room(self) -> None:
        while len(self.resident) >= self.max_loras:
            victim = next((n for n in self.resident if not self.in_use[n]), None)
            if victim is None:
                raise LoraBusy(f"all {self.max_loras} LoRA adapter slots (--max-loras) are in use by running requests")
            del self.resident[victim]

    def _drop(self, name: str) -> None:
        self.resident.pop(name, None)
        self.ids.pop(name, None)
