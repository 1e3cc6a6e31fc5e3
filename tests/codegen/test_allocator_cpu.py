"""The CPU allocator setting (ttftc/codegen/cpu/_allocator.py): freed memory is reused instead of faulted in again."""

from __future__ import annotations

import ctypes
import platform
import resource

import pytest

from ttftc.codegen.cpu import _allocator

configure = _allocator.keep_freed_pages.__wrapped__  # the uncached body: the cached one runs once per process
BLOCK = 48 << 20  # larger than glibc's largest mmap threshold (32 MiB): served by mmap under its defaults


def _faults_of_a_fresh_block(libc) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(BLOCK)
    assert block
    libc.memset(block, 1, BLOCK)
    libc.free(block)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting applies to glibc only")
def test_a_freed_block_is_reused_without_page_faults(monkeypatch):
    monkeypatch.delenv(_allocator.OPT_OUT_VARIABLE, raising=False)
    assert "reused, not unmapped" in configure()
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
    _faults_of_a_fresh_block(libc)  # the heap grows once
    # Under glibc's defaults every round maps the block afresh: one fault per 4 KiB page, 12288 here.
    assert _faults_of_a_fresh_block(libc) < BLOCK // 4096 // 100


def test_the_opt_out_keeps_the_defaults_and_says_so(monkeypatch):
    monkeypatch.setenv(_allocator.OPT_OUT_VARIABLE, "system")
    monkeypatch.setattr(_allocator.ctypes, "CDLL", lambda *a: pytest.fail("mallopt must not be called"))
    assert configure() == "malloc: glibc defaults kept (TTFTC_CPU_MALLOC=system)"


def test_another_c_library_is_left_alone(monkeypatch):
    monkeypatch.delenv(_allocator.OPT_OUT_VARIABLE, raising=False)
    monkeypatch.setattr(_allocator.platform, "libc_ver", lambda: ("musl", "1.2"))
    monkeypatch.setattr(_allocator.ctypes, "CDLL", lambda *a: pytest.fail("mallopt must not be called"))
    assert configure() == "malloc: left as it is (C library musl, not glibc)"


def test_a_refused_mallopt_is_reported(monkeypatch):
    class RefusingLibc:
        @staticmethod
        def mallopt(parameter, value):
            return 0

    monkeypatch.delenv(_allocator.OPT_OUT_VARIABLE, raising=False)
    monkeypatch.setattr(_allocator.platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(_allocator.ctypes, "CDLL", lambda *a: RefusingLibc())
    assert configure() == "malloc: left as it is (glibc refused the mallopt settings)"


def test_an_unnamed_c_library_is_called_unknown(monkeypatch):
    monkeypatch.delenv(_allocator.OPT_OUT_VARIABLE, raising=False)
    monkeypatch.setattr(_allocator.platform, "libc_ver", lambda: ("", ""))
    assert configure() == "malloc: left as it is (C library unknown, not glibc)"


@pytest.mark.parametrize("found, opened", [("libc.so.7", "libc.so.7"), (None, "libc.so.6")])
def test_the_c_library_is_the_one_found_else_glibcs_usual_name(monkeypatch, found, opened):
    looked_up, loaded, set_up = [], [], []

    class Libc:
        @staticmethod
        def mallopt(parameter, value):
            set_up.append((parameter, value))
            return 1

    def cdll(name):
        loaded.append(name)
        return Libc()

    monkeypatch.delenv(_allocator.OPT_OUT_VARIABLE, raising=False)
    monkeypatch.setattr(_allocator.platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(_allocator.ctypes.util, "find_library", lambda name: looked_up.append(name) or found)
    monkeypatch.setattr(_allocator.ctypes, "CDLL", cdll)
    assert configure() == ("malloc: freed activation memory is reused, not unmapped (glibc mmap off, trim threshold "
                           "2 GiB; TTFTC_CPU_MALLOC=system keeps the defaults)")
    assert looked_up == ["c"] and loaded == [opened]
    assert set_up == [(-4, 0), (-1, 2**31 - 1)]  # malloc.h's M_MMAP_MAX: no mmap; M_TRIM_THRESHOLD: never trim
