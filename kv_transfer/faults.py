"""Fault injection for the chaos tests (docs/design.md, "Fault injection").

Off unless the process starts with `ATOMD_FAULTS` (a JSON spec) or `ATOMD_FAULTS_FILE`
(a path to one, re-read whenever the file is replaced, so a long-lived test engine takes a new
spec per scenario) in its environment. `ACTIVE` is fixed at import: every call site is
guarded by `if faults.ACTIVE:`, so an engine without the variables pays one attribute load.

    {"id": "p-killed-mid-pull", "seed": 1,
     "points": {"kv_pull_mid": {"action": "kill", "skip": 0, "times": 1}},
     "channel": [{"role": "kv-sender", "kind": "DONE", "action": "drop", "p": 1.0, "times": 1}]}

Named points (`point(name)`; which process hits one depends on its role):

    before_answer   engine core, a step finished a request, before its output goes to the API
                    (P: the prefill leg's answer; D: the last tokens)
    stream_mid      engine core, a step produced tokens of unfinished requests (skip N: the N+1-th)
    between_legs    P: a READ arrived (D is about to pull); D: a do_remote_prefill request arrived
    kv_pull_mid     P: the first DATA message of a READ went out; D: the first DATA landed

Point actions: `kill` (SIGKILL the engine: its API parent first when this is an engine core,
then this process), `crash` (SIGKILL this process alone: a core dying under a live API
process), `stop` (SIGSTOP the engine, as kill does; the test sends SIGCONT), `freeze`
(SIGSTOP this process alone: a wedged core under a live API process), `delay`
(`delay_s` sleep on the calling thread), `exit` (os._exit(1) of this process only).

Side-channel rules act on the messages a side-channel endpoint receives (`role`
"kv-sender": D -> P messages at P; "kv-receiver": P -> D at D; absent: both), matched by
message `kind` (READ, DATA, END, DONE, HEARTBEAT, ABORT, ERROR, ...; absent: any):
`drop`, `dup` (delivered twice), `delay` (`delay_s` later), `reorder` (held until the next
message from that socket is delivered, or `hold_s`, 1 s by default). `p` is the
probability per matching message (a seeded RNG), `skip` matches pass first, `times` bounds
the fires (absent: no bound). Every fire is appended as a JSON line to `ATOMD_FAULTS_LOG`
(default: the spec file's path + ".log"), so a test knows what happened and when.
"""
from __future__ import annotations

import json
import logging
import os
import random
import signal
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

_INLINE = os.environ.get("ATOMD_FAULTS")
_FILE = os.environ.get("ATOMD_FAULTS_FILE")
ACTIVE = bool(_INLINE or _FILE)

_lock = threading.RLock()
_parent_pid: int | None = None  # set in an engine core: its API process dies / stops with it


class _State:
    def __init__(self, spec: dict[str, Any]):
        self.spec = spec
        self.id = spec.get("id", "")
        self.rng = random.Random(spec.get("seed", 0))
        self.points: dict[str, dict] = dict(spec.get("points") or {})
        self.rules: list[dict] = list(spec.get("channel") or [])
        self.matches: dict[int, int] = {}  # by rule/point key: matches seen
        self.fires: dict[int, int] = {}
        self.held: list[tuple[float | None, str, Any, list]] = []  # (due, role, sock, frames); due None: reorder


_state: _State | None = None
_file_key: bytes | None = None


def _load() -> _State:
    """The current spec: the file re-read at every hook (test mode only) and re-parsed when
    its bytes changed (an inode, mtime and size can all repeat between two scenarios' specs)."""
    global _state, _file_key
    if _FILE:
        try:
            with open(_FILE, "rb") as f:
                key = f.read()
        except FileNotFoundError:
            key = None
        except OSError as e:
            log.warning("faults: cannot read %s: %s", _FILE, e)
            return _state or _State({})
        if key != _file_key or _state is None:
            try:
                spec = json.loads(key or b"{}")
            except ValueError as e:  # mid-write: keep the old spec, retry next hit
                log.warning("faults: cannot parse %s: %s", _FILE, e)
                return _state or _State({})
            _file_key = key
            held = _state.held if _state is not None else []
            _state = _State(spec)
            _state.held = held  # messages the previous spec delayed are still delivered
    elif _state is None:
        _state = _State(json.loads(_INLINE or "{}"))
    return _state


