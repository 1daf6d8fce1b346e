"""CUDA sources of kestrel's kernels, compiled lazily with torch.utils.cpp_extension on first use."""

from pathlib import Path

SOURCE_DIR = Path(__file__).parent
