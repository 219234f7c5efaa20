#!/usr/bin/env python3
"""CTest's python.library_exports: each stage library given on the command line exports
exactly the package's entry points, attn_library_* (cmake/stage_library.map), and nothing
of the harness inside it. Two stages loaded into one process then cannot bind to each
other's attn_fail, stream or options, however they are loaded. Reads the ELF dynamic symbol
table itself, so it needs neither a GPU nor binutils."""
import struct
import sys

ENTRY_POINTS = {"attn_library_abi", "attn_library_stage", "attn_library_forward_workspace",
                "attn_library_backward_workspace", "attn_library_forward",
                "attn_library_backward", "attn_library_error"}
SHT_DYNSYM = 11
EXPORTING_BINDINGS = (1, 2, 10)  # STB_GLOBAL, STB_WEAK, STB_GNU_UNIQUE (g++'s for some statics)


def exported(path):
    """The names of the symbols a 64-bit little-endian ELF file defines and exports in its
    dynamic symbol table."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise SystemExit(f"{path}: not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                for i in range(shnum)]
    names = set()
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != SHT_DYNSYM:
            continue
        strings = sections[link][4]
        for at in range(offset, offset + size, entsize):
            name, info, _, shndx = struct.unpack_from("<IBBH", data, at)
            if shndx != 0 and info >> 4 in EXPORTING_BINDINGS:  # defined here, visible
                end = data.index(b"\0", strings + name)
                names.add(data[strings + name:end].decode())
    return names


def main():
    if len(sys.argv) < 2:
        raise SystemExit("usage: check_exports.py LIBRARY...")
    failed = 0
    for path in sys.argv[1:]:
        names = exported(path)
        missing, extra = ENTRY_POINTS - names, names - ENTRY_POINTS
        if missing or extra:
            failed = 1
            print(f"{path}: missing {sorted(missing)}; exported beyond the entry points "
                  f"{sorted(extra)[:10]}{' ...' if len(extra) > 10 else ''} ({len(extra)})")
        else:
            print(f"{path}: exports the {len(ENTRY_POINTS)} entry points and nothing else")
    return failed


if __name__ == "__main__":
    sys.exit(main())
