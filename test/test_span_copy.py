"""The capsules' span copies (src/copy_spans.c, through the extension module of
src/span_copy_module.c): the bytes of torch's slicing for any thread count, a layout's rows laid
end to end, bookkeeping run during the copy, malformed spans and rows refused, addresses only of byte tensors,
capsules that are the same bytes whichever copy made them, and snapshots and restores that fail
or are interrupted around the copy leaving nothing half done."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from flashrt_ros.capsule import span_copy
from flashrt_ros.runtime import Engine, ModelConfig
from thread_counts import at_thread_counts


def test_the_build_installs_the_span_copy():
    """colcon builds it (CMakeLists.txt); without it capsules would silently copy through torch."""
    assert span_copy.available()


def _spans(size: int) -> list[tuple[int, int, int]]:
    """(destination offset, source offset, length): odd lengths and offsets, one empty, out of
    order, so that the threads' blocks start and end inside spans; the long one is streamed,
    from a destination off the 16-byte grid (see copy_spans.c)."""
    return [(5, 1000, 333), (400, 7, 1), (401, 0, 0), (2003, 3001, size - 3004), (402, 2500, 97)]


def test_spans_land_where_torch_slicing_puts_them_at_any_thread_count():
    size = 5 * (1 << 16) + 777   # six 64 KiB blocks: every thread count here gets some
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    expected = torch.zeros(size, dtype=torch.uint8)
    for d, s, n in _spans(size):
        expected[d:d + n] = src[s:s + n]

    def copied() -> torch.Tensor:
        dst = torch.zeros(size, dtype=torch.uint8)
        to, at = span_copy.address_of(dst), span_copy.address_of(src)
        span_copy.copy([v for d, s, n in _spans(size) for v in (to + d, at + s, n)])
        return dst

    for out in at_thread_counts(copied, (1, 2, 3, 7)):
        assert torch.equal(out, expected)


# (offset, row bytes) of three per-token regions of a 3000-byte buffer, the second starting where
# the fixed block ends (Layout.ranges merges those two; laid end to end it is the same bytes).
_FIXED, _ROWS = 37, ((37, 11), (600, 5), (1200, 29))


def _row_ranges(start: int, end: int) -> list[tuple[int, int]]:
    return [(0, _FIXED)] + ([(o + start * r, o + end * r) for o, r in _ROWS] if end > start else [])


@pytest.mark.parametrize("start, end", [(0, 50), (3, 50), (17, 18), (9, 9), (12, 4)])
def test_rows_land_as_the_layouts_ranges_laid_end_to_end(start, end):
    src = torch.randint(0, 256, (3000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    expected = torch.cat([src[s:e] for s, e in _row_ranges(start, end)])
    dst = torch.zeros(expected.numel() + 8, dtype=torch.uint8)
    span_copy.copy_rows(span_copy.address_of(dst) + 3, span_copy.address_of(src), _FIXED, _ROWS, start, end)
    assert torch.equal(dst[3:3 + expected.numel()], expected) and not dst[:3].any() and not dst[3 + expected.numel():].any()


def test_during_runs_on_the_calling_thread_and_its_result_comes_once_every_byte_is_copied():
    """A snapshot's bookkeeping runs as ``during`` while the other threads copy: rows of 1 MiB
    and more are sixteen blocks and more, enough for every thread count here to share."""
    rows = ((4096, 4096), (8 << 20, 2048))
    src = torch.randint(0, 256, ((8 << 20) + (300 << 11),), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(3))
    expected = torch.cat([src[s:e] for s, e in [(0, 999), (4096 + 7 * 4096, 4096 + 300 * 4096),
                                                ((8 << 20) + 7 * 2048, (8 << 20) + 300 * 2048)]])

    def copied() -> tuple[torch.Tensor, int]:
        dst = torch.zeros(expected.numel(), dtype=torch.uint8)
        ran_on = span_copy.copy_rows(span_copy.address_of(dst), span_copy.address_of(src), 999, rows, 7, 300,
                                     during=threading.get_ident)
        return dst, ran_on

    for dst, ran_on in at_thread_counts(copied, (1, 2, 3)):
        assert ran_on == threading.get_ident()
        assert torch.equal(dst, expected)


def test_an_exception_in_during_is_raised_after_the_copy_is_whole():
    size = 1 << 20
    src, dst = torch.ones(size, dtype=torch.uint8), torch.zeros(size, dtype=torch.uint8)

    def fails() -> None:
        raise RuntimeError("bookkeeping failed")

    with pytest.raises(RuntimeError, match="bookkeeping failed"):
        span_copy.copy_rows(span_copy.address_of(dst), span_copy.address_of(src), size, (), 0, 0, during=fails)
    assert bool(dst.all())


@pytest.mark.parametrize("fixed, rows, start, during, error, match", [
    (4, _ROWS, 0, 42, TypeError, "during must be callable"),
    (-1, _ROWS, 0, None, ValueError, "fixed must be"),
    (4, [(0, 1)], 0, None, TypeError, "rows must be a tuple"),          # a list
    (4, ((0, 1, 2),), 0, None, TypeError, "rows must be a tuple"),      # not pairs
    (4, ((0, -1),), 0, None, ValueError, "a row size must be"),
    (4, (("0", 1),), 0, None, ValueError, "a row offset must be"),      # not ints
    (4, _ROWS, -2, None, ValueError, "start must be"),
    (4, ((0, 2 ** 62),), 0, None, OverflowError, "past 64-bit addresses"),   # 5 rows of 2^62 bytes
    (4, ((0, 2 ** 46),), 0, None, OverflowError, "more bytes than one copy"),  # 5 x 64 TiB
    (True, _ROWS, 0, None, ValueError, "fixed must be"),                # a bool is no size
])
def test_malformed_rows_are_refused_before_any_byte_is_copied(fixed, rows, start, during, error, match):
    src, dst = torch.ones(3000, dtype=torch.uint8), torch.zeros(3000, dtype=torch.uint8)
    with pytest.raises(error, match=match):
        span_copy.copy_rows(span_copy.address_of(dst), span_copy.address_of(src), fixed, rows, start, 5,
                            during=during)
    assert not dst.any()


def test_prepared_copies_repeat_the_same_spans():
    src, dst = torch.arange(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    prepared = span_copy.SpanCopy([span_copy.address_of(dst) + 8, span_copy.address_of(src), 16], keep=[src, dst])
    for _ in range(2):
        prepared()
        assert torch.equal(dst[8:24], src[:16]) and not dst[:8].any() and not dst[24:].any()
        dst.zero_()


def test_more_spans_than_the_call_keeps_on_its_stack_land_the_same():
    """Past 32 triples the call copies them into the heap first: the same bytes."""
    src, dst = torch.arange(256, dtype=torch.uint8), torch.zeros(256, dtype=torch.uint8)
    to, at = span_copy.address_of(dst), span_copy.address_of(src)
    span_copy.copy(tuple(v for i in range(100) for v in (to + 2 * i, at + 255 - i, 1)))
    assert dst[0:200:2].tolist() == list(range(255, 155, -1)) and not dst[1:200:2].any() and not dst[200:].any()


class _Resizes:
    """An int-like item whose conversion would empty the list being read."""

    victim: list = []

    def __index__(self) -> int:
        self.victim.clear()
        return 3


@pytest.mark.parametrize("spans, error", [
    ([1, 2], ValueError),                  # not triples
    ([1, 2, -3], ValueError),              # a negative length
    ([1, 2, "3"], TypeError),              # not ints
    ([1, 2, 2 ** 70], OverflowError),      # past 64 bits
    ([1, 2, 2 ** 62, 3, 4, 2 ** 62], OverflowError),   # lengths that add up past 2^63
    ([1, 2, 2 ** 48], OverflowError),      # more blocks than the copy counts
    ([1, 2, True], TypeError),             # a bool is no length
    ([1, 2, _Resizes()], TypeError),       # an __index__ could resize the list under the call
    (7, TypeError),                        # not a sequence
    (b"abc", TypeError),                   # iterable, but bytes are not spans
    (iter([1, 2, 3]), TypeError),
])
def test_malformed_spans_are_refused_before_any_byte_is_copied(spans, error):
    dst = torch.zeros(16, dtype=torch.uint8)
    src = torch.ones(16, dtype=torch.uint8)
    good = [span_copy.address_of(dst), span_copy.address_of(src), 16]
    given = good + spans if isinstance(spans, list) else spans
    _Resizes.victim = given if isinstance(given, list) else []
    with pytest.raises(error):
        span_copy.copy(given)
    assert not dst.any()


@pytest.mark.parametrize("bad", [
    lambda a: a.view(torch.int32),     # not bytes
    lambda a: a[::2],                  # not contiguous
    lambda a: a.view(10, 10),          # not 1-D
    lambda a: a.float(),
])
def test_only_byte_tensors_give_an_address(bad):
    with pytest.raises(ValueError, match="1-D contiguous uint8 CPU"):
        span_copy.address_of(bad(torch.zeros(100, dtype=torch.uint8)))


def test_capsules_are_the_same_bytes_through_torch_and_the_span_copy(monkeypatch):
    """One engine copies through the library, one through torch (as where it is not built):
    same digests, and each restores its snapshot byte for byte (returns and full restores)."""
    ids = torch.randint(0, 250, (40,), generator=torch.Generator().manual_seed(2))
    digests = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(span_copy, "_MODULE", None)
        engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=128)
        engine.prefill(ids)
        held = engine.snapshot()
        at_snapshot = engine.arena.buffer.clone()
        engine.generate(5)
        engine.restore(held)                      # a return: the fixed-size state and new rows only
        assert torch.equal(engine.arena.buffer[:engine.arena.fixed_bytes], at_snapshot[:engine.arena.fixed_bytes])
        engine.reset()
        engine.restore(held)                      # a full restore
        digests.append(engine.capsules.get(held.id).digest)
        assert engine.state_digest() == digests[-1]
        engine.close()
    assert digests[0] == digests[1]


def test_a_buffer_shorter_than_the_layout_is_refused_and_nothing_is_kept():
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=64)
    engine.prefill([1, 2, 3])
    store = engine.capsules
    used = store.used_bytes("device")
    with pytest.raises(ValueError, match="spans reach byte"):
        store.capture(engine.arena.buffer[:4096], 3, name=None, tier="device", pin=False, parent="", base=None,
                      log_runs=())
    assert store.used_bytes("device") == used and store.list() == []


def test_a_snapshot_interrupted_as_its_copy_returns_is_hashed_and_drops_whole(monkeypatch):
    """A Ctrl-C during the copy is raised as the C call returns, after the bookkeeping that
    ran during it: the capsule it made is still queued for its digest, and dropping it
    frees its bytes."""
    from flashrt_ros.capsule import store as store_module

    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=64)
    engine.prefill([1, 2, 3])
    used = engine.capsules.used_bytes("device")
    real = span_copy.copy_rows

    def interrupted(*args, during=None):
        real(*args, during=during)
        raise KeyboardInterrupt

    monkeypatch.setattr(store_module.span_copy, "copy_rows", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.snapshot(name="cut")
    monkeypatch.setattr(store_module.span_copy, "copy_rows", real)
    assert engine.capsules.get("cut").digest == engine.state_digest()
    engine.capsules.drop("cut")
    assert engine.capsules.used_bytes("device") == used
    engine.close()


@pytest.mark.parametrize("native", [True, False])
def test_a_restore_interrupted_in_its_bookkeeping_leaves_the_next_restore_exact(native, monkeypatch):
    """A Ctrl-C pressed during a restore's copy is raised in the bookkeeping that runs during
    it: the arena already holds the new bytes, so the next restore must copy every row instead
    of trusting those of the capsule the state last came from."""
    from flashrt_ros.runtime import engine as engine_module

    if not native:
        monkeypatch.setattr(span_copy, "_MODULE", None)
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=64)
    engine.prefill(list(range(1, 9)))
    engine.snapshot(name="s")
    engine.generate(4)
    engine.snapshot(name="b")
    engine.restore("s")
    engine.prefill([40, 41, 42, 43])       # another continuation of s
    a = engine.snapshot(name="a")
    real = engine_module.BoundaryLog

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine_module, "BoundaryLog", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.restore("b")
    monkeypatch.setattr(engine_module, "BoundaryLog", real)
    engine.restore("a")
    assert engine.state_digest() == engine.capsules.get(a.id).digest
    assert engine.rollback(0) == a.position
    engine.close()


def test_a_snapshot_whose_bookkeeping_fails_keeps_no_bytes(monkeypatch):
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=64)
    engine.prefill([1, 2, 3])
    store = engine.capsules
    used, largest = store.used_bytes("device"), store.pool.largest_free()

    def no_id() -> str:
        raise RuntimeError("no id")

    monkeypatch.setattr(store, "_new_id", no_id)
    with pytest.raises(RuntimeError, match="no id"):
        engine.snapshot()
    assert store.used_bytes("device") == used and store.pool.largest_free() == largest and store.list() == []
    engine.close()


def test_a_chunk_placed_elsewhere_than_the_copy_went_is_never_registered(monkeypatch):
    """The copy starts where first fit will place the chunk, before it is allocated: should the
    pool place it anywhere else, the snapshot fails and keeps nothing, rather than register a
    chunk that does not hold its bytes."""
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=64)
    engine.prefill([1, 2, 3])
    store = engine.capsules
    used, largest = store.used_bytes("device"), store.pool.largest_free()
    elsewhere = torch.zeros(store.layout.ranges_bytes(3), dtype=torch.uint8)
    monkeypatch.setattr(store.pool, "address_for", lambda nbytes: span_copy.address_of(elsewhere))
    with pytest.raises(RuntimeError, match="not 0x"):
        engine.snapshot()
    assert torch.equal(elsewhere, torch.cat([engine.arena.buffer[s:e] for s, e in store.layout.ranges(3)]))
    assert store.used_bytes("device") == used and store.pool.largest_free() == largest and store.list() == []
    engine.close()


def test_ids_differ_in_a_forked_child(tmp_path):
    """A child shares its parent's generator state and its ids made ahead at the fork: it is
    seeded again and drops them, or both would make the same ids (and overwrite each other's
    disk capsules)."""
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=32)
    engine.capsules._new_id()   # the parent now holds ids made ahead
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: no OpenMP here (libgomp does not survive a fork once used)
        try:
            os.write(write, engine.capsules._new_id().encode())
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 64).decode() != engine.capsules._new_id()


def test_the_gpu_hosts_path_of_a_host_capsule_gives_the_same_bytes(monkeypatch):
    """On a GPU a host capsule is copied piece by piece without blocking, marked for the digest
    thread to wait on, and restored through torch: that path, run here on the CPU."""
    monkeypatch.setattr(span_copy, "_MODULE", None)
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=64)
    engine.capsules._local["host"] = False
    engine.prefill(list(range(1, 20)))
    live = engine.state_digest()
    host = engine.snapshot(tier="host")
    engine.generate(5)
    assert engine.capsules.get(host.id).digest == live
    engine.restore(host, verify=True)
    assert engine.state_digest() == live
    engine.close()
