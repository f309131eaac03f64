"""Connected components of a graph given by node pairs: the one union-find of strag (the Kineto
converter's rank layout, transforms/ingest/kineto/layout.py; the engine's check that every op is
linked to an optimizer, transforms/whatif/graph.py)."""
from __future__ import annotations

from collections.abc import Iterable

__all__ = ["components"]


def components(n: int, links: Iterable[tuple[int, int]]) -> list[int]:
    """Per node of n, a label shared by exactly the nodes of its connected component (one of its
    members), the components joined by the (a, b) pairs in `links`."""
    parent = list(range(n))

    def root(v: int) -> int:
        while parent[v] != v:
            parent[v] = parent[parent[v]]   # path halving
            v = parent[v]
        return v

    for a, b in links:
        parent[root(int(a))] = root(int(b))
    return [root(v) for v in range(n)]
