"""Where ``length_text`` lived before ``shardify inspect`` moved to :mod:`streambatch.cli.inspect`; kept only until
the loader imports it from :mod:`streambatch.dataset.describe` (then this file goes)."""

from .dataset.describe import length_text

__all__ = ["length_text"]
