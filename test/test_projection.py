"""The model's products: oneDNN's blocked weights for many rows, the slab GEMV for one."""
from __future__ import annotations

import pytest
import torch

from flashrt_ros.runtime import Engine, ModelConfig
from flashrt_ros.runtime.projection import Projection, blocked_layout_serves

needs_blocked = pytest.mark.skipif(not blocked_layout_serves(torch.device("cpu"), torch.float32),
                                   reason="oneDNN's blocked layout is used on x86 CPUs only")


@needs_blocked
def test_blocked_products_are_the_same_bytes_for_any_row_count_and_thread_count():
    """A row's product does not depend on the rows beside it, nor on the threads."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(512, 1552, generator=gen)          # the bench model's linear in_proj shape
    x = torch.randn(600, 512, generator=gen)
    proj = Projection(w, blocked=True)
    whole = proj(x)
    assert torch.allclose(whole, x @ w, rtol=1e-4, atol=1e-3)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (2, 7, 64, 512, 600):
                assert torch.equal(proj(x[:rows]), whole[:rows]), (rows, count)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(proj(x[:1]), Projection(w)(x[:1]))   # one row: the decode path, both alike


def test_the_blocked_layout_is_an_option_and_both_give_the_same_tokens():
    on = Engine.from_config(ModelConfig.tiny(), max_seq_len=256)
    off = Engine.from_config(ModelConfig.tiny(), max_seq_len=256, prefill_blocked=False)
    assert off.prefill_blocked is False
    assert on.prefill_blocked == blocked_layout_serves(torch.device("cpu"), torch.float32)
    prompt = list(range(5, 120))
    assert torch.allclose(on.prefill(prompt), off.prefill(prompt), atol=1e-4)
    assert on.generate(16) == off.generate(16)
