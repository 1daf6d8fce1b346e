"""kestrel: run language models whose weights do not fit in device memory."""

__version__ = "0.1.0"
