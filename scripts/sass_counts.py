#!/usr/bin/env python3
"""Count the SASS instructions of a stage's kernels, by opcode, from `cuobjdump -sass`.

  python3 scripts/sass_counts.py build/bin/08_mma_sync
  python3 scripts/sass_counts.py build/bin/08_mma_sync --kernel 'forward.*Li64ELi64E6__half'

A static count: each instruction of the kernel's code once, whether it runs once or in
every tile. The tile loop is unrolled within a tile, so the count of the opcodes that only
the loop uses (HMMA, LDSM, MUFU) says how many one tile takes, and the other opcodes beside
them show the overhead a tile carries (integer address arithmetic IMAD/LEA/IADD3, compares
ISETP, selects FSEL/SEL, moves MOV). Needs cuobjdump (CUDA toolkit) on PATH.
"""
import argparse
import collections
import re
import shutil
import subprocess
import sys


def kernels(binary, arch):
    args = ["cuobjdump", "-sass"] + (["-arch", arch] if arch else []) + [binary]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    for block in re.split(r"\n\s+Function : ", out)[1:]:
        name, body = block.split("\n", 1)
        ops = collections.Counter()
        for line in body.split("\n"):
            # /*0bd0*/  @!P1 HMMA.16816.F32 R72, ...: the opcode without its modifiers
            m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
            if m:
                ops[m.group(1)] += 1
        yield name.strip(), ops


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binary", help="a stage program, an object file or a cubin")
    ap.add_argument("--kernel", default="", help="only kernels whose mangled name matches")
    ap.add_argument("--arch", default="", help="one architecture of a fat binary, e.g. sm_90")
    ap.add_argument("--top", type=int, default=16, help="opcodes listed per kernel")
    a = ap.parse_args()
    if not shutil.which("cuobjdump"):
        sys.exit("sass_counts: cuobjdump not found (it comes with the CUDA toolkit)")
    found = 0
    for name, ops in kernels(a.binary, a.arch):
        if not re.search(a.kernel, name):
            continue
        found += 1
        print(f"{name}\n  {sum(ops.values())} instructions: " +
              " ".join(f"{op} {n}" for op, n in ops.most_common(a.top)))
    if not found:
        sys.exit(f"sass_counts: no kernel matches '{a.kernel}' in {a.binary}")


if __name__ == "__main__":
    main()
