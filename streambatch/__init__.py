"""streambatch: stream length-annotated WebDataset shards into budget-bounded, low-padding batches."""

from .plan.batcher import BatchPlan, BucketBatcher, SampleTooLongError, plan_batches
from .plan.buckets import estimate_boundaries, suggest_budget
from .plan.config import BatchingConfig
from .dataset.index import ShardIndex, ShardInfo

__version__ = "0.1.0"

__all__ = [
    "BatchingConfig",
    "BatchPlan",
    "BucketBatcher",
    "SampleTooLongError",
    "ShardIndex",
    "ShardInfo",
    "StreamBatchLoader",
    "estimate_boundaries",
    "plan_batches",
    "suggest_budget",
    "write_shards",
    "calibrate",
    "OOMGuard",
    "run_with_oom_split",
    "__version__",
]

# The loader and calibration pull in torch, the writer the source parsers: import each only when asked for,
# so the `shardify` command and its worker processes start fast.
_LAZY = {
    "StreamBatchLoader": ".loader",
    "write_shards": ".write.writer",
    "calibrate": ".fit.calibrate",
    "OOMGuard": ".fit.oom",
    "run_with_oom_split": ".fit.oom",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'streambatch' has no attribute {name!r}")
