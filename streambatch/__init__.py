"""streambatch: stream length-annotated WebDataset shards into budget-bounded, low-padding batches."""

from typing import TYPE_CHECKING

from .errors import (
    AudioError,
    BudgetError,
    CalibrationError,
    ChecksumMismatch,
    ColumnError,
    DataError,
    DatasetNotFound,
    EmptyEpochError,
    IndexFormatError,
    IndexMismatch,
    InputErrors,
    InputProblem,
    MissingCredentials,
    OptionError,
    OutputError,
    RetriesExhausted,
    SampleError,
    SampleTooLongError,
    ShardifyError,
    ShardReadError,
    StateError,
    StorageError,
    StreamBatchError,
    TooManyBadShards,
    TruncatedAudio,
    UnknownStorage,
    UntrustedURL,
    UsageError,
)
from .format.index import ShardIndex, ShardInfo
from .plan.batcher import BatchPlan, BucketBatcher, plan_batches
from .plan.buckets import estimate_boundaries, suggest_budget
from .plan.config import BatchingConfig
from .plan.layout import Layout
from .units import Unit

if TYPE_CHECKING:  # imported lazily below; named here for type checkers, IDEs and the generated API reference
    from .fit.calibrate import calibrate
    from .fit.oom import OOMGuard, run_with_oom_split
    from .loader import StreamBatchLoader
    from .loader.options import BatchingOptions, RunOptions, SampleOptions
    from .loader.state import LoaderState
    from .read.reader import ReadOptions
    from .write.adopt.index import index_tars
    from .write.writer import write_shards

__version__ = "0.1.0"

__all__ = [
    "BatchingConfig",
    "BatchPlan",
    "BucketBatcher",
    "ShardIndex",
    "ShardInfo",
    "StreamBatchLoader",
    "BatchingOptions",
    "ReadOptions",
    "SampleOptions",
    "RunOptions",
    "LoaderState",
    "Layout",
    "Unit",
    "estimate_boundaries",
    "plan_batches",
    "suggest_budget",
    "write_shards",
    "index_tars",
    "calibrate",
    "OOMGuard",
    "run_with_oom_split",
    "__version__",
    # errors: every one derives from StreamBatchError, and is of one of its four kinds
    "StreamBatchError",
    "UsageError",
    "DataError",
    "ShardifyError",
    "OptionError",
    "InputErrors",
    "InputProblem",
    "BudgetError",
    "EmptyEpochError",
    "DatasetNotFound",
    "MissingCredentials",
    "UntrustedURL",
    "UnknownStorage",
    "StateError",
    "StorageError",
    "OutputError",
    "ShardReadError",
    "ChecksumMismatch",
    "TooManyBadShards",
    "RetriesExhausted",
    "IndexFormatError",
    "IndexMismatch",
    "ColumnError",
    "AudioError",
    "TruncatedAudio",
    "SampleError",
    "SampleTooLongError",
    "CalibrationError",
]

# The loader and calibration pull in torch, the writer the source parsers: import each only when asked for,
# so the `shardify` command and its worker processes start fast.
_LAZY = {
    "StreamBatchLoader": ".loader",
    "BatchingOptions": ".loader.options",
    "ReadOptions": ".read.reader",
    "SampleOptions": ".loader.options",
    "RunOptions": ".loader.options",
    "LoaderState": ".loader.state",
    "write_shards": ".write.writer",
    "index_tars": ".write.adopt.index",
    "calibrate": ".fit.calibrate",
    "OOMGuard": ".fit.oom",
    "run_with_oom_split": ".fit.oom",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'streambatch' has no attribute {name!r}")
