"""``shardify index``: existing tar shards indexed in place, not a byte of them rewritten.

:mod:`.index` runs it (:func:`index_tars`), :mod:`.scan` reads one tar as the loader will, :mod:`.nemo` matches a
NeMo tarred manifest to the members, :mod:`.fields` gives each sample its output length and metadata columns.
The command line is :mod:`streambatch.cli.index`.
"""

from .index import LAYOUTS, index_tars

__all__ = ["LAYOUTS", "index_tars"]
