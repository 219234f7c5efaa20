#!/usr/bin/env python3
"""Count the SASS instructions of a stage's kernels, by opcode, from `cuobjdump -sass`.

  python3 scripts/sass_counts.py build/bin/08_mma_sync
  python3 scripts/sass_counts.py build/bin/08_mma_sync --kernel 'forward.*Li64ELi64E6__half'

A static count: each instruction once, whether it runs once or in every tile. Per kernel,
the whole kernel, then its tile loop (the outermost loop that holds an HMMA): the products
of one tile are its HMMA and LDSM, and what sits beside them is the overhead a tile carries
(integer address arithmetic IMAD/LEA/IADD3/LOP3, compares ISETP, selects FSEL/SEL, moves
MOV). Code a branch skips on most tiles (a mask, say) still counts once, and a loop inside
the tile counts once if it stays a loop but once per copy if the compiler unrolls it: compare
counts of builds whose loops have the same shape. Needs cuobjdump (CUDA toolkit) on PATH.
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys


def kernels(binary, arch):
    """(name, [(address, opcode, branch target or None)]) of every kernel in the binary."""
    args = ["cuobjdump", "-sass"] + (["-arch", arch] if arch else []) + [binary]
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"sass_counts: {' '.join(args)} failed: {r.stderr.strip() or r.returncode}")
    out = r.stdout
    for block in re.split(r"\n\s+Function : ", out)[1:]:
        name, body = block.split("\n", 1)
        code = []
        for line in body.split("\n"):
            # /*0bd0*/  @!P1 HMMA.16816.F32 R72, ...: the opcode without its modifiers
            m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(.*)",
                         line)
            if m:
                target = re.match(r"[.A-Z0-9_]*\s+(0x[0-9a-f]+)", m.group(3))
                code.append((int(m.group(1), 16), m.group(2),
                             int(target.group(1), 16) if m.group(2) == "BRA" and target else None))
        yield name.strip(), code


def tile_loop(code):
    """The instructions of the outermost loop (a backward branch) that holds an HMMA: the
    tile loop, each instruction counted once, whether a branch inside it skips it or not."""
    best = None
    for addr, op, target in code:
        if target is not None and target < addr:
            body = [c for c in code if target <= c[0] <= addr]
            if any(c[1] == "HMMA" for c in body) and (best is None or len(body) > len(best)):
                best = body
    return best


def line(ops, top):
    return f"{sum(ops.values())} instructions: " + " ".join(
        f"{op} {n}" for op, n in ops.most_common(top))


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binary", help="a stage program, an object file or a cubin")
    ap.add_argument("--kernel", default="", help="only kernels whose mangled name matches")
    ap.add_argument("--arch", default="", help="one architecture of a fat binary, e.g. sm_90")
    ap.add_argument("--top", type=int, default=16, help="opcodes listed per kernel")
    a = ap.parse_args()
    try:
        re.compile(a.kernel)
    except re.error as e:
        ap.error(f"--kernel: not a regular expression: {e}")
    if a.top < 1:
        ap.error("--top must be at least 1")
    if not os.path.isfile(a.binary):
        ap.error(f"no file {a.binary}")
    if not shutil.which("cuobjdump"):
        sys.exit("sass_counts: cuobjdump not found (it comes with the CUDA toolkit)")
    found = 0
    for name, code in kernels(a.binary, a.arch):
        if not re.search(a.kernel, name):
            continue
        found += 1
        print(f"{name}\n  kernel: {line(collections.Counter(op for _, op, _ in code), a.top)}")
        loop = tile_loop(code)
        if loop:
            print(f"  tile loop: {line(collections.Counter(op for _, op, _ in loop), a.top)}")
    if not found:
        sys.exit(f"sass_counts: no kernel matches '{a.kernel}' in {a.binary}")


if __name__ == "__main__":
    main()
