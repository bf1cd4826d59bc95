"""The transposing cast a CPU load writes its weights with (src/transpose_cast.c): the bytes of
torch's transpose and cast, into the right columns only, for any thread count."""
from __future__ import annotations

import pytest
import torch

from flashrt_ros.runtime.backends.cpu import transpose_cast
from flashrt_ros.runtime.models import cast as models_cast
from flashrt_ros.runtime.models.cast import Cast, huge_pages
from thread_counts import at_thread_counts


def _matrix(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    values = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    values.view(-1)[::7] = float("inf")   # specials pass as they are: the load checks them, not the cast
    values.view(-1)[3::11] = -0.0
    return values.to(dtype)


def test_the_build_installs_the_kernel():
    """colcon builds it (CMakeLists.txt); without it every load would quietly take torch's copies."""
    assert transpose_cast.serves(torch.empty(0, dtype=torch.bfloat16), torch.empty(0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, cols", [(1, 1), (33, 65), (100, 7), (7, 100), (64, 64), (513, 31), (40, 300)])
def test_a_matrix_lands_transposed_and_cast_in_its_columns_and_nowhere_else(dtype, rows, cols):
    source = _matrix(rows, cols, dtype, rows * cols)
    first, width, guard = 5, rows + 9, 64

    def written() -> torch.Tensor:
        memory = torch.full((guard + cols * width + guard,), 7.0)   # the weight, with memory either side
        transpose_cast.into(source, memory[guard:guard + cols * width].view(cols, width), first)
        return memory

    outs = at_thread_counts(written)
    expected = torch.full((guard + cols * width + guard,), 7.0)
    expected[guard:guard + cols * width].view(cols, width)[:, first:first + rows] = source.t().float()
    for out in outs:
        assert torch.equal(out.view(torch.int32), expected.view(torch.int32))   # bit for bit, -0.0 included


def test_a_one_row_view_of_any_stride_is_written():
    """A [1, n] view may carry a row stride below n (torch counts it contiguous): it is never used."""
    row = torch.arange(6.0).reshape(6, 1).t()
    assert row.shape == (1, 6) and row.stride() == (1, 1)
    out = torch.zeros(6, 1)
    transpose_cast.into(row, out, 0)
    assert torch.equal(out, row.t())


def test_a_source_whose_rows_lie_apart_is_read_by_its_stride():
    wide = _matrix(40, 96, torch.bfloat16, 1)
    source = wide[:, 10:60]          # rows 96 elements apart, 50 read from each
    assert source.stride(0) == 96 and not source.is_contiguous()
    out = torch.empty(50, 40)
    transpose_cast.into(source, out, 0)
    assert torch.equal(out, source.t().float())


def test_shapes_that_do_not_fit_are_refused_before_anything_is_written():
    out = torch.full((8, 10), 3.0)
    for source, first in ((torch.zeros(4, 7), 0), (torch.zeros(4, 8), 7), (torch.zeros(4, 8), -1)):
        with pytest.raises(ValueError, match="does not fit"):
            transpose_cast.into(source, out, first)
    with pytest.raises(ValueError, match="contiguous 2-D"):
        transpose_cast.into(torch.zeros(4, 8), out[:, :5], 0)
    assert torch.equal(out, torch.full((8, 10), 3.0))


def test_what_the_kernel_would_misread_or_overrun_is_refused_before_anything_is_written():
    out = torch.full((8, 10), 3.0)
    refused = [
        (torch.zeros(4, 8), torch.zeros(8, 10, dtype=torch.bfloat16)),      # a narrower destination
        (torch.zeros(4, 8, dtype=torch.uint8), out),                        # bytes read as bfloat16
        (torch.zeros(4, 8, dtype=torch.float16), out),                      # not the kernel's dtype
        (torch._neg_view(torch.ones(4, 8)), out),                           # a negation it would miss
        (out[:4, :8], out),                                                 # its own destination
    ]
    for source, destination in refused:
        before = destination.clone()
        with pytest.raises(ValueError):
            transpose_cast.into(source, destination, 0)
        assert torch.equal(destination, before)


def test_disabled_blocks_nest_and_hold_until_the_outer_one_ends():
    matrix = torch.zeros(2, 2, dtype=torch.bfloat16)
    with transpose_cast.disabled():
        with transpose_cast.disabled():
            assert not transpose_cast.serves(matrix, torch.zeros(2, 2))
        assert not transpose_cast.serves(matrix, torch.zeros(2, 2))
    assert transpose_cast.serves(matrix, torch.zeros(2, 2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_a_fused_projection_is_the_same_bytes_with_the_kernel_and_with_torch(dtype, monkeypatch):
    """float16 is not the kernel's: that part goes through torch's copies, beside the others."""
    into = transpose_cast.into
    parts = [_matrix(48, 64, dtype, 2), _matrix(16, 64, torch.bfloat16, 3), _matrix(3, 64, dtype, 4)]
    cast = Cast(torch.device("cpu"), torch.float32)
    with transpose_cast.disabled():
        by_torch = cast.t(*parts)
    calls = []
    monkeypatch.setattr(transpose_cast, "into", lambda *args: calls.append(args) or into(*args))
    by_kernel = cast.t(*parts)
    assert len(calls) == sum(p.dtype != torch.float16 for p in parts)   # the kernel wrote its parts
    assert by_kernel.shape == (64, 67) and by_kernel.is_contiguous()
    assert torch.equal(by_kernel.view(torch.int32), by_torch.view(torch.int32))
    assert torch.equal(by_kernel, torch.cat([p.float() for p in parts]).t())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_expert_stack_is_each_matrix_transposed_with_the_kernel_and_with_torch(dtype):
    stack = torch.stack([_matrix(24, 40, dtype, seed) for seed in range(5)])   # [experts, out, in]
    cast = Cast(torch.device("cpu"), torch.float32)
    with transpose_cast.disabled():
        by_torch = cast.t_each(stack)
    by_kernel = cast.t_each(stack)
    assert by_kernel.shape == (5, 40, 24) and by_kernel.is_contiguous()
    assert torch.equal(by_kernel.view(torch.int32), by_torch.view(torch.int32))
    assert torch.equal(by_kernel, stack.transpose(1, 2).float())


def test_parts_of_other_input_widths_are_refused_on_either_path():
    parts = (torch.zeros(3, 8, dtype=torch.bfloat16), torch.zeros(2, 1, dtype=torch.bfloat16))
    cast = Cast(torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="one input width"):
        cast.t(*parts)
    with transpose_cast.disabled(), pytest.raises(ValueError, match="one input width"):
        cast.t(*parts)   # torch's copy would broadcast the narrow part


def test_weights_go_on_huge_pages_only_inside_the_switch_with_the_same_bytes(monkeypatch):
    """Pages are the kernel's business: the benchmark's huge-page load must build the same model,
    and the switch must be put back, by an exception too."""
    asked = []
    real = models_cast.empty_huge
    monkeypatch.setattr(models_cast, "empty_huge", lambda *args: asked.append(args[0]) or real(*args))
    parts = [_matrix(48, 64, torch.bfloat16, 5), _matrix(16, 64, torch.bfloat16, 6)]
    cast = Cast(torch.device("cpu"), torch.float32)
    plain = cast.t(*parts)
    assert not asked
    with pytest.raises(RuntimeError, match="inside"):
        with huge_pages(), huge_pages():
            assert torch.equal(cast.t(*parts).view(torch.int32), plain.view(torch.int32))
            assert torch.equal(cast(parts[0]), parts[0].float())
            assert asked == [(64, 64), (48, 64)]   # the fused projection [in, out], then the plain cast
            raise RuntimeError("inside")
    cast.t(*parts)
    assert len(asked) == 2 and models_cast._huge == 0   # both blocks closed
