"""Where a data file may point: the one check on every URL an index or a mixture file makes the program open.

An index is data, not configuration. Each URL it names (a shard; a dataset a mixture file lists) must resolve
inside the dataset's own root: its folder, or for object storage and HTTP its prefix on the same scheme and host.
Anything else (a ``..`` that leaves the root once the path is normalised, an absolute path elsewhere, ``file://``
to elsewhere, another scheme or host) is refused before it is opened or requested, unless the *user* allowed
that place: ``StreamBatchLoader(..., shard_roots=[...])`` or ``shardify ... --shard-root ROOT``. Nothing an index
holds can widen what it may reach.

The check is string work only (no filesystem access): once per URL where an index is loaded or its shard URLs are
resolved, never per sample. Links inside an allowed root are followed as the filesystem resolves them: they are
the filesystem owner's, not the index's.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

from ..errors import IndexFormatError, OptionError, UntrustedURL

#: a normalised place: (scheme, or chain of schemes; host; absolute path)
Place = tuple[str, str, str]


def place(url: str) -> Place:
    """Where ``url`` points, normalised: local paths and ``file://`` URLs as absolute paths with ``..`` resolved;
    other URLs as (scheme, host, path) with the path percent-decoded and ``..`` resolved. A chained fsspec URL
    (``simplecache::s3://...``) keeps its chain in the scheme, so it only matches a root with the same chain."""
    url = os.fspath(url)
    chain, _, target = url.rpartition("::")
    scheme, sep, rest = target.partition("://")
    if not sep or scheme.lower() == "file":
        path = rest if sep else target
        return (chain + "::file" if chain else "file", "", os.path.abspath(path or "."))
    parts = urlsplit(target)
    path = posixpath.normpath("/" + unquote(parts.path).replace("\\", "/").lstrip("/"))
    path = "/" + path.lstrip("/")  # normpath keeps a leading "//"
    return ((chain + "::" if chain else "") + scheme.lower(), parts.netloc.lower(), path)


def inside(url: Place, root: Place) -> bool:
    """Whether ``url`` is ``root`` or under it (same scheme and host, the path under the root's folder)."""
    if url[:2] != root[:2]:
        return False
    r = root[2].rstrip("/")
    return not r or url[2] == r or url[2].startswith(r + "/")


def is_plain(url: str) -> bool:
    """Whether ``url`` has nothing to normalise: no ``.`` or empty path segments, escapes, backslashes or chains."""
    rest = url.partition("://")[2] or url
    return not ("/." in rest or "//" in rest or "%" in rest or "\\" in rest or "::" in url)


def plainly_inside(entry: str) -> bool:
    """Whether a relative entry of an index (joined onto its root) stays inside the root without normalising it:
    no scheme, not absolute, no ``..``, no escapes or chains (the fast path of almost every shard url)."""
    return not (entry.startswith(("/", "\\", "~")) or "://" in entry or ".." in entry or "%" in entry or "::" in entry)


def shard_roots_option(roots: Any, name: str = "shard_roots") -> tuple[str, ...]:
    """The user's extra roots as a tuple of strings: a list of folders or URLs (one string is one root), each
    non-empty; else an `OptionError` naming the option."""
    if roots is None:
        return ()
    if isinstance(roots, (str, os.PathLike)):
        roots = [roots]
    if not isinstance(roots, Iterable):
        raise OptionError(f"{name} must be a list of folders or URLs, got {roots!r}")
    out = []
    for r in roots:
        if not isinstance(r, (str, os.PathLike)) or not os.fspath(r):
            raise OptionError(f"{name} must be a list of folders or URLs, got {r!r} in it")
        out.append(os.fspath(r))
    return tuple(out)


class Roots:
    """The places one data file's URLs may point to: its own root (a dataset's folder or prefix) and the roots
    the user allowed. `check()` refuses any other URL with one line naming it and how to allow it."""

    def __init__(self, own: str | None, allowed: Sequence[str] = (), source: str = "the index") -> None:
        self.own = own
        self.allowed = shard_roots_option(allowed)
        self.source = source
        self.places = [place(r) for r in ([own] if own else []) + list(self.allowed)]
        #: each root as the text a plain URL under it starts with (a fast accept; anything else is normalised)
        self.prefixes = tuple(_root_text(s, h, p).rstrip("/") + "/" for s, h, p in self.places if "::" not in s)

    def __repr__(self) -> str:
        return f"Roots(own={self.own!r}, allowed={list(self.allowed)!r})"

    def contains(self, url: str) -> bool:
        """Whether ``url`` resolves inside one of the roots."""
        if url.startswith(self.prefixes) and is_plain(url):
            return True
        where = place(url)
        return any(inside(where, root) for root in self.places)

    def check(self, url: str, what: str = "shard", suggest: str | None = None) -> str:
        """``url`` once it is inside a root, else `UntrustedURL` (before anything opens it), whose message
        suggests allowing ``suggest`` (default: the folder holding ``url``)."""
        if not self.contains(url):
            raise UntrustedURL(refusal(url, self.own, self.source, what, suggest))
        return url

    def check_entry(self, entry: str, url: str, what: str = "shard") -> str:
        """``url`` (``entry`` as the data file wrote it, resolved to ``url``) once it is inside a root."""
        if not isinstance(entry, str):
            raise IndexFormatError(f"{self.source}: a {what} url must be text, got {entry!r}")
        if self.own and plainly_inside(entry):
            return url
        return self.check(url, what)


def refusal(url: str, own: str | None, source: str, what: str, suggest: str | None = None) -> str:
    """The one line that refuses ``url``: what named it, where it had to be, and the option that allows it."""
    suggest = suggest or suggested_root(url)
    within = f"outside the dataset's root {own}" if own else "not under a root you allowed"
    return (
        f"{source}: {what} {url} is {within}; refused before opening it. If you trust this data, allow that place: "
        f"shard_roots=[{suggest!r}] (shardify: --shard-root {suggest})"
    )


def suggested_root(url: str) -> str:
    """The folder (or prefix) holding ``url``, as the root to allow for it."""
    scheme, host, path = place(url)
    return _root_text(scheme, host, posixpath.dirname(path))


def _root_text(scheme: str, host: str, folder: str) -> str:
    """A root as a user writes it: a local folder as a path, else ``scheme://host/folder/``."""
    return folder if scheme == "file" else f"{scheme}://{host}{folder.rstrip('/')}/"


def roots_for(urls: Iterable[str], own: str) -> list[str]:
    """The roots to allow for the ``urls`` outside ``own``: one common folder per scheme and host (the shortest
    list a user can paste); empty when every url is inside ``own``."""
    roots = Roots(own)
    groups: dict[tuple[str, str], list[str]] = {}
    for url in urls:
        if not roots.contains(url):
            scheme, host, path = place(url)
            groups.setdefault((scheme, host), []).append(posixpath.dirname(path))
    return [_root_text(scheme, host, os.path.commonpath(folders)) for (scheme, host), folders in sorted(groups.items())]


def allow_line(roots: Sequence[str], own: str) -> str:
    """The line a command prints when the dataset it made points outside ``own``: how to load it."""
    listed = ", ".join(repr(r) for r in roots)
    flags = " ".join(f"--shard-root {r}" for r in roots)
    return f"shards live outside {own}: load with shard_roots=[{listed}] (shardify: {flags})"
