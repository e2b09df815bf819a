"""``shardify index``: existing tar shards indexed in place, not a byte of them rewritten.

`index` runs it (`index_tars()`), `scan` reads one tar as the loader will, `nemo` matches a
NeMo tarred manifest to the members, `fields` gives each sample its output length and metadata columns.
The command line is `streambatch.cli.index`.
"""

from .index import LAYOUTS, index_tars

__all__ = ["LAYOUTS", "index_tars"]
