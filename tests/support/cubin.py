"""Registers and stack a kernel uses, read from its cubin (an ELF file) with the stdlib alone.

Triton's ahead-of-time compiles carry no register count (``n_regs`` is filled when a kernel
is loaded on a GPU), but ptxas writes it into the cubin: the ``.nv.info`` section holds
attributes as (format u8, attribute u8, payload), where format 0x04 (EIFMT_SVAL) takes a u16
size and that many bytes. EIATTR_REGCOUNT (0x2f) is (symbol index u32, registers u32) and
EIATTR_FRAME_SIZE (0x12) the same with the stack frame's bytes (spills). This is where
``cuobjdump -res-usage`` reads REG and STACK from on sm_80 to sm_120 (checked against it on
one kernel for each; the ``.text.<kernel>`` section's ``sh_info`` high byte holds the count
on sm_80 only, not on sm_90 and later, so it is not used).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

EIATTR_REGCOUNT = 0x2F
EIATTR_FRAME_SIZE = 0x12
_EIFMT_SVAL = 0x04
_EIFMT_HVAL = 0x03
_EIFMT_NVAL = 0x01
_SHT_SYMTAB = 2


@dataclass(frozen=True)
class Usage:
    registers: int  # per thread
    stack: int  # bytes of stack frame per thread (spilled registers, local arrays)


def _sections(elf: bytes) -> dict[str, tuple[int, int, int, int]]:
    """Section name -> (type, file offset, size, link) of a 64-bit little-endian ELF."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    entsize, count, names = struct.unpack_from("<HHH", elf, 0x3A)
    raw = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * entsize) for i in range(count)]
    strtab = raw[names][4]
    out = {}
    for name, kind, _, _, offset, size, link, _, _, _ in raw:
        end = elf.index(b"\0", strtab + name)
        out[elf[strtab + name : end].decode()] = (kind, offset, size, link)
    return out


def _symbols(elf: bytes, sections: dict[str, tuple[int, int, int, int]]) -> list[str]:
    """The symbol table's names, by index."""
    kind, offset, size, link = sections[".symtab"]
    assert kind == _SHT_SYMTAB
    strtab = list(sections.values())[link][1]
    names = []
    for at in range(offset, offset + size, 24):  # Elf64_Sym
        (name,) = struct.unpack_from("<I", elf, at)
        names.append(elf[strtab + name : elf.index(b"\0", strtab + name)].decode())
    return names


def _attributes(elf: bytes, offset: int, size: int) -> list[tuple[int, bytes]]:
    out = []
    at, end = offset, offset + size
    while at < end:
        fmt, attr = elf[at], elf[at + 1]
        if fmt == _EIFMT_SVAL:
            (length,) = struct.unpack_from("<H", elf, at + 2)
            out.append((attr, elf[at + 4 : at + 4 + length]))
            at += 4 + length
        elif fmt == _EIFMT_NVAL:
            out.append((attr, b""))
            at += 2
        elif fmt == _EIFMT_HVAL:
            out.append((attr, elf[at + 2 : at + 4]))
            at += 4
        else:
            raise ValueError(f"unknown .nv.info attribute format {fmt:#x} at {at}")
    return out


def usage(cubin: bytes, kernel: str) -> Usage:
    """Registers and stack of ``kernel`` (its symbol's name) in ``cubin``."""
    sections = _sections(cubin)
    symbols = _symbols(cubin, sections)
    _, offset, size, _ = sections[".nv.info"]
    found: dict[int, int] = {}
    for attr, payload in _attributes(cubin, offset, size):
        if attr in (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE) and len(payload) == 8:
            symbol, value = struct.unpack("<II", payload)
            if symbols[symbol] == kernel:
                found[attr] = value
    if EIATTR_REGCOUNT not in found:
        raise ValueError(f"no register count for {kernel} in the cubin")
    return Usage(found[EIATTR_REGCOUNT], found.get(EIATTR_FRAME_SIZE, 0))
