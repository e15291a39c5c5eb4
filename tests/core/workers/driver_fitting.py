"""torch_fitting, imported with a shared library named libcuda.so.1 mapped (the file DDIPP_TEST_LIBCUDA names), as
`import torch` maps the CUDA driver on every GPU host with torch's CUDA 13 wheels (cuBLASLt loads it)."""
import ctypes
import os

ctypes.CDLL(os.environ["DDIPP_TEST_LIBCUDA"])

from torch_fitting import place_data, run_fit  # noqa: E402,F401
