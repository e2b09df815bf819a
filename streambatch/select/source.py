"""What a user's ``source`` names: a dataset folder or index (planned reading), or shard URLs (online)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

import braceexpand

from ..errors import DatasetNotFound, OptionError, path_option, shown
from ..format.index import INDEX_NAME, ShardIndex, is_index_file
from ..format.shared_index import load_index
from ..io import storage
from ..io.node_files import check_cache_dir
from .mixture import AnyIndex, MixedIndex, mixture_sources


class ShardURLs(Sequence[str]):
    """The shard URLs of an index, resolved one at a time: a rank and its workers hold the URLs of the shards
    they read, not a list of every shard's (10⁶ strings on a 10⁹-sample dataset)."""

    def __init__(self, index: AnyIndex) -> None:
        self.shard_index = index

    def __len__(self) -> int:
        return self.shard_index.num_shards

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self.shard_index.shard_url(i)


#: the most shard URLs a brace pattern (or a list of them) may expand to: 10⁷, a hundred times the shards of the
#: largest datasets (10⁵ shards of a few GB each); the names are counted before any is made, so a pattern like
#: ``shard-{000000000..999999999}.tar`` (10⁹ names, some 100 GB of strings) is refused at once, not expanded
MAX_SHARD_URLS = 10**7


def expand_urls(source: str | Sequence[str]) -> list[str]:
    """Brace-expand a shard pattern (or each of a list of them) into URLs. More than `MAX_SHARD_URLS` in
    all is an `OptionError` naming the pattern and its count, raised before expanding."""
    items = [str(item) for item in ([source] if isinstance(source, str) else list(source))]
    counts = [brace_count(item) for item in items]
    if sum(counts) > MAX_SHARD_URLS:
        n, item = max(zip(counts, items))
        what = f"{n:,} shard URLs" if len(items) == 1 else f"{n:,} shard URLs ({sum(counts):,} in all)"
        raise OptionError(
            f"source: the pattern {shown(item, 200)} expands to {what}, more than the {MAX_SHARD_URLS:,} a loader "
            "takes: check its braces (e.g. {000000..000999} for 1,000 shards)"
        )
    out: list[str] = []
    for item in items:
        out.extend(braceexpand.braceexpand(item))
    return out


_INT_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.-?(\d+))?$")  # braceexpand's own, to count alike
_CHAR_RANGE = re.compile(r"^([A-Za-z])\.\.([A-Za-z])(?:\.\.-?(\d+))?$")


def brace_count(pattern: str) -> int:
    """How many strings ``braceexpand(pattern)`` yields, counted from the pattern alone (its grammar: ranges
    multiply, comma lists add, a backslash escapes), in time linear in the pattern's length times its nesting."""
    count, start = 1, 0
    for pos, c, depth in _scan(pattern):
        if c == "{" and depth == 0:
            start = pos
        elif c == "}" and depth == 1:
            count *= _expression_count(pattern[start + 1 : pos])
    return count


def _scan(text: str) -> Iterator[tuple[int, str, int]]:
    """``(position, character, brace depth before it)`` of each character of ``text`` but escaped ones."""
    pos, depth = 0, 0
    while pos < len(text):
        c = text[pos]
        if c == "\\":
            pos += 2
            continue
        yield pos, c, depth
        depth += (c == "{") - (c == "}")
        pos += 1


def _expression_count(expr: str) -> int:
    """The strings one ``{...}`` yields: a numeric or letter range, a comma list, else the braces kept."""
    if m := _INT_RANGE.match(expr):
        a, b, step = int(m[1]), int(m[2]), (int(m[3]) or 1) if m[3] else 1
        return len(range(a, b + 1, step) if a < b else range(a, b - 1, -step))
    if m := _CHAR_RANGE.match(expr):
        return len(list(braceexpand.braceexpand("{" + expr + "}")))  # letters: 52 at most
    marks = list(_scan(expr))
    commas = [pos for pos, c, depth in marks if c == "," and depth == 0]
    balanced = sum((c == "{") - (c == "}") for _, c, _ in marks) == 0
    if not balanced or not commas:  # not a list: the braces stay, their inside is expanded
        return brace_count(expr)
    bounds = [-1, *commas, len(expr)]
    return sum(brace_count(expr[a + 1 : b]) for a, b in zip(bounds, bounds[1:]))


