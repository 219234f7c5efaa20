"""pip's build step (pyproject.toml holds the metadata): refuses, in one line, to package
flash_stages without a stage library. The package compiles nothing; it carries the libraries
the repository's CMake build made, copied into flash_stages/lib by
`cmake --build build --target python_package`. A wheel without them would install, import
without a word and offer no stage."""
import glob
import os
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
LIB = os.path.join(HERE, "flash_stages", "lib")

if not glob.glob(os.path.join(LIB, "libattn_*.so")):
    sys.exit(f"flash_stages: no stage library in {LIB}: build them first, on a machine with "
             "the CUDA toolkit: cmake -S . -B build -DATTN_PYTHON=ON && cmake --build build "
             "--target python_package (see python/README.md)")

setup()
