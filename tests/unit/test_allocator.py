"""mneme.runtime.allocator: glibc malloc's arenas and mmap threshold, observed in a fresh
process (the settings are process-wide)."""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc",
                                reason="the settings are glibc malloc's")

ROOT = Path(__file__).resolve().parents[2]

# Frees a 4 MiB block (glibc mmaps it), allocates the same size again and reports whether
# that one was mmapped too; then starts 8 threads that allocate and counts glibc's arenas.
PROBE = r"""
import ctypes, json, os, sys, tempfile, threading
from mneme.runtime import allocator

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
libc.fopen.restype, libc.fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]

applied = allocator.tune() if sys.argv[1] == "tune" else {}
size = 4 << 20
libc.free(libc.malloc(size))
before = libc.mallinfo2().hblkhd
block = libc.malloc(size)
mmapped = libc.mallinfo2().hblkhd - before >= size
libc.free(block)

go = threading.Barrier(9)
def work():
    keep = [bytearray(4096) for _ in range(64)]  # malloc'd buffers, from this thread's arena
    go.wait()
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads:
    t.start()
go.wait()
path = tempfile.mktemp()
fp = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, fp)
libc.fclose(fp)
arenas = open(path).read().count("<heap nr=")
os.unlink(path)
for t in threads:
    t.join()
print(json.dumps({"applied": applied, "mmapped": mmapped, "arenas": arenas}))
"""


def probe(mode: str, **env: str) -> dict:
    e = {k: v for k, v in os.environ.items()
         if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    e.update(env, PYTHONPATH=os.pathsep.join([str(ROOT / "libs"), str(ROOT)]))
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env=e, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_glibc_defaults_move_a_freed_large_block_into_the_arenas_and_make_an_arena_per_thread():
    # what tune() is for: without it, a 4 MiB block freed once comes from the heap next time
    got = probe("plain")
    assert got["mmapped"] is False
    assert got["arenas"] > 2


def test_tune_keeps_large_blocks_mmapped_and_the_arenas_at_two():
    got = probe("tune")
    assert got["applied"] == {"MALLOC_ARENA_MAX": 2, "MALLOC_MMAP_THRESHOLD_": 128 * 1024}
    assert got["mmapped"] is True
    assert got["arenas"] <= 2


def test_an_operators_glibc_variable_wins():
    got = probe("tune", MALLOC_ARENA_MAX="4")
    assert got["applied"] == {"MALLOC_MMAP_THRESHOLD_": 128 * 1024}
    assert 2 < got["arenas"] <= 4
    assert got["mmapped"] is True


def test_glibc_tunables_win_too():
    got = probe("tune", GLIBC_TUNABLES="glibc.malloc.mmap_threshold=8388608")
    assert got["applied"] == {"MALLOC_ARENA_MAX": 2}
    assert got["arenas"] <= 2
    assert got["mmapped"] is False  # 4 MiB is under the operator's 8 MiB threshold
