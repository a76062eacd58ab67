"""LoraRegistry: which LoRA adapters an engine knows, which are resident, which are in use.

Torch-free: the loader is a callable (atomd/model/lora.py's load_adapter bound to the model).
An adapter is *known* once `--lora-modules` or `load_lora_adapter` named it (name -> path);
at most `max_loras` known adapters are *resident* (weights in memory).

A request pins its adapter when the scheduler admits it (`admit`, the scheduler's admission
gate) and gives it back when it ends (`release`). An adapter that is not resident is loaded
from its path on a background thread while the engine keeps stepping; the request stays in
the waiting queue meanwhile (other requests are admitted past it) and is admitted once the
load has landed (`finish_loads`, on the engine thread). A load needs a slot: a free one, or
the least recently used resident adapter that no request holds, evicted. When every slot is
held by running requests the request waits for one to free, never an eviction under a running
request. A load that fails refuses the requests that waited for it (LoraLoadFailed, their
400). Unloading an adapter in use forgets its name at once (requests not yet admitted get a
404) and drops its weights when the last request holding it ends.

Run-time loads by the admin API (`start_add`) also read on the background thread; their
answer is a Future resolved when the load lands. The new adapter is resident when a slot can
be made then, else known only (its first request loads it again).
"""
from __future__ import annotations

import collections
import concurrent.futures
from typing import Any, Callable

from contracts.lora import check_name

MAX_KNOWN = 1024  # adapter names one engine keeps (each load by the admin API adds one)


class LoraNotLoaded(Exception):
    """A request names an adapter this engine does not know (its 404)."""


class LoraLoadFailed(Exception):
    """The load a request waited for failed (its 400, with the loader's message)."""


class _Load:
    """One in-flight load: the reader's future, the requests waiting on it, the admin answer."""

    __slots__ = ("future", "path", "waiters", "answer", "holds_slot")

    def __init__(self, future: concurrent.futures.Future, path: str, answer: concurrent.futures.Future | None,
                 holds_slot: bool):
        self.future, self.path, self.answer, self.holds_slot = future, path, answer, holds_slot
        self.waiters: set[str] = set()  # request ids admitted once it lands


