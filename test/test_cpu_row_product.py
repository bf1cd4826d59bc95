"""Few-row products on the CPU backend's kernel (src/row_product.c): the same bytes for every
thread count, vector path and number of rows beside a row, close to float64, and recorded for
replays."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from flashrt_ros.errors import InvalidArgument
from flashrt_ros.replay.session import engine_for, session_of
from flashrt_ros.runtime import Engine, ModelConfig
from flashrt_ros.runtime.backends.cpu import row_product
from flashrt_ros.runtime.projection import Projection
from thread_counts import at_thread_counts


def test_the_build_installs_the_kernel():
    """colcon builds it (CMakeLists.txt); without it decode would silently run torch's product."""
    assert row_product.available() and row_product.MAX_ROWS >= 2


def _product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return row_product.row_product(x, w, row_product.scratch(w.shape[1]))


@pytest.mark.parametrize("k, n", [(512, 1552), (1536, 512), (64, 32768), (13, 7), (5, 1), (3, 40)])
def test_products_are_the_same_bytes_for_any_thread_count_and_close_to_float64(k, n):
    gen = torch.Generator().manual_seed(k * n)
    w, x = torch.randn(k, n, generator=gen), torch.randn(1, k, generator=gen)
    outs = at_thread_counts(lambda: _product(x, w))
    assert all(torch.equal(outs[0], out) for out in outs)
    exact = x.double() @ w.double()
    # Eight partial sums of FMA chains: at least as close to float64 as torch's own product.
    assert (outs[0].double() - exact).abs().max() <= 1.5 * ((x @ w).double() - exact).abs().max() + 1e-6


@pytest.mark.parametrize("k, n", [(512, 1552), (64, 300), (13, 7), (24, 33001), (80, 33001), (136, 9000)])
def test_each_row_is_the_bytes_it_has_alone_whatever_rows_come_with_it(k, n):
    """Batch invariance: what lets speculative verify rows match single-row steps bit for bit."""
    gen = torch.Generator().manual_seed(k + n)
    w, x = torch.randn(k, n, generator=gen), torch.randn(row_product.MAX_ROWS, k, generator=gen)
    alone = torch.cat([_product(x[i:i + 1], w) for i in range(x.shape[0])])
    for m in range(1, row_product.MAX_ROWS + 1):
        for out in at_thread_counts(lambda: _product(x[:m], w), (1, 2)):
            assert torch.equal(out, alone[:m]), m


def test_the_portable_loops_give_the_bytes_of_the_vector_ones():
    """What makes a journal replay exactly on a machine without AVX2 (or on ARM): fmaf rounds
    once wherever it runs, and no output's order depends on the vector width."""
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(1000, 300, generator=gen), torch.randn(3, 1000, generator=gen)
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
        outs = at_thread_counts(lambda: _product(x, w))
    finally:
        torch.set_flush_denormal(False)
    assert all(torch.equal(outs[0], out) for out in outs)
    assert _product(x, w).abs().max() > 0   # without it the tiny products add up


def test_wrong_tensors_are_refused_before_the_kernel_touches_them():
    w, scratch = torch.randn(16, 4), row_product.scratch(4)
    too_many = row_product.MAX_ROWS + 1
    for x, words in [(torch.randn(1, 16, dtype=torch.bfloat16), "float32 CPU"), (torch.randn(too_many, 16), "rows of"),
                     (torch.randn(1, 1, 16), "rows of"), (torch.randn(1, 15), "rows of"),
                     (torch.randn(0, 16), "rows of")]:
        with pytest.raises(ValueError, match=words):
            row_product.row_product(x, w, scratch)
    with pytest.raises(ValueError, match="contiguous"):
        row_product.row_product(torch.randn(1, 4), w.t(), scratch)
    with pytest.raises(ValueError, match="scratch"):
        row_product.row_product(torch.randn(1, 16), w, torch.empty(4))
    # Enough elements, one float of memory: the kernel would write past it.
    with pytest.raises(ValueError, match="scratch"):
        row_product.row_product(torch.randn(1, 16), w, torch.empty(1).expand(scratch.numel()))


def test_the_c_entry_point_runs_below_one_thread_on_one_and_refuses_a_row_count_it_has_no_room_for():
    x, w, scratch = torch.randn(2, 16), torch.randn(16, 8), row_product.scratch(8)
    expected = row_product.row_product(x, w, scratch)
    y = torch.empty(2, 8)
    kernel = row_product._FOUND[0]
    for threads in (0, -3):   # OpenMP leaves num_threads(0) undefined
        assert kernel(x.data_ptr(), w.data_ptr(), y.data_ptr(), scratch.data_ptr(), 2, 16, 8, threads) == 0
        assert torch.equal(y, expected)
    for m in (0, row_product.MAX_ROWS + 1):
        assert kernel(x.data_ptr(), w.data_ptr(), y.data_ptr(), scratch.data_ptr(), m, 16, 8, 1) == -1


def test_projections_use_it_for_few_rows_and_torch_for_prompts():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(256, 96, generator=gen)
    x = torch.randn(row_product.MAX_ROWS + 4, 256, generator=gen)
    proj = Projection(w)
    assert torch.equal(proj(x), x @ w)   # the torch reference path until the kernel is given
    proj.use_row_kernel(row_product.scratch(96))
    assert torch.equal(proj(x[:3]), _product(x[:3], w))
    assert torch.equal(proj(x), x @ w)   # a prompt chunk: torch's product
    assert proj(x[:0]).shape == (0, 96)


def test_engines_run_the_cpu_backend_where_it_serves_and_record_it():
    cfg = ModelConfig.tiny()
    native, torch_path = Engine.from_config(cfg, max_seq_len=256), Engine.from_config(cfg, max_seq_len=256,
                                                                                      cpu_kernels=False)
    assert native.cpu_kernels and not torch_path.cpu_kernels
    assert not Engine.from_config(cfg, max_seq_len=64, dtype=torch.bfloat16).cpu_kernels
    with pytest.raises(InvalidArgument, match="cpu_kernels must be True or False"):
        Engine.from_config(cfg, max_seq_len=64, cpu_kernels="yes")
    for engine in (native, torch_path):
        engine.prefill(list(range(1, 40)))
    # Two paths that round differently, the same greedy tokens on the default model.
    assert native.generate(32) == torch_path.generate(32)
    assert torch.allclose(native.logits(), torch_path.logits(), atol=1e-5)
    recorded = session_of(native, "", 0)
    assert recorded.cpu_kernels is True and dict(recorded.kernels)["row_product"] == row_product.version() != ""
    assert engine_for(session_of(torch_path, "", 0)).cpu_kernels is False
    with pytest.raises(InvalidArgument, match="row_product kernel '0.4'.*may round differently"):
        engine_for(replace(recorded, kernels=tuple((k, "0.4" if k == "row_product" else v)
                                                   for k, v in recorded.kernels)))


def test_a_session_recorded_on_the_kernels_is_refused_where_they_are_not_built(monkeypatch):
    session = session_of(Engine.from_config(ModelConfig.tiny(), max_seq_len=64), "", 0)
    monkeypatch.setattr(row_product, "_FOUND", None)   # as on a machine where it was not built
    with pytest.raises(InvalidArgument, match="not built here"):
        engine_for(session)