def _record(state: _State, **fields: Any) -> None:
    path = os.environ.get("ATOMD_FAULTS_LOG") or (_FILE + ".log" if _FILE else None)
    line = dict(id=state.id, pid=os.getpid(), t=time.time(), **fields)
    log.warning("fault injected: %s", line)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def _should_fire(state: _State, key: int, cfg: dict) -> bool:
    seen = state.matches.get(key, 0)
    state.matches[key] = seen + 1
    if seen < cfg.get("skip", 0):
        return False
    times = cfg.get("times")
    if times is not None and state.fires.get(key, 0) >= times:
        return False
    if state.rng.random() >= cfg.get("p", 1.0):
        return False
    state.fires[key] = state.fires.get(key, 0) + 1
    return True


def engine_core_started(parent_pid: int) -> None:
    """Called by an engine core: `kill` and `stop` take its API process along."""
    global _parent_pid
    _parent_pid = parent_pid


def point(name: str) -> None:
    """A named point was reached: act if the spec says so."""
    with _lock:
        state = _load()
        cfg = state.points.get(name)
        if cfg is None or not _should_fire(state, hash(("point", name)), cfg):
            return
        action = cfg.get("action", "kill")
        _record(state, point=name, action=action)
    if action == "delay":
        time.sleep(float(cfg.get("delay_s", 1.0)))
    elif action in ("kill", "stop"):
        sig = signal.SIGKILL if action == "kill" else signal.SIGSTOP
        if _parent_pid is not None:
            try:
                os.kill(_parent_pid, sig)
            except ProcessLookupError:
                pass
        t0 = time.monotonic()
        _signal_self(sig)
        log.warning("faults: resumed after %.3f s stopped at %s", time.monotonic() - t0, name)
    elif action == "crash":  # this process alone (an engine core dies under a live API process)
        _signal_self(signal.SIGKILL)
    elif action == "freeze":  # this process alone stops (a wedged core under a live API process)
        t0 = time.monotonic()
        _signal_self(signal.SIGSTOP)
        log.warning("faults: resumed after %.3f s frozen at %s", time.monotonic() - t0, name)
    elif action == "exit":
        os._exit(1)
    else:
        log.error("faults: unknown point action %r", action)


def _signal_self(sig: int) -> None:
    """Stop or kill this process before the calling thread runs one more line: a signal sent
    to the process may be taken by another thread, and this one would run on (e.g. send END)
    until the group stop reached it; sent to this thread, it acts on the way out of the call."""
    signal.pthread_kill(threading.get_ident(), sig)
    time.sleep(0.05)  # a syscall: the stop (or the kill) is taken here at the latest


def engine_outputs(outputs: list) -> None:
    """The engine core is about to send a step's outputs to the API process."""
    if any(o.finished for o in outputs):
        point("before_answer")
    elif any(o.new_token_ids for o in outputs):
        point("stream_mid")


def _kind(role: str, frames: list) -> str | None:
    """The tag of a side-channel header (frame 1 at a ROUTER socket, 0 at a DEALER)."""
    import msgspec

    try:
        header = frames[1 if role == "kv-sender" else 0]
        return msgspec.msgpack.decode(header.buffer if hasattr(header, "buffer") else header)[0]
    except Exception:
        return None


def channel(role: str, sock: Any, frames: list) -> list[list]:
    """A side-channel endpoint (`role`: its I/O thread's name) received `frames` on `sock`:
    the messages to handle now, in order (this one per the rules, and reordered ones it frees)."""
    with _lock:
        state = _load()
        out: list[list] = []
        held_reorder = [h for h in state.held if h[0] is None and h[1] == role and h[2] is sock]
        kind = _kind(role, frames)
        action = None
        for i, rule in enumerate(state.rules):
            if rule.get("role", role) != role or rule.get("kind", kind) != kind:
                continue
            if _should_fire(state, hash(("rule", i)), rule):
                action = rule.get("action", "drop")
                _record(state, channel=role, kind=kind, action=action)
                if action == "delay":
                    state.held.append((time.monotonic() + float(rule.get("delay_s", 0.5)), role, sock, frames))
                elif action == "reorder":
                    state.held.append((None, role, sock, frames, time.monotonic() + float(rule.get("hold_s", 1.0))))
                break
        if action is None:
            out.append(frames)
        elif action == "dup":
            out += [frames, frames]
        elif action not in ("drop", "delay", "reorder"):
            log.error("faults: unknown channel action %r", action)
            out.append(frames)
        if out and held_reorder:  # a later message went first: the held one follows it
            for h in held_reorder:
                state.held.remove(h)
                out.append(h[3])
        return out


def channel_due(role: str) -> list[tuple[Any, list]]:
    """Held messages of `role` whose time has come: [(sock, frames)]."""
    if _state is None or not _state.held:
        return []
    now = time.monotonic()
    with _lock:
        due = [h for h in _state.held if h[1] == role and (h[0] if h[0] is not None else h[4]) <= now]
        for h in due:
            _state.held.remove(h)
        return [(h[2], h[3]) for h in due]