#: what one dataset's ``source`` may be, for messages
SOURCES = "a dataset folder or URL, an index file, a shard pattern or a list of shard URLs"


def resolve_source(
    source: str | Sequence[str],
    index: str | ShardIndex | None,
    storage_options: dict | None,
    shard_roots: Sequence[str] = (),
    cache_dir: str | None = None,
) -> tuple[ShardIndex | None, Sequence[str]]:
    """(index or None, shard URLs) for a dataset folder, an index file, a shard pattern or a URL list; an
    index's URLs are resolved one at a time (`ShardURLs`), never listed whole, each inside the index's
    folder or one of ``shard_roots`` (`trust`). Shard URLs the user lists are the user's own: not checked.
    ``cache_dir``: a remote index is read once per node into it and shared (`shared_index`)."""
    if isinstance(index, ShardIndex):
        return index.allow(shard_roots), ShardURLs(index)
    if index is not None:
        ix = load_index(str(index), storage_options, shard_roots, cache_dir)
        return ix, ShardURLs(ix)
    if isinstance(source, ShardIndex):
        return source.allow(shard_roots), ShardURLs(source)
    if isinstance(source, (list, tuple)):
        return None, expand_urls(source)
    source = path_option(
        "source", source, "a dataset folder or URL, an index file, a shard pattern or a list of shard URLs"
    )
    if is_index_file(source):
        ix = load_index(source, storage_options, shard_roots, cache_dir)
        return ix, ShardURLs(ix)
    if source.endswith(".tar") or "{" in source:
        return None, expand_urls(source)
    index_url = storage.join_url(source, INDEX_NAME)
    try:  # no separate existence check: one request less per rank (and none with a node copy)
        ix = load_index(index_url, storage_options, shard_roots, cache_dir)
    except FileNotFoundError as e:
        raise DatasetNotFound(
            f"{source}: no {INDEX_NAME} here. Pass a dataset folder written by `shardify write`, an index file, "
            f"a shard pattern like '{source}/shard-{{000000..000009}}.tar', or a list of shard URLs."
        ) from e
    return ix, ShardURLs(ix)


def open_source(
    source: Any,
    weights: Any,
    index: str | ShardIndex | None,
    storage_options: dict | None,
    shard_roots: Sequence[str] = (),
    max_plan_bytes: int | None = None,
    cache_dir: str | None = None,
) -> tuple[AnyIndex | None, Sequence[str], str]:
    """(index or None, shard URLs, a name for messages) for what the loader reads: one dataset or a mixture of
    several; every shard URL an index names is checked against its roots here, before anything is read. With a
    ``cache_dir`` (one that cannot be written is an `OptionError` here), one dataset's remote index is read
    once per node (`shared_index`)."""
    if cache_dir is not None:
        check_cache_dir(cache_dir)  # a cache that cannot work stops the build, not the reading later
    sources = mixture_sources(source, weights, shard_roots)
    ix: AnyIndex | None
    urls: Sequence[str]
    if sources is not None:
        if index is not None:
            raise OptionError(
                "index= gives one dataset's index, and source names a mixture (each with its own): drop it"
            )
        extra = {} if max_plan_bytes is None else {"max_plan_bytes": max_plan_bytes}
        ix = MixedIndex.open(sources, storage_options, shard_roots, **extra)
        urls, name = ShardURLs(ix), "mixture of " + ", ".join(ix.names)
    else:
        ix, urls = resolve_source(source, index, storage_options, shard_roots, cache_dir)
        name = str(source) if isinstance(source, str) else (ix.root if ix is not None else None) or ""
    if ix is not None:
        ix.check_urls()  # a shard URL outside the roots stops the run here, before any read
    if not urls:
        raise OptionError(f"{shown(source, 200)}: no shards found")
    return ix, urls, name
