"""The one temporary-name format of files written beside their final name and renamed into place, so a writer
that finds another's leftovers (one killed mid-write) knows them."""

from __future__ import annotations

import re
import uuid

#: what follows a file's name in its temporary name while it is written (`temporary_name()`)
_TEMPORARY = re.compile(r"\.tmp-[0-9a-f]{8}")


def temporary_name(path: str) -> str:
    """A fresh temporary name beside ``path`` to write it under before renaming it into place."""
    return f"{path}.tmp-{uuid.uuid4().hex[:8]}"


def is_temporary(name: str, final: str) -> bool:
    """Whether ``name`` is a `temporary_name()` of ``final`` (a writer's, perhaps one killed mid-write)."""
    return name.startswith(final) and _TEMPORARY.fullmatch(name[len(final) :]) is not None
