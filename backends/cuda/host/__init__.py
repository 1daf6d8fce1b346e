"""The cuda backend's host tier: page-locked host copies of the streamed weights, all pinned or a ring of slots.

- ``tier``: the host budget and the ring of pinned slots
- ``pinned_arena``: every unit pinned once, as views of a few power-of-two blocks
- ``staging``: filling ring slots from the page cache or from disk, ahead of their uploads
- ``diskread``: page-aligned reads, with ``O_DIRECT`` where the file system has it
- ``pagecache``: what of a file the page cache holds, and dropping it
"""
