"""Run the CPU benchmarks as on a box without AVX-512: `--cap-isa avx2`.

The engine's CPU figures are ratios (decode over the XLA matmul floor, turn 10 over
turn 1), and what they compare can depend on the box's vector ISA. To check a ratio for an
AVX2 box on one with AVX-512, both kinds of kernel XLA:CPU runs have to be capped:
- the loops XLA generates itself (elementwise, reductions, gathers): `--xla_cpu_max_isa=AVX2`
  in XLA_FLAGS, read when the CPU backend starts;
- the kernel library it hands dots and reductions to (YNNPACK, XNNPACK): they pick their
  kernels from cpuinfo's flags, which no flag or variable overrides. `cap()` clears the
  AVX-512, AVX10 and AMX entries of cpuinfo's table inside jaxlib before the first kernel
  is picked, and checks with YNNPACK's own query that it sees no AVX-512.
XLA_FLAGS alone caps only the first kind: the dots kept their AVX-512 kernels.

The table's layout is cpuinfo's `struct cpuinfo_x86_isa` (one bool per feature, x86-64);
`cap()` refuses (CapError) unless the table's size matches it and its AVX2/AVX-512 entries
agree with the kernel's /proc/cpuinfo flags. Linux x86-64 only.

A script run in another interpreter (the tunix side) is capped the same way with
`python isa_cap.py avx2 SCRIPT ARGS...`; this file imports nothing of muajax.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import runpy
import struct
import sys

LEVELS = ("avx2",)
_FIELDS = (
    "rdtscp rdpid sysenter msr clzero clflush clflushopt mwait mwaitx fxsave xsave three_d_now three_d_now_plus "
    "prefetch prefetchw prefetchwt1 sse3 ssse3 sse4_1 sse4_2 sse4a misaligned_sse avx avxvnni fma3 fma4 xop f16c avx2 "
    "avx512f avx512pf avx512er avx512cd avx512dq avx512bw avx512vl avx512ifma avx512vbmi avx512vbmi2 avx512bitalg "
    "avx512vpopcntdq avx512vnni avx512bf16 avx512fp16 avx512vp2intersect avx512_4vnniw avx512_4fmaps avx10_1 avx10_2 "
    "amx_bf16 amx_tile amx_int8 amx_fp16 avx_vnni_int8 avx_vnni_int16 avx_ne_convert hle rtm xtest mpx cmpxchg16b clwb "
    "movbe lahf_sahf fs_gs_base lzcnt popcnt tbm bmi bmi2 adx aes vaes pclmulqdq vpclmulqdq gfni rdrand rdseed sha rng "
    "ace ace2 phe pmm lwp").split()
_CLEARED = tuple(f for f in _FIELDS if f.startswith(("avx512", "avx10", "amx")))
_YNN_AVX512F = 1 << 7  # ynnpack/base/arch.h: arch_flag::avx512f
_SYMBOLS = ("cpuinfo_isa", "cpuinfo_initialize", "_ZN3ynn24get_supported_arch_flagsEv")
_LIBRARY = "libjax_common.so"


class CapError(RuntimeError):
    """The ISA cannot be capped here; the message says why."""


def elf_symbols(path: str, names) -> dict[str, tuple[int, int]]:
    """{name: (value, size)} from an ELF64 little-endian file's .symtab (hidden symbols too)."""
    wanted = {n.encode(): n for n in names}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:5] != b"\x7fELF\x02" or m[5] != 1:
            raise CapError(f"{path} is not a little-endian ELF64 file")
        shoff, = struct.unpack_from("<Q", m, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", m, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", m, shoff + i * shentsize) for i in range(shnum)]
        symtab = next((s for s in sections if s[1] == 2), None)  # SHT_SYMTAB
        if symtab is None:
            raise CapError(f"{path} has no symbol table")
        strtab = sections[symtab[6]]
        names_at = bytes(m[strtab[4]:strtab[4] + strtab[5]])
        offsets = {}
        for raw, name in wanted.items():
            at = names_at.find(b"\0" + raw + b"\0")
            if at >= 0:
                offsets[at + 1] = name
        found = {}
        table = m[symtab[4]:symtab[4] + symtab[5]]
        for st_name, _, _, _, value, size in struct.iter_unpack("<IBBHQQ", table):
            if st_name in offsets:
                found[offsets[st_name]] = (value, size)
    missing = set(names) - set(found)
    if missing:
        raise CapError(f"{path} lacks the symbols {sorted(missing)}")
    return found


