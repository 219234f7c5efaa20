#!/usr/bin/env python3
"""CTest's entry to the Python package's tests (python.pytorch): exits 77, which CTest shows
as skipped, when this machine cannot run them (no PyTorch, no pytest, no CUDA device of
compute capability 8.0 or later, no stage libraries built), and otherwise runs pytest on
python/tests and returns its verdict. FLASH_STAGES_LIB_DIR (set by CTest to the build's lib
folder) says where the libraries are."""
import glob
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def skip(why):
    print(f"python.pytorch: skipped: {why}")
    sys.exit(77)


def main():
    try:
        import torch
    except ImportError:
        skip("PyTorch is not installed for " + sys.executable)
    try:
        import pytest  # noqa: F401
    except ImportError:
        skip("pytest is not installed for " + sys.executable)
    if not torch.cuda.is_available():
        skip("no CUDA device for PyTorch")
    if torch.cuda.get_device_capability() < (8, 0):
        skip("no CUDA device of compute capability 8.0 or later (every stage needs it)")
    lib_dir = os.environ.get("FLASH_STAGES_LIB_DIR", "")
    if not glob.glob(os.path.join(lib_dir, "libattn_*.so")):
        skip(f"no stage libraries in '{lib_dir}': configure with -DATTN_PYTHON=ON and build")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE) + os.pathsep +
               os.environ.get("PYTHONPATH", ""))
    # A fresh inductor cache for each run unless one is given: compiled graphs are cached by
    # their source, not by the schemas of the operators they call, and the C++ and Python
    # operator paths (or a rebuild that changes a schema) register the same names with
    # different schemas, so a graph cached by one run would fail when replayed by the next.
    cache = None
    if "TORCHINDUCTOR_CACHE_DIR" not in env:
        cache = tempfile.mkdtemp(prefix="flash_stages_inductor_")
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", HERE] + sys.argv[1:],
                       env=env)
    if cache:
        shutil.rmtree(cache, ignore_errors=True)
    # 5 is pytest's "no tests collected": nothing ran, so nothing passed.
    sys.exit(1 if r.returncode == 5 else r.returncode)


if __name__ == "__main__":
    main()
