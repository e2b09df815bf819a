"""The loader: `StreamBatchLoader` (``core``), its typed option groups (``options``), its checkpoint
(``state``), what it tells the user in words (``messages``) and how well a pass fed the training loop
(``metrics``).

``StreamBatchLoader`` pulls in torch; it is imported when first asked for, so that ``shardify inspect`` (which
plans with the loader's options and metrics, and never loads data) starts without torch."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .core import StreamBatchLoader

__all__ = ["StreamBatchLoader"]


def __getattr__(name: str) -> Any:
    if name == "StreamBatchLoader":
        from .core import StreamBatchLoader

        return StreamBatchLoader
    raise AttributeError(f"module 'streambatch.loader' has no attribute {name!r}")
