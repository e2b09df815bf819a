"""Stage then swap: the one transaction that replaces a set of entries of a local folder as a whole, so that a
reader finds the whole old set or the whole new one, never a mix, even after ``kill -9`` at any point.

`Aside` is the transaction. The entries the new set replaces are renamed into a hidden folder beside them (renames
cost neither time nor space, and the old set stays whole there), the entry that says a set is complete (an
index) first; a marker file then says that every old entry is aside. The new set is then written or moved in,
its completing entry last. Once it is in place the aside folder is renamed to ``*.discarded`` and removed (a
removal cut short never leaves part of a set to put back). If the new set fails or is interrupted, what it made
is removed (only once the marker is there: before it, the folder holds nothing new) and the old entries are
renamed back, the completing one last. A process killed outright leaves the aside folder, and the next run,
under the folder's lock, finishes the transaction (`Aside.recover()`): a complete new set is kept (the aside
folder removed), anything else is undone (the old set put back).

Its users: ``write --overwrite`` of a local OUT (`aside`: the dataset, written in place while the old one waits
aside), ``export --overwrite`` (`Swap`: the new set written into a staging folder first, then moved in with a
handful of renames), ``merge`` (`restore`: the files it replaces kept by hard links, `Aside.keep()`, so that
readers still find them until the new ones are written) and ``stage --overwrite`` into a local DEST
(`stage_dest.publish()`: the new shards copied to a waiting folder while the old dataset stays readable, then
swapped in). Object storage has no rename: there the rule is an index written last in one atomic step, its
tables under names the index in place does not use (`format.index_swap`, which needs no aside folder locally
either: its one rename of the header is the swap), and ``stage`` removes the old index only where a new file
must take one of its files' names. ``write --resume`` (`rerun`) only checks what OUT holds and replaces nothing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..io.tempname import is_temporary, temporary_name

#: the file in an aside folder saying that every replaced entry is in it (the new set may be moving in)
ALL_ASIDE = ".all-set-aside"
#: the suffix an aside folder is renamed to before it is removed (a removal cut short leaves no half set aside)
DISCARDED = ".discarded"


@dataclass(frozen=True)
class Aside:
    """The hidden folder ``path`` where the entries of the local ``folder`` that a replacement replaces wait until
    it is complete (see the module docstring)."""

    folder: str
    path: str

    def exists(self) -> bool:
        return os.path.isdir(self.path)

    def complete(self) -> bool:
        """Whether every old entry is aside (the new set may have begun to move in)."""
        return os.path.exists(os.path.join(self.path, ALL_ASIDE))

    def set_aside(self, names: Iterable[str], drop: Callable[[str], bool] | None = None) -> None:
        """Rename the entries ``names`` of the folder (in that order: the completing one first) into the aside
        folder, then mark it complete; an entry that is not there is skipped. An entry for which ``drop(name)``
        is true is removed instead (one that other writers share and may change meanwhile)."""
        os.makedirs(self.path, exist_ok=True)
        for name in names:
            with contextlib.suppress(FileNotFoundError):  # a temporary file another writer removed meanwhile
                if drop is not None and drop(name):
                    remove_entry(os.path.join(self.folder, name))
                else:
                    os.rename(os.path.join(self.folder, name), os.path.join(self.path, name))
        open(os.path.join(self.path, ALL_ASIDE), "wb").close()

    def keep(self, names: Iterable[str]) -> None:
        """As `set_aside()`, but the entries stay in place while the new set is written over them (readers keep
        reading them): each file is hard-linked into the aside folder, which costs no space, or copied where the
        filesystem has no hard links; an entry that is not there is skipped."""
        os.makedirs(self.path, exist_ok=True)
        for name in names:
            src, dst = os.path.join(self.folder, name), os.path.join(self.path, name)
            if not os.path.exists(src):
                continue
            try:
                os.link(src, dst)
            except OSError:
                try:
                    shutil.copy2(src, dst)
                except BaseException:  # no space for the copy: no partial one is ever put back
                    with contextlib.suppress(OSError):
                        os.remove(dst)
                    raise
        open(os.path.join(self.path, ALL_ASIDE), "wb").close()

    def put_back(self, made: Callable[[], Iterable[str]], last: Callable[[str], Any]) -> None:
        """Undo a replacement that did not finish: once every old entry is aside, remove what the new set made
        (``made()``: its names in the folder), then rename the old entries back in the order of the sort key
        ``last`` (the completing one last), and remove the aside folder."""
        if not self.exists():
            return
        if self.complete():
            for name in made():
                remove_entry(os.path.join(self.folder, name))
            os.remove(os.path.join(self.path, ALL_ASIDE))
        for name in sorted(os.listdir(self.path), key=last):
            target = os.path.join(self.folder, name)
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)
            os.replace(os.path.join(self.path, name), target)
            if os.path.lexists(os.path.join(self.path, name)):  # two links to one file: the rename did nothing
                os.remove(os.path.join(self.path, name))
        with contextlib.suppress(OSError):
            os.rmdir(self.path)

    def discard(self) -> None:
        """Remove the aside folder: renamed first, so that a removal cut short never leaves part of a set."""
        gone = self.path + DISCARDED
        shutil.rmtree(gone, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.rename(self.path, gone)
        shutil.rmtree(gone, ignore_errors=True)

    def clear_discarded(self) -> None:
        """Remove what a removal of the aside folder cut short left."""
        shutil.rmtree(self.path + DISCARDED, ignore_errors=True)

    def recover(self, finished: bool, made: Callable[[], Iterable[str]], last: Callable[[str], Any]) -> str | None:
        """Finish what a process killed inside the transaction left (call it holding the folder's lock): with the
        old set all aside and the new one ``finished`` (its completing entry in place), remove the aside folder
        ("removed"); otherwise put the old set back ("put back"). None: nothing was left."""
        self.clear_discarded()
        if not self.exists():
            return None
        if self.complete() and finished:
            self.discard()
            return "removed"
        self.put_back(made, last)
        return "put back"


def remove_entry(path: str) -> None:
    """Remove a file, link or folder (a folder's links, not what they point to); nothing there is not an error."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


@dataclass(frozen=True)
class Swap:
    """The set of entries ``names`` of the local ``folder`` (the last one says the set is complete), staged under
    temporary names of ``folder/stage`` and set aside in ``folder/aside`` while the new set moves in
    (``shardify export --overwrite``: a few named files and folders that a single command owns)."""

    folder: str
    names: tuple[str, ...]
    stage: str
    aside: str

    @property
    def aside_path(self) -> str:
        return os.path.join(self.folder, self.aside)

    def _aside(self) -> Aside:
        return Aside(self.folder, self.aside_path)

    def _last(self, name: str) -> bool:
        return name == self.names[-1]

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
        aside = self._aside()
        try:
            os.makedirs(aside.path)  # a leftover one is recovered first, under the lock: never two transactions
            aside.set_aside(reversed(self.names))
            for name in self.names:
                if os.path.lexists(os.path.join(staged, name)):
                    os.rename(os.path.join(staged, name), os.path.join(self.folder, name))
        except BaseException:
            aside.put_back(lambda: self.names, self._last)
            raise
        with contextlib.suppress(OSError):  # the new set is in place: what is left aside, the next run removes
            aside.discard()

    def recover(self) -> str | None:
        """Finish what a run killed while publishing left (call it holding the folder's lock): keep a complete new
        set, else put the old one back. Says what was done (None: nothing was left)."""
        finished = os.path.lexists(os.path.join(self.folder, self.names[-1]))
        done = self._aside().recover(finished, lambda: self.names, self._last)
        if done == "removed":
            return f"removed {self.aside_path}: what an earlier run replaced (that run finished but did not remove it)"
        if done == "put back":
            return (
                f"an earlier run was killed while replacing what {self.folder} held: put it back from {self.aside_path}"
            )
        return None
