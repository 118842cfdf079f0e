"""mneme.runtime.allocator: glibc malloc's arenas, counted in a fresh process (the
setting is process-wide)."""

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

# Starts 8 threads that allocate and counts glibc's arenas (malloc_info's XML).
PROBE = r"""
import ctypes, json, os, sys, tempfile, threading
from mneme.runtime import allocator

libc = ctypes.CDLL(None)
libc.fopen.restype, libc.fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]

applied = allocator.tune() if sys.argv[1] == "tune" else {}
go = threading.Barrier(9)
def work():
    keep = [bytearray(4096) for _ in range(64)]  # malloc'd buffers, from this thread's arena
    go.wait()
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads:
    t.start()
go.wait()
fd, path = tempfile.mkstemp()
os.close(fd)
fp = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, fp)
libc.fclose(fp)
arenas = open(path).read().count("<heap nr=")
os.unlink(path)
for t in threads:
    t.join()
print(json.dumps({"applied": applied, "arenas": arenas}))
"""


def probe(mode: str, **env: str) -> dict:
    e = {k: v for k, v in os.environ.items()
         if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    e.update(env, PYTHONPATH=os.pathsep.join([str(ROOT / "libs"), str(ROOT)]))
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env=e, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_glibc_defaults_make_an_arena_per_thread():  # what tune() is for
    assert probe("plain")["arenas"] > 2


def test_tune_keeps_the_arenas_at_two():
    got = probe("tune")
    assert got["applied"] == {"MALLOC_ARENA_MAX": 2}
    assert got["arenas"] <= 2


def test_an_operators_glibc_variable_wins():
    got = probe("tune", MALLOC_ARENA_MAX="4")
    assert got["applied"] == {}
    assert 2 < got["arenas"] <= 4


def test_glibc_tunables_win_too():
    got = probe("tune", GLIBC_TUNABLES="glibc.malloc.arena_max=3")
    assert got["applied"] == {}
    assert got["arenas"] == 3


# Frees 96 MB of 64 KiB heap blocks below a block still in use (so glibc cannot shrink
# the heap by itself), then reports how much of it stays resident after ~1 s.
TRIM_PROBE = r"""
import ctypes, json, sys, time
from mneme.runtime import allocator

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
thread = allocator.trim_every(float(sys.argv[1]))
blocks = [libc.malloc(65536) for _ in range(1536)]
for b in blocks:
    libc.memset(b, 1, 65536)  # touched: resident
pin = libc.malloc(65536)
before = rss_mb()
for b in blocks:
    libc.free(b)
time.sleep(1.0)
print(json.dumps({"thread": thread is not None, "freed_mb": before - rss_mb()}))
"""


def trim_probe(interval: str) -> dict:
    e = {k: v for k, v in os.environ.items()
         if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT / "libs"), str(ROOT)])
    out = subprocess.run([sys.executable, "-c", TRIM_PROBE, interval], env=e,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_freed_heap_pages_stay_resident_without_trimming():  # what trim_every is for
    got = trim_probe("0")
    assert got == {"thread": False, "freed_mb": pytest.approx(0, abs=16)}


def test_trim_every_returns_freed_heap_pages():
    got = trim_probe("0.1")
    assert got["thread"] and got["freed_mb"] > 80
