"""Sources of kestrel's C++ and CUDA kernels, compiled lazily with torch.utils.cpp_extension on first use (``build``)."""

from pathlib import Path

SOURCE_DIR = Path(__file__).parent