def _library() -> tuple[int, str]:
    """Load address and path of jaxlib's library (the one holding XLA, cpuinfo and YNNPACK)."""
    import jaxlib._jax  # noqa: F401  (maps the library)

    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5].endswith(_LIBRARY) and int(fields[2], 16) == 0:
                return int(fields[0].split("-")[0], 16), fields[5]
    raise CapError(f"{_LIBRARY} is not mapped in this process")


def kernel_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def _set_xla_flag(level: str) -> None:
    flag = f"--xla_cpu_max_isa={level.upper()}"
    if "jax" in sys.modules:
        from jax._src import xla_bridge

        if xla_bridge._backends:  # noqa: SLF001 - the flags are read once, when a backend starts
            raise CapError("cap the ISA before JAX starts its CPU backend (before any array is made)")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_max_isa" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


def cap(level: str = "avx2") -> dict:
    """Make this process's XLA:CPU run as on a box whose best vector ISA is `level`.

    Returns what was capped: {"level", "cleared" (cpuinfo entries turned off), "xla_flags"}."""
    if level not in LEVELS:
        raise CapError(f"unknown ISA level {level!r}; known: {', '.join(LEVELS)}")
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        raise CapError("capping the ISA needs Linux on x86-64")
    if "avx2" not in kernel_flags():
        raise CapError("this CPU has no AVX2: it cannot run as an AVX2 box")
    _set_xla_flag(level)
    base, path = _library()
    symbols = elf_symbols(path, _SYMBOLS)
    if symbols["cpuinfo_isa"][1] != len(_FIELDS):
        raise CapError(f"cpuinfo's ISA table in {path} has {symbols['cpuinfo_isa'][1]} entries, "
                       f"this cap knows the {len(_FIELDS)}-entry layout")
    if not ctypes.CFUNCTYPE(ctypes.c_bool)(base + symbols["cpuinfo_initialize"][0])():
        raise CapError("cpuinfo_initialize failed")
    table = (ctypes.c_uint8 * len(_FIELDS)).from_address(base + symbols["cpuinfo_isa"][0])
    have = {name for name, on in zip(_FIELDS, table) if on}
    kernel = kernel_flags()
    if not {"sse3", "avx2", "fma3"} <= have or ("avx512f" in have) != ("avx512f" in kernel):
        raise CapError(f"cpuinfo's table does not read as the layout expected (set: {sorted(have)})")
    for i, name in enumerate(_FIELDS):
        if name in _CLEARED:
            table[i] = 0
    ynn = ctypes.CFUNCTYPE(ctypes.c_uint64)(base + symbols["_ZN3ynn24get_supported_arch_flagsEv"][0])()
    if ynn & _YNN_AVX512F:
        raise CapError("YNNPACK had already picked its kernels (an XLA computation ran before the cap)")
    return {"level": level, "cleared": sorted(have & set(_CLEARED)), "xla_flags": os.environ["XLA_FLAGS"]}


def main(argv: list[str]) -> None:
    """`python isa_cap.py LEVEL SCRIPT ARGS...`: cap, then run SCRIPT as __main__."""
    if len(argv) < 2:
        raise SystemExit("usage: python isa_cap.py LEVEL SCRIPT [ARGS...]")
    cap(argv[0])
    sys.argv = argv[1:]
    runpy.run_path(argv[1], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
