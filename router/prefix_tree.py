"""An approximate prefix tree over request text, shared by all workers of a role: the
cache_aware policy's picture of what each engine's prefix cache holds (sgl-router's design).

Each node is an edge of characters; every node remembers the workers ("tenants") whose
requests passed through it and when they last did. `match` walks a text as deep as the
tree goes and returns, per tenant, how many characters of the text it has seen; `insert`
records a text under the tenant it was routed to. Eviction keeps each tenant under
`max_chars`: its least recently used leaves go first (`evict`, run every
`eviction_interval_s` by the policy). It is a guess, not the engine's truth: it does not
see the engine evict, nor requests sent around the router; kv_aware is the exact policy.
"""
from __future__ import annotations

import heapq
import itertools
import time


class Node:
    __slots__ = ("text", "children", "tenants", "parent")

    def __init__(self, text: str, parent: "Node | None"):
        self.text = text
        self.children: dict[str, Node] = {}
        self.tenants: dict[str, float] = {}  # tenant -> last access
        self.parent = parent


class PrefixTree:
    def __init__(self, clock=time.monotonic):
        self.root = Node("", None)
        self.chars: dict[str, int] = {}  # tenant -> characters attributed to it
        self.clock = clock

    def match(self, text: str, tenants) -> tuple[str | None, int]:
        """(the tenant among `tenants` that has seen the longest prefix of `text`, its length):
        ties go to the tenant that used the shared node most recently."""
        wanted = set(tenants)
        node, depth = self.root, 0
        best, best_len, best_ts = None, 0, -1.0
        n = len(text)
        while depth < n:
            child = node.children.get(text[depth])
            if child is None:
                break
            edge = child.text
            k = _common(edge, text, depth)
            got = depth + k
            for t, ts in child.tenants.items():
                if t in wanted and (got > best_len or (got == best_len and ts > best_ts)):
                    best, best_len, best_ts = t, got, ts
            if k < len(edge):
                break
            node, depth = child, got
        return best, best_len

    def insert(self, text: str, tenant: str) -> None:
        now = self.clock()
        node, depth = self.root, 0
        node.tenants[tenant] = now
        n = len(text)
        added = 0
        while depth < n:
            c = text[depth]
            child = node.children.get(c)
            if child is None:
                leaf = Node(text[depth:], node)
                leaf.tenants[tenant] = now
                node.children[c] = leaf
                added += n - depth
                break
            edge = child.text
            k = _common(edge, text, depth)
            if k < len(edge):  # split the edge at k
                mid = Node(edge[:k], node)
                mid.tenants = dict(child.tenants)
                child.text = edge[k:]
                child.parent = mid
                mid.children[child.text[0]] = child
                node.children[c] = mid
                child = mid
            if tenant not in child.tenants:
                added += len(child.text)
            child.tenants[tenant] = now
            node, depth = child, depth + len(child.text)
        if added:
            self.chars[tenant] = self.chars.get(tenant, 0) + added

    def size(self, tenant: str) -> int:
        return self.chars.get(tenant, 0)

    def remove_tenant(self, tenant: str) -> None:
        self._evict_tenant(tenant, 0)
        self.chars.pop(tenant, None)

    def evict(self, max_chars: int) -> None:
        for tenant, chars in list(self.chars.items()):
            if chars > max_chars:
                self._evict_tenant(tenant, max_chars)

    def _evict_tenant(self, tenant: str, max_chars: int) -> None:
        """Drop the tenant's least recently used leaves until it holds at most max_chars."""
        tie = itertools.count()
        heap = [(n.tenants[tenant], next(tie), n) for n in self._leaves(tenant)]
        heapq.heapify(heap)
        chars = self.chars.get(tenant, 0)
        while heap and chars > max_chars:
            _, _, node = heapq.heappop(heap)
            if tenant not in node.tenants or any(tenant in c.tenants for c in node.children.values()):
                continue
            del node.tenants[tenant]
            chars -= len(node.text)
            parent = node.parent
            if not node.tenants and not node.children and parent is not None:
                del parent.children[node.text[0]]
            if parent is not None and parent is not self.root and tenant in parent.tenants and \
                    not any(tenant in c.tenants for c in parent.children.values()):
                heapq.heappush(heap, (parent.tenants[tenant], next(tie), parent))
        self.chars[tenant] = max(chars, 0)

    def _leaves(self, tenant: str) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            below = [c for c in node.children.values() if tenant in c.tenants]
            if below:
                stack.extend(below)
            elif node is not self.root and tenant in node.tenants:
                out.append(node)
        return out


def _common(edge: str, text: str, start: int) -> int:
    """Length of the common prefix of `edge` and text[start:]."""
    n = min(len(edge), len(text) - start)
    if text.startswith(edge[:n], start):
        return n
    lo, hi = 0, n  # binary search on the longest matching prefix
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(edge[:mid], start):
            lo = mid
        else:
            hi = mid - 1
    return lo
