"""The loader: :class:`StreamBatchLoader` (``core``), its typed option groups (``options``), its checkpoint
(``state``), what it tells the user in words (``messages``) and how well a pass fed the training loop
(``metrics``)."""

from .core import StreamBatchLoader

__all__ = ["StreamBatchLoader"]
