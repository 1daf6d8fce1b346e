"""Write bench/results/.stamp.json: the commit, the dirty flag and a sha256 over every tracked and
untracked-not-ignored file, for a machine that receives the working tree without ``.git``.

    python -m bench stamp           # here, before the tree is copied to the GPU machine

There, a record reads the stamp file where git cannot answer, recomputes the hash over the same files and calls the
tree dirty where it differs (``stamp_source``: "stamp-file").
"""

from __future__ import annotations

from bench.stamp import STAMP_FILE, write_stamp_file


def add_arguments(p) -> None:
    p.add_argument("--file", default=str(STAMP_FILE), help=f"where to write it (default {STAMP_FILE})")


def main(args) -> int:
    from pathlib import Path

    content = write_stamp_file(Path(args.file))
    dirty = " (the tree is dirty: commit first for a clean stamp)" if content["dirty"] else ""
    print(f"stamped {args.file}: commit {content['commit']}, {len(content['files'])} files, "
          f"tree {content['tree_sha256'][:12]}{dirty}")
    return 0
