"""Replacing a few named files and folders of a local folder as one set (``shardify export --overwrite``), so the
folder holds either the whole old set or the whole new one, never a mix.

The new set is written into a staging folder in the folder (`Swap.staging()`: a temporary name,
`tempname`). `Swap.publish()` then moves the old set into a hidden aside folder,
the entry that says the set is complete (the last name) first, marks the aside folder complete, and renames the
new entries into place, the last name last: a handful of renames whatever the set's size. An error or interrupt
while publishing moves the old set back. A process killed outright leaves the aside folder; the next run, under
the folder's lock, finishes what it left (`Swap.recover()`): a complete new set is kept (the aside folder is
removed), anything else is undone (the old set put back). Leftover staging folders of runs that were killed are
removed (`Swap.clear_staging()`). The same idea as `aside` (a whole dataset's ``--overwrite``), for sets
of entries a single command owns.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass

from ..io.tempname import is_temporary, temporary_name

#: the file in an aside folder saying that every old entry is in it (the new ones may be moving in)
_ALL_ASIDE = ".all-set-aside"
#: the suffix an aside folder is renamed to before it is removed (a removal cut short leaves no half set aside)
_DISCARDED = ".discarded"


@dataclass(frozen=True)
class Swap:
    """The set of entries ``names`` of the local ``folder`` (the last one says the set is complete), staged under
    temporary names of ``folder/stage`` and set aside in ``folder/aside`` while the new set moves in."""

    folder: str
    names: tuple[str, ...]
    stage: str
    aside: str

    @property
    def aside_path(self) -> str:
        return os.path.join(self.folder, self.aside)

    def staging(self) -> str:
        """A new, empty staging folder to write the new set into (same names as in the folder)."""
        path = temporary_name(os.path.join(self.folder, self.stage))
        os.makedirs(path)
        return path

    def clear_staging(self) -> None:
        """Remove the staging folders runs that were killed left (call it holding the folder's lock)."""
        for name in os.listdir(self.folder) if os.path.isdir(self.folder) else []:
            if is_temporary(name, self.stage):
                shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)

    def publish(self, staged: str) -> None:
        """Replace the set in the folder by the entries in ``staged`` (one missing there is absent from the new set).
        An error or interrupt puts the old set back and is raised again; ``staged`` is left to its caller."""
        try:
            self._set_aside()
            for name in self.names:
                if os.path.lexists(os.path.join(staged, name)):
                    os.rename(os.path.join(staged, name), os.path.join(self.folder, name))
        except BaseException:
            self._put_back()
            raise
        with contextlib.suppress(OSError):  # the new set is in place: what is left aside, the next run removes
            _discard(self.aside_path)

    def recover(self) -> str | None:
        """Finish what a run killed while publishing left (call it holding the folder's lock): keep a complete new
        set, else put the old one back. Says what was done (None: nothing was left)."""
        shutil.rmtree(self.aside_path + _DISCARDED, ignore_errors=True)
        if not os.path.isdir(self.aside_path):
            return None
        if _all_aside(self.aside_path) and os.path.lexists(os.path.join(self.folder, self.names[-1])):
            _discard(self.aside_path)
            return f"removed {self.aside_path}: what an earlier run replaced (that run finished but did not remove it)"
        self._put_back()
        return f"an earlier run was killed while replacing what {self.folder} held: put it back from {self.aside_path}"

    def _set_aside(self) -> None:
        """Move the old set into the aside folder, the last name first, then mark it complete."""
        os.makedirs(self.aside_path)
        for name in reversed(self.names):
            if os.path.lexists(os.path.join(self.folder, name)):
                os.rename(os.path.join(self.folder, name), os.path.join(self.aside_path, name))
        open(os.path.join(self.aside_path, _ALL_ASIDE), "wb").close()

    def _put_back(self) -> None:
        """Undo a replacement that did not finish: remove what the new set moved in (only once the old set is all
        aside; before, the folder holds nothing new), then move the old entries back, the last name last."""
        if not os.path.isdir(self.aside_path):
            return
        if _all_aside(self.aside_path):
            for name in self.names:
                _remove(os.path.join(self.folder, name))
            os.remove(os.path.join(self.aside_path, _ALL_ASIDE))
        for name in self.names:
            if os.path.lexists(os.path.join(self.aside_path, name)):
                os.rename(os.path.join(self.aside_path, name), os.path.join(self.folder, name))
        with contextlib.suppress(OSError):
            os.rmdir(self.aside_path)


def _all_aside(aside: str) -> bool:
    return os.path.exists(os.path.join(aside, _ALL_ASIDE))


def _remove(path: str) -> None:
    """Remove a file, link or folder (a folder's links, not what they point to); nothing there is not an error."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _discard(aside: str) -> None:
    """Remove ``aside``: renamed first, so that a removal cut short never leaves part of a set to put back."""
    gone = aside + _DISCARDED
    shutil.rmtree(gone, ignore_errors=True)
    os.rename(aside, gone)
    shutil.rmtree(gone, ignore_errors=True)
