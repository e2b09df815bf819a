"""Items worked on by a thread pool a bounded number ahead, their results taken in the items' order.

The export reads one shard after another into manifests that must keep the shards' order; on object storage each
read is mostly waiting for the store, so several run at once while the results are still written in order.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def ordered(pool: Executor, fn: Callable[[T], R], items: Iterable[T], ahead: int) -> Iterator[tuple[T, R]]:
    """``(item, fn(item))`` for each of ``items``, in their order, with ``fn`` run in ``pool`` on at most
    ``ahead`` items beyond the one being taken; an error of ``fn`` is raised where its item's turn comes."""
    pending: collections.deque[tuple[T, Future[R]]] = collections.deque()
    for item in items:
        pending.append((item, pool.submit(fn, item)))
        if len(pending) > ahead:
            yield _taken(pending)
    while pending:
        yield _taken(pending)


def _taken(pending: collections.deque[tuple[Any, Future[Any]]]) -> tuple[Any, Any]:
    item, future = pending.popleft()
    return item, future.result()