class LoraRegistry:
    def __init__(self, max_loras: int, load: Callable[[str, str], Any]):
        """load(name, path) -> the adapter's weights (ValueError naming what is wrong); it runs on
        a background thread for run-time loads."""
        self.max_loras = max_loras
        self._load = load
        self.paths: dict[str, str] = {}  # known: name -> path
        self.ids: dict[str, int] = {}  # name -> int id (vLLM's lora_int_id; KV events' lora_id), 1-based
        self.resident: collections.OrderedDict[str, Any] = collections.OrderedDict()  # LRU first
        self.in_use: collections.Counter[str] = collections.Counter()  # name -> requests pinning it
        self.pins: dict[str, str] = {}  # request id -> the adapter it pins
        self.loading: dict[str, _Load] = {}  # name -> its load in flight
        self.failed: dict[str, str] = {}  # request id -> the message of the load it waited for
        self.request_loads = 0  # loads a request waited for (its adapter had been evicted)
        self._next_id = 1
        self._reader: concurrent.futures.ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ known adapters

    def add(self, name: str, path: str) -> None:
        """Know and load adapter `name` now, on this thread (start-up; ValueError as start_add)."""
        answer = self.start_add(name, path, background=False)
        self.finish_loads()
        result = answer.result()
        if "error" in result:
            raise ValueError(result["error"])

    def start_add(self, name: str, path: str, background: bool = True) -> concurrent.futures.Future:
        """Load adapter `name` from `path` (on the background thread): a Future of {"name"} once it
        is known, or {"error", "status": 400} (bad name or adapter, name taken, too many names).
        ValueError at once for what needs no read."""
        check_name(name)
        if name in self.paths or name in self.loading:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        if name in self.resident:  # unloaded while requests still hold it
            raise ValueError(f"LoRA adapter {name!r} is still in use by running requests after its unload")
        if len(self.paths) + len(self.loading) >= MAX_KNOWN:
            raise ValueError(f"{MAX_KNOWN} LoRA adapters are loaded already: unload one first")
        answer: concurrent.futures.Future = concurrent.futures.Future()
        self.loading[name] = _Load(self._read(name, path, background), path, answer, holds_slot=False)
        return answer

    def remove(self, name: str) -> None:
        """Forget `name` (KeyError when unknown); its weights go once no request holds them."""
        del self.paths[name]
        if not self.in_use[name]:
            self._drop(name)

    # ------------------------------------------------------------------ requests

    def admit(self, request_id: str, name: str) -> bool:
        """The scheduler's gate for a request under `name`: True once it pins the resident
        adapter (again True for a request that pins it already: a preempted choice), False while
        it must wait (a load in flight, or every slot held). LoraNotLoaded: `name` was unloaded;
        LoraLoadFailed: the load it waited for failed."""
        if request_id in self.pins:
            return True
        if request_id in self.failed:
            raise LoraLoadFailed(self.failed.pop(request_id))
        if name not in self.paths:
            raise LoraNotLoaded(f"LoRA adapter {name!r} is not loaded on this engine")
        if name in self.resident:
            self.resident.move_to_end(name)
            self.in_use[name] += 1
            self.pins[request_id] = name
            return True
        load = self.loading.get(name)
        if load is None:  # evicted: load it again into a slot, if one can be made now
            if not self._make_room(reserve=1):
                return False  # every slot is held by a running request: wait for one
            load = self.loading[name] = _Load(self._read(name, self.paths[name], True), self.paths[name], None,
                                              holds_slot=True)
            self.request_loads += 1
        load.waiters.add(request_id)
        return False

    def release(self, request_id: str) -> None:
        """The request ended (finished or aborted): its pin, or its place in a load's wait, goes."""
        self.failed.pop(request_id, None)
        for load in self.loading.values():
            load.waiters.discard(request_id)
        name = self.pins.pop(request_id, None)
        if name is None:
            return
        self.in_use[name] -= 1
        if self.in_use[name] <= 0:
            del self.in_use[name]
            if name not in self.paths:
                self._drop(name)

    def finish_loads(self) -> None:
        """On the engine thread: make the landed loads resident (or known), answer their admin
        calls, and mark their waiters' failure when one failed."""
        for name, load in list(self.loading.items()):
            if not load.future.done():
                continue
            del self.loading[name]
            try:
                weights = load.future.result()
            except Exception as e:  # the loader names what is wrong (ValueError); anything else too
                message = str(e) if isinstance(e, ValueError) else f"LoRA adapter {name!r}: {type(e).__name__}: {e}"
                self.failed.update(dict.fromkeys(load.waiters, message))
                if load.answer is not None:
                    load.answer.set_result({"error": message, "status": 400})
                continue
            if load.answer is not None:  # a run-time load: the name is known from now on
                self.paths[name] = load.path
                self.ids[name] = self._next_id
                self._next_id += 1
                load.answer.set_result({"name": name})
            if name in self.paths and (load.holds_slot or self._make_room(reserve=1)):
                self.resident[name] = weights  # most recently used

    def lora_id(self, name: str | None) -> int | None:
        return None if name is None else self.ids.get(name)

    def info(self) -> list[dict[str, Any]]:
        """Known adapters: name, id, path, resident, requests holding it."""
        return [{"name": n, "id": self.ids[n], "path": p, "resident": n in self.resident, "in_use": self.in_use[n]}
                for n, p in self.paths.items()]

    def wait_for_loads(self) -> None:
        """Block until every load in flight has been read (offline callers; the engine polls)."""
        concurrent.futures.wait([load.future for load in self.loading.values()])

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ internals

    def _read(self, name: str, path: str, background: bool) -> concurrent.futures.Future:
        """The loader's result as a future: on the reader thread, or run here (start-up)."""
        if background:
            if self._reader is None:  # one thread: loads queue behind each other, the engine steps on
                self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lora-load")
            return self._reader.submit(self._load, name, path)
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(self._load(name, path))
        except Exception as e:
            future.set_exception(e)
        return future

    def _make_room(self, reserve: int) -> bool:
        """Evict least recently used adapters no request holds until `reserve` more fit beside the
        resident ones and the loads holding a slot; False (nothing evicted) when they cannot."""
        reserved = sum(load.holds_slot for load in self.loading.values())
        idle = [n for n in self.resident if not self.in_use[n]]
        excess = len(self.resident) + reserved + reserve - self.max_loras
        if excess > len(idle):
            return False
        for victim in idle[:max(excess, 0)]:
            del self.resident[victim]
        return True

    def _drop(self, name: str) -> None:
        self.resident.pop(name, None)
        self.ids.pop(name, None)
