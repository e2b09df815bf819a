"""Several datasets read as one: the mixture a user names (sources and weights, or a mixture file) and
`MixedIndex`, which presents their indexes to the planner and the readers as one shard list.

Each dataset enters as ``copies`` virtual copies of its shards (`DatasetDraw`);
per epoch the samples a copy does not take are excluded from the plan, so every guarantee of a single dataset
(exact ``len``, equal steps, exact resume) holds over the mixture. Nothing here lists samples: virtual shards
map to real ones in O(datasets).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np

from ..errors import DatasetNotFound, IndexFormatError, OptionError, number_option, path_option, shown
from ..format.index import INDEX_NAME, ShardIndex, is_index_file
from ..format.trust import Roots
from ..io import storage
from ..plan.mixing import MAX_PLAN_BYTES, DatasetDraw, Selection, check_plan_size
from ..stats import LengthStats, stream_stats

MIXTURE_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class Source:
    """One dataset of a mixture: its name (``batch["dataset"]``), where it is, and its weight."""

    name: str
    url: str
    weight: float = 1.0


def mixture_sources(source: Any, weights: Any = None, shard_roots: Sequence[str] = ()) -> list[Source] | None:
    """The datasets a loader ``source`` names, or None for a single dataset: a ``{name: url}`` mapping, a
    list of dataset folders (with ``weights``), or a mixture file (``.yaml``/``.yml``, or ``.json`` holding
    ``datasets``; `load_mixture()`, whose datasets must lie beside it or under ``shard_roots``). A mixture names
    at least one dataset, by a non-empty string, at a path or URL: else an `OptionError`."""
    if isinstance(source, Mapping) and not source:
        raise OptionError("source is an empty mapping: a mixture needs at least one dataset ({name: folder})")
    if isinstance(source, Mapping):
        items = [(_dataset_name(k), path_option(f"source[{k!r}]", v, DATASET)) for k, v in source.items()]
    elif isinstance(source, (list, tuple)) and not source:
        raise OptionError(
            f"source is an empty {type(source).__name__}: a mixture needs at least one dataset "
            "(and a list of shard URLs at least one URL)"
        )
    elif isinstance(source, (list, tuple)) and weights is not None:
        items = [(_name(u), u) for u in (path_option(f"source[{i}]", v, DATASET) for i, v in enumerate(source))]
    elif isinstance(source, str) and _is_mixture_file(source):
        if weights is not None:
            raise OptionError(f"{source}: a mixture file holds its weights; do not pass weights= as well")
        return load_mixture(source, shard_roots)
    elif weights is not None:
        raise OptionError("weights= needs several datasets: a {name: folder} mapping or a list of folders")
    else:
        return None
    return _sources(items, weights)


def _sources(items: list[tuple[str, str]], weights: Any) -> list[Source]:
    """``(name, url)`` pairs with their weights as sources; there is at least one, and the names differ."""
    if not items:
        raise OptionError("a mixture needs at least one dataset, got none")
    names = [n for n, _ in items]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise OptionError(
            f"dataset names must differ; {', '.join(dup)} appears more than once (use a {{name: folder}} mapping)"
        )
    w = weights_by_name(weights, names)
    return [Source(n, u, w[n]) for n, u in items]


def _name(url: str) -> str:
    return os.path.basename(url.rstrip("/")) or url


#: what a mixture's dataset is, for messages
DATASET = "a dataset folder, index file or URL"


def _dataset_name(name: Any) -> str:
    """A mixture's dataset name (a key of the ``{name: folder}`` mapping): text that is not empty, as
    ``batch["dataset"]`` and ``weights`` name it."""
    if not isinstance(name, str) or not name:
        raise OptionError(f"a mixture's dataset names must be non-empty strings, got {name!r}")
    return name


def weights_by_name(weights: Any, names: list[str]) -> dict[str, float]:
    """Each dataset's weight from ``weights`` as the user gave them (a ``{name: weight}`` mapping, a dataset not
    named weighing 1, or a list of numbers in the datasets' order), checked: finite numbers of at least 0, not all
    0 (an epoch would take no sample), else an `OptionError` naming the weight."""
    if weights is None:
        return {n: 1.0 for n in names}
    if isinstance(weights, Mapping):
        unknown = sorted(map(str, set(weights) - set(names)))
        if unknown:
            raise OptionError(f"weights name unknown datasets: {', '.join(unknown)} (datasets: {', '.join(names)})")
        out = {n: _weight(f"weights[{n!r}]", weights.get(n, 1.0)) for n in names}
    elif isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
        raise OptionError(f"weights must be a {{name: weight}} mapping or a list of numbers, got {weights!r}")
    elif len(weights) != len(names):
        raise OptionError(f"{len(weights)} weights for {len(names)} datasets")
    else:
        out = {n: _weight(f"weights[{i}]", w) for i, (n, w) in enumerate(zip(names, weights))}
    if names and not any(out.values()):
        raise OptionError(f"weights are all 0, got {shown(weights)}: at least one dataset needs a weight above 0")
    return out


def _weight(name: str, value: Any) -> float:
    """One dataset's weight: a finite number, at least 0."""
    return number_option(name, value, 0)


