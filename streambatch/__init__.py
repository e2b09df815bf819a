"""streambatch: stream length-annotated WebDataset shards into budget-bounded, low-padding batches."""

from .buckets import BatchPlan, BucketBatcher, SampleTooLongError, estimate_boundaries, plan_batches, suggest_budget
from .index import ShardIndex, ShardInfo
from .loader import StreamBatchLoader

__version__ = "0.1.0"

__all__ = [
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
    "__version__",
]


def __getattr__(name: str):
    # the writer pulls in the source parsers; import it only when asked for
    if name == "write_shards":
        from .writer import write_shards

        return write_shards
    raise AttributeError(name)
