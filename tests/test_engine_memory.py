"""Freed heap pages go back to the operating system (glibc ``malloc_trim``)."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from wyoming_cosyvoice3.engine.memory import return_freed_memory


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_freed_heap_is_returned() -> None:
    # 200 MB in 100 KB blocks (below glibc's mmap threshold, so they live on the heap); the
    # last block stays alive and pins the top of the heap, so free() alone cannot shrink it
    blocks = [bytearray(b"\x01" * 100_000) for _ in range(2_000)]
    keep = blocks[-1]
    del blocks
    before = _rss_bytes()
    assert return_freed_memory() is True
    after = _rss_bytes()
    assert before - after > 100_000_000
    assert keep[0] == 1

