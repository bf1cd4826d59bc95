"""Decode's one-row products on the package's C kernel (src/row_product.c): the same bytes for
every thread count and vector path, close to float64, and recorded for replays."""
from __future__ import annotations

import pytest
import torch

from flashrt_ros.errors import InvalidArgument
from flashrt_ros.replay.session import engine_for, session_of
from flashrt_ros.runtime import Engine, ModelConfig, row_product
from flashrt_ros.runtime.projection import Projection, blocked_layout_serves, project
from thread_counts import at_thread_counts


def test_the_build_installs_the_kernel():
    """colcon builds it (CMakeLists.txt); without it decode would silently be the slower fallback."""
    assert row_product.available()


def _product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return row_product.row_product(x, w, row_product.scratch(w.shape[1]))


def _at_thread_counts(x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    return at_thread_counts(lambda: _product(x, w))


@pytest.mark.parametrize("k, n", [(512, 1552), (1536, 512), (64, 32768), (13, 7), (5, 1), (3, 40)])
def test_products_are_the_same_bytes_for_any_thread_count_and_close_to_float64(k, n):
    gen = torch.Generator().manual_seed(k * n)
    w, x = torch.randn(k, n, generator=gen), torch.randn(1, k, generator=gen)
    outs = _at_thread_counts(x, w)
    assert all(torch.equal(outs[0], out) for out in outs)
    exact = x.double() @ w.double()
    # Eight partial sums of FMA chains: at least as close to float64 as torch's own product.
    assert (outs[0].double() - exact).abs().max() <= 1.5 * ((x @ w).double() - exact).abs().max() + 1e-6


def test_the_portable_loops_give_the_bytes_of_the_vector_ones():
    """What makes a journal replay exactly on a machine without AVX2 (or on ARM): fmaf rounds
    once wherever it runs, and no output's order depends on the vector width."""
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(1000, 300, generator=gen), torch.randn(1, 1000, generator=gen)
    fast = _product(x, w)
    row_product.use_portable_loops(True)
    try:
        portable = _product(x, w)
    finally:
        row_product.use_portable_loops(False)
    assert torch.equal(fast, portable)


def test_flush_to_zero_of_the_calling_thread_holds_in_every_thread():
    """The engine sets flush-to-zero on the thread that runs a step; OpenMP's threads were made
    before and keep their own mode. Products of tiny values (here 1e-40, denormal) must come
    out the same whichever thread took their slab. 1024 rows a slab: a slab's sum of them is
    a normal float, which the thread summing the slabs does not flush."""
    w = torch.full((8192, 8), 1e-20)
    x = torch.full((1, 8192), 1e-20)
    torch.set_flush_denormal(True)
    try:
        outs = _at_thread_counts(x, w)
    finally:
        torch.set_flush_denormal(False)
    assert all(torch.equal(outs[0], out) for out in outs)
    assert _product(x, w).abs().max() > 0   # without it the tiny products add up


def test_wrong_tensors_are_refused_before_the_kernel_touches_them():
    w, scratch = torch.randn(16, 4), row_product.scratch(4)
    for x, words in [(torch.randn(1, 16, dtype=torch.bfloat16), "float32 CPU"), (torch.randn(2, 16), "one row"),
                     (torch.randn(1, 1, 16), "one row"), (torch.randn(1, 15), "one row")]:
        with pytest.raises(ValueError, match=words):
            row_product.row_product(x, w, scratch)
    with pytest.raises(ValueError, match="contiguous"):
        row_product.row_product(torch.randn(1, 4), w.t(), scratch)
    with pytest.raises(ValueError, match="scratch"):
        row_product.row_product(torch.randn(1, 16), w, torch.empty(4))
    # Enough elements, one float of memory: the kernel wrote past it (an ASan review found it).
    with pytest.raises(ValueError, match="scratch"):
        row_product.row_product(torch.randn(1, 16), w, torch.empty(1).expand(scratch.numel()))


def test_a_thread_count_below_one_runs_on_one_thread():
    """The C entry point itself: OpenMP leaves num_threads(0) undefined."""
    x, w, scratch = torch.randn(1, 16), torch.randn(16, 8), row_product.scratch(8)
    expected = row_product.row_product(x, w, scratch)
    y = torch.empty(1, 8)
    kernel = row_product._KERNEL[0]
    for threads in (0, -3):
        assert kernel(x.data_ptr(), w.data_ptr(), y.data_ptr(), scratch.data_ptr(), 16, 8, threads, 0) == 0
        assert torch.equal(y, expected)


@pytest.mark.parametrize("k, n", [(512, 1552), (1536, 512), (64, 32768), (128, 8)])
def test_the_tiled_layout_gives_the_bytes_of_the_row_major_one(k, n):
    """Same FMA chains in the same order, read from tiles: the same bytes at any thread count
    and in the portable loop."""
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(k, n, generator=gen), torch.randn(1, k, generator=gen)
    tiles, scratch = row_product.tiled(w), row_product.scratch(n)
    # The same values, moved (one tile wide, n = 8, is row-major already).
    assert torch.equal(tiles, w) == (n == 8) and torch.equal(tiles.flatten().sort()[0], w.flatten().sort()[0])
    plain = _product(x, w)
    for out in at_thread_counts(lambda: row_product.row_product(x, tiles, scratch, is_tiled=True)):
        assert torch.equal(out, plain)
    row_product.use_portable_loops(True)
    try:
        assert torch.equal(row_product.row_product(x, tiles, scratch, is_tiled=True), plain)
    finally:
        row_product.use_portable_loops(False)


def test_shapes_the_tiled_layout_does_not_fit_are_refused():
    assert row_product.tiles_serve(512, 1552) and not row_product.tiles_serve(500, 1552)
    assert not row_product.tiles_serve(512, 1550)
    with pytest.raises(ValueError, match="cannot take the tiled layout"):
        row_product.tiled(torch.randn(60, 16))
    with pytest.raises(ValueError, match="cannot be in the tiled layout"):
        row_product.row_product(torch.randn(1, 60), torch.randn(60, 16), row_product.scratch(16), is_tiled=True)


@pytest.mark.skipif(not blocked_layout_serves(torch.device("cpu"), torch.float32),
                    reason="oneDNN's blocked layout: x86 CPUs only")
def test_projections_tile_only_weights_whose_many_row_products_never_read_them():
    gen = torch.Generator().manual_seed(4)
    w, x = torch.randn(512, 512, generator=gen), torch.randn(3, 512, generator=gen)
    blocked = Projection(w, blocked=True, native_rows=True)       # prefill reads oneDNN's copy
    head = Projection(w, native_rows=True, many_rows=False)        # like the LM head: one row only
    plain = Projection(w, native_rows=True)                        # prefill reads w itself
    assert blocked.tiled and head.tiled and not plain.tiled and torch.equal(plain.w, w)
    for proj in (blocked, head, plain):
        assert torch.equal(proj(x[:1]), _product(x[:1], w))
    assert torch.allclose(blocked(x), project(x, w), atol=1e-4)
    with pytest.raises(ValueError, match="one row at a time"):
        head(x)
    assert head(x[:0]).shape == (0, 512)


def test_projections_use_it_for_one_row_only():
    gen = torch.Generator().manual_seed(2)
    w, x = torch.randn(256, 96, generator=gen), torch.randn(4, 256, generator=gen)
    proj = Projection(w, native_rows=True)
    assert torch.equal(proj(x[:1]), _product(x[:1], w))
    assert torch.equal(proj(x), project(x, w))   # many rows: torch's product, as before


def test_engines_run_decode_on_it_where_it_serves_and_record_it():
    cfg = ModelConfig.tiny()
    native, fallback = Engine.from_config(cfg, max_seq_len=256), Engine.from_config(cfg, max_seq_len=256,
                                                                                       decode_native=False)
    assert native.decode_native and not fallback.decode_native
    assert not Engine.from_config(cfg, max_seq_len=64, dtype=torch.bfloat16).decode_native
    with pytest.raises(InvalidArgument, match="decode_native must be True or False"):
        Engine.from_config(cfg, max_seq_len=64, decode_native="yes")
    for engine in (native, fallback):
        engine.prefill(list(range(1, 40)))
    # Two products that round differently, the same greedy tokens on the default model.
    assert native.generate(32) == fallback.generate(32)
    assert torch.allclose(native.logits(), fallback.logits(), atol=1e-5)
    recorded = session_of(native, "", 0)
    assert recorded["decode_native"] is True and recorded["row_product"] == row_product.version() != ""
    assert engine_for(session_of(fallback, "", 0)).decode_native is False
    older = {k: v for k, v in recorded.items() if k not in ("decode_native", "row_product")}
    assert engine_for(older).decode_native is False   # recorded before the kernel: the fallback's products
    with pytest.raises(InvalidArgument, match="row_product kernel '0.4'.*may round differently"):
        engine_for(recorded | {"row_product": "0.4"})


def test_a_session_recorded_on_the_kernel_is_refused_where_it_is_not_built(monkeypatch):
    session = session_of(Engine.from_config(ModelConfig.tiny(), max_seq_len=64), "", 0)
    monkeypatch.setattr(row_product, "_KERNEL", None)   # as on a machine where it was not built
    with pytest.raises(InvalidArgument, match="not built here"):
        engine_for(session)