def _is_mixture_file(source: str) -> bool:
    if source.endswith(MIXTURE_SUFFIXES):
        return True
    return is_index_file(source) and os.path.basename(source) != INDEX_NAME and "datasets" in _read_spec(source)


def _read_spec(url: str) -> dict:
    with storage.open_url(url, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
        if url.endswith(MIXTURE_SUFFIXES):
            import yaml

            spec = yaml.safe_load(text)
        else:
            spec = json.loads(text)
    except Exception as e:  # noqa: BLE001 - any parse error is the file's problem, said in one line
        said = " ".join(str(e).split())  # a YAML error spans lines: one line here
        raise IndexFormatError(f"{url}: not a readable mixture file ({type(e).__name__}: {said})") from None
    return spec if isinstance(spec, dict) else {}


def load_mixture(url: str, shard_roots: Sequence[str] = ()) -> list[Source]:
    """The datasets of a mixture file: ``datasets:`` as a list of ``{name, path, weight}`` or a mapping
    ``name: {path, weight}`` (or ``name: path``); relative paths are relative to the file. A mixture file is
    data: each dataset must lie in the file's folder or under one of the user's ``shard_roots`` (`trust`),
    else `UntrustedURL` before it is opened."""
    spec = _read_spec(url).get("datasets")
    if isinstance(spec, Mapping):
        spec = [_entry_of(url, k, v) for k, v in spec.items()]
    if not isinstance(spec, list) or not spec:
        raise IndexFormatError(f"{url}: a mixture file needs a non-empty 'datasets' list or mapping")
    for i, d in enumerate(spec):
        _check_keys(url, f"dataset {i + 1}", d, ENTRY_KEYS)
    base = storage.parent_url(url)
    roots = Roots(base or ".", shard_roots, url)
    out = []
    for i, d in enumerate(spec):
        if not isinstance(d, Mapping) or "path" not in d:
            raise IndexFormatError(f"{url}: dataset {i + 1} needs a 'path'")
        path = str(d["path"])
        if "://" not in path and not os.path.isabs(path):
            path = storage.join_url(base, path)
        name = str(d.get("name") or _name(path))
        roots.check(path, f"dataset {name!r}" if "name" in d else f"dataset {path!r}", path)
        out.append(Source(name, path, _weight(f"{url}: the weight of dataset {name!r}", d.get("weight", 1.0))))
    return _sources([(s.name, s.url) for s in out], {s.name: s.weight for s in out})


#: the keys of a dataset's entry in a mixture file (a mapping's entries are named by their key)
ENTRY_KEYS = ("name", "path", "weight")


def _entry_of(url: str, name: Any, value: Any) -> Any:
    """A ``name: {path, weight}`` (or ``name: path``) entry of the mapping form as a list entry."""
    if not isinstance(value, Mapping):
        return {"name": name, "path": value}
    _check_keys(url, f"dataset {str(name)!r}", value, ENTRY_KEYS[1:])
    return {"name": name, **value}


def _check_keys(url: str, which: str, entry: Any, allowed: Sequence[str]) -> None:
    """A misspelt key (``wieght``) would be ignored and its default taken: an `IndexFormatError` naming it."""
    unknown = sorted(str(k) for k in entry if k not in allowed) if isinstance(entry, Mapping) else []
    if unknown:
        raise IndexFormatError(
            f"{url}: {which} has unknown keys: {', '.join(map(repr, unknown))} (an entry takes {', '.join(allowed)})"
        )


class VirtualShards(Sequence):
    """The mixture's shard list: virtual shard ``v`` is shard ``s`` of dataset ``d`` (copy ``r``)."""

    def __init__(self, mixed: MixedIndex):
        self.mixed = mixed

    def __len__(self) -> int:
        return int(self.mixed.first_shard[-1])

    def __getitem__(self, v: Any) -> Any:
        if isinstance(v, slice):
            return [self[i] for i in range(*v.indices(len(self)))]
        d, s = self.mixed.real_shard(int(v))
        return self.mixed.indexes[d].shards[s]


class MixedIndex:
    """The indexes of a mixture's datasets as one index: the planner's shard table and lengths, the readers'
    shard URLs and checksums, and each epoch's `Selection`."""

    def __init__(
        self,
        sources: Sequence[Source],
        indexes: Sequence[ShardIndex],
        max_plan_bytes: int = MAX_PLAN_BYTES,
        starts: Sequence[int] | None = None,
        tables: list[dict[str, np.ndarray]] | None = None,
    ):
        self.sources, self.indexes = list(sources), list(indexes)
        self.names = [s.name for s in self.sources]
        _check_units(self.sources, self.indexes)
        self.unit, self.sample_rate = self.indexes[0].unit, self.indexes[0].sample_rate
        self.root: str | None = None
        self.meta: dict[str, Any] = {}
        self.version, self.max_plan_bytes, self.starts = 2, max_plan_bytes, starts
        self.draws = [
            DatasetDraw.of(ix.num_samples, s.weight, 0, d, None if starts is None else starts[d])
            for d, (s, ix) in enumerate(zip(self.sources, self.indexes))
        ]
        self._tables = tables or [
            ix.shard_table(("count", "total_length", "min_length", "max_length")) for ix in indexes
        ]
        shards = [len(t["count"]) for t in self._tables]
        check_plan_size([(s.name, s.weight) for s in self.sources], self.draws, shards, max_plan_bytes)
        # the virtual shards: for each dataset, its shards once per copy, in blocks of (dataset, copy)
        self.blocks = [(d, r) for d, draw in enumerate(self.draws) for r in range(draw.copies)]
        self._block = np.array(self.blocks, dtype=np.int64).reshape(-1, 2)
        sizes = [len(self._tables[d]["count"]) for d, _ in self.blocks]
        self.first_shard = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._count = self._column("count").astype(np.int64)
        self._first_gid = np.concatenate([[0], np.cumsum(self._count)]).astype(np.int64)
        self.shards = VirtualShards(self)

    @classmethod
    def open(
        cls,
        sources: Sequence[Source],
        storage_options: dict | None = None,
        shard_roots: Sequence[str] = (),
        max_plan_bytes: int = MAX_PLAN_BYTES,
    ) -> MixedIndex:
        """Load each dataset's index (a folder holding ``index.json`` or an index file); its shard URLs must lie
        in its folder or under ``shard_roots`` (`ShardIndex.load()`), and a plan the weights make larger than
        ``max_plan_bytes`` is refused before it is built (`check_plan_size()`)."""
        indexes = []
        for s in sources:
            url = s.url if is_index_file(s.url) else storage.join_url(s.url, INDEX_NAME)
            if not storage.exists(url, storage_options):
                raise DatasetNotFound(
                    f"dataset {s.name!r}: no {INDEX_NAME} at {s.url} (a mixture needs indexed datasets)"
                )
            indexes.append(ShardIndex.load(url, storage_options, shard_roots))
        return cls(sources, indexes, max_plan_bytes)

    def reweighted(self, weights: Mapping[str, float], starts: Sequence[int]) -> MixedIndex:
        """The same datasets with other weights, each dataset's window beginning at ``starts`` in its cycle
        sequence (one epoch of a weight schedule): the indexes are shared, the virtual shards laid out anew, the
        plan's size checked against ``max_plan_bytes`` as at construction."""
        sources = [dataclasses.replace(s, weight=float(weights[s.name])) for s in self.sources]
        return MixedIndex(sources, self.indexes, self.max_plan_bytes, list(starts), self._tables)

    def check_urls(self) -> None:
        """Refuse the mixture if a dataset's shard URL points outside its roots (`ShardIndex.check_urls()`)."""
        for ix in self.indexes:
            ix.check_urls()

    # ---- virtual shards ---------------------------------------------------------------------------
    def real_shard(self, v: int) -> tuple[int, int]:
        """(dataset, shard in that dataset's index) of virtual shard ``v``."""
        b = int(np.searchsorted(self.first_shard, v, side="right")) - 1
        return self.blocks[b][0], v - int(self.first_shard[b])

    def block_of(self, shards: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.first_shard, shards, side="right") - 1

    def dataset_of_shard(self, shards: np.ndarray) -> np.ndarray:
        """The dataset number of each virtual shard."""
        return self._block[self.block_of(np.asarray(shards)), 0]

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def _column(self, name: str) -> np.ndarray:
        parts = [self._tables[d][name] for d, _ in self.blocks]
        return np.concatenate(parts) if parts else np.zeros(0)

    @property
    def num_samples(self) -> int:
        """Samples in the plan's id space: every copy of every dataset, whether an epoch takes them or not."""
        return int(self._first_gid[-1])

    @property
    def total_length(self) -> float:
        return float(self._column("total_length").sum())

    def shard_table(
        self, columns: Sequence[str] = ("count", "total_length", "max_length", "min_length")
    ) -> dict[str, np.ndarray]:
        out = {k: self._column(k) for k in columns}
        out["first"] = self._first_gid[:-1].copy()
        return out

    def deal_scale(self) -> np.ndarray:
        """Per virtual shard, the expected share of it an epoch takes: shards are dealt by expected length."""
        shares = [np.full(len(self._tables[d]["count"]), self.draws[d].expected_share(r)) for d, r in self.blocks]
        return np.concatenate(shares) if shares else np.zeros(0)

    def _per_dataset(self, shards: Sequence[int], read: str) -> list[np.ndarray]:
        """``index.<read>(its shards)`` of each dataset for these virtual shards, one call per dataset (on a
        version 2 index: one read per row group), in the order asked."""
        out: list[np.ndarray] = [np.zeros(0)] * len(shards)
        real = [self.real_shard(int(v)) for v in shards]
        for d in sorted({d for d, _ in real}):
            mine = [i for i, (dd, _) in enumerate(real) if dd == d]
            for i, arr in zip(mine, getattr(self.indexes[d], read)([real[i][1] for i in mine])):
                out[i] = arr
        return out

    def shard_lengths(self, shards: Sequence[int]) -> list[np.ndarray]:
        return self._per_dataset(shards, "shard_lengths")

    @property
    def has_output_lengths(self) -> bool:
        return all(getattr(ix, "has_output_lengths", False) for ix in self.indexes)

    def shard_output_lengths(self, shards: Sequence[int]) -> list[np.ndarray]:
        """The output lengths of these virtual shards (every dataset must have them)."""
        return self._per_dataset(shards, "shard_output_lengths")

    def shard_url(self, v: int) -> str:
        d, s = self.real_shard(int(v))
        return self.indexes[d].shard_url(s)

    def shard_values(self, v: int, name: str) -> list[Any] | None:
        """A metadata column's values for virtual shard ``v`` (None where its dataset has no such column)."""
        d, s = self.real_shard(int(v))
        return self.indexes[d].shard_values(s, name)

    def has_column(self, name: str) -> bool:
        """Whether any dataset's sample table has the metadata column ``name``."""
        return any(name in ix.columns for ix in self.indexes)

    def sample_offsets(self, v: int) -> Any:
        d, s = self.real_shard(int(v))
        return self.indexes[d].sample_offsets(s)

    def shard_members(self, v: int) -> Any:
        """How virtual shard ``v``'s members map to its samples (its dataset's rule)."""
        d, s = self.real_shard(int(v))
        return self.indexes[d].shard_members(s)

    def seconds_per_unit(self) -> float | None:
        return self.indexes[0].seconds_per_unit()

    def length_stats(self, progress: bool = False) -> LengthStats:
        """Every dataset's lengths once (unweighted), streamed."""
        stats = stream_stats(chunk for ix in self.indexes for chunk in ix.iter_lengths())
        stats.total = float(sum(ix.total_length for ix in self.indexes))
        return stats

    # ---- per epoch --------------------------------------------------------------------------------
    def needs_selection(self) -> bool:
        """Whether the epoch leaves samples out or repeats them (not when each dataset is taken once, in whole
        cycles)."""
        return any(d.take != d.size or (d.start or 0) % max(1, d.size) for d in self.draws)

    def selection(self, epoch: int, seed: int) -> Selection | None:
        """The samples epoch ``epoch`` leaves out (None when every dataset is taken exactly once); the
        datasets' cycles are permuted from ``seed``."""
        if not self.needs_selection():
            return None
        return Selection(self, [dataclasses.replace(d, seed=int(seed)) for d in self.draws], epoch)

    def locate(self, gids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(dataset, copy, sample id within the dataset) of each global id of the plan."""
        shard = np.searchsorted(self._first_gid, gids, side="right") - 1
        block = self.block_of(shard)
        dataset, copy = self._block[block, 0], self._block[block, 1]
        ids = gids - self._first_gid[shard]  # position in the shard
        for d in np.unique(dataset).tolist():
            sel = dataset == d
            ids[sel] += self._tables[d]["first"][shard[sel] - self.first_shard[block[sel]]]
        return dataset, copy, ids

    def state(self) -> list[list[Any]]:
        """What a checkpoint records of the mixture (names, weights, sizes; under a weight schedule also where
        the epoch begins in each dataset's cycles), to refuse another one."""
        rows = [[s.name, s.weight, ix.num_samples] for s, ix in zip(self.sources, self.indexes)]
        return rows if self.starts is None else [[*row, int(a)] for row, a in zip(rows, self.starts)]


def draw_rows(rows: Sequence[Sequence[Any]], epoch: int) -> list[tuple[str, float, int, int]]:
    """A mixture's checkpoint rows (`MixedIndex.state()`) as ``(name, weight, samples, start)``: ``start``, where
    ``epoch`` begins in the dataset's cycles, is recorded under a weight schedule and is ``epoch · round(w·N)``
    under fixed weights (the same draw), so states of either kind compare by the samples their epochs take."""
    out = []
    for name, weight, size, *start in rows:
        take = DatasetDraw.of(int(size), float(weight), 0, 0).take
        out.append((str(name), float(weight), int(size), int(start[0]) if start else int(epoch) * take))
    return out


def _check_units(sources: Sequence[Source], indexes: Sequence[ShardIndex]) -> None:
    """A mixture's datasets share the length unit and sample rate (lengths must be comparable)."""
    a, ia = sources[0], indexes[0]
    for s, ix in zip(sources[1:], indexes[1:]):
        if (ix.unit, ix.sample_rate) != (ia.unit, ia.sample_rate):
            raise IndexFormatError(
                f"datasets {a.name!r} ({ia.unit}" + (f" @ {ia.sample_rate} Hz" if ia.sample_rate else "") + f") and "
                f"{s.name!r} ({ix.unit}" + (f" @ {ix.sample_rate} Hz" if ix.sample_rate else "") + ") have different "
                "length units: a mixture's lengths must be comparable (write them with the same unit and rate)"
            )


#: a dataset's index or a mixture's: what the loader plans from and its readers read through
AnyIndex: TypeAlias = ShardIndex | MixedIndex


def selection_of(index: AnyIndex | None, epoch: int, seed: int) -> Selection | None:
    """The samples epoch ``epoch`` of a mixture leaves out; None for a single dataset."""
    return index.selection(epoch, seed) if isinstance(index, MixedIndex) else None


def dataset_names(index: AnyIndex | None) -> DatasetNames | None:
    """How a worker names each sample's dataset from its (virtual) shard; None for a single dataset."""
    if not isinstance(index, MixedIndex):
        return None
    return DatasetNames(tuple(index.names), index.first_shard.copy(), index._block[:, 0].copy())


@dataclass(frozen=True)
class DatasetNames:
    """Dataset names by virtual shard (small: one row per dataset copy), for ``batch["dataset"]``."""

    names: tuple[str, ...]
    first_shard: np.ndarray
    block_dataset: np.ndarray

    def of(self, shard: int) -> str:
        b = int(np.searchsorted(self.first_shard, shard, side="right")) - 1
        return self.names[int(self.block_dataset[b])]


def open_index(
    url: str, storage_options: dict | None = None, shard_roots: Sequence[str] = ()
) -> ShardIndex | MixedIndex:
    """A dataset's index, or a mixture file's datasets as one `MixedIndex` (``shardify inspect``, the
    training script's budget parsing); what they point to must lie in their folders or under ``shard_roots``."""
    if _is_mixture_file(url):
        return MixedIndex.open(load_mixture(url, shard_roots), storage_options, shard_roots)
    return ShardIndex.load(url, storage_options, shard_roots)


def mixture_table(index: MixedIndex) -> dict[str, dict[str, float]]:
    """Per dataset: its samples, weight, and the samples (and hours, for audio) one epoch takes."""
    spu = index.seconds_per_unit()
    out = {}
    for s, ix, draw in zip(index.sources, index.indexes, index.draws):
        row: dict[str, float] = {"samples": ix.num_samples, "weight": s.weight, "per_epoch": draw.take}
        if spu:
            row["hours_per_epoch"] = ix.total_length * spu / 3600 * (draw.take / max(1, draw.size))
        out[s.name] = row
    return out


def datasets_of(index: AnyIndex) -> list[tuple[str | None, ShardIndex]]:
    """Each dataset a plan reads, with its name: a mixture's datasets, or the one index (name None)."""
    if isinstance(index, MixedIndex):
        return list(zip(index.names, index.indexes))
    return [(None, index)]
