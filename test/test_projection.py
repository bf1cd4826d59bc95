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
    wide = ModelConfig.tiny(hidden_size=512, intermediate_size=1024)   # the default's projections are too small
    on = Engine.from_config(wide, max_seq_len=256)
    off = Engine.from_config(wide, max_seq_len=256, prefill_blocked=False)
    assert off.prefill_blocked is False
    assert on.prefill_blocked == blocked_layout_serves(torch.device("cpu"), torch.float32)
    assert all(b.gate_up.blocked is not None for b in on.model.blocks) == on.prefill_blocked
    assert all(b.gate_up.blocked is None for b in off.model.blocks)
    small = Engine.from_config(ModelConfig.tiny(), max_seq_len=64)
    assert not small.prefill_blocked   # every projection under the size where blocking pays
    prompt = list(range(5, 120))
    assert torch.allclose(on.prefill(prompt), off.prefill(prompt), atol=1e-4)
    assert on.generate(16) == off.generate(16)


@needs_blocked
def test_a_process_held_to_avx2_kernels_holds_onednn_there_too(tmp_path):
    """A journal recorded with ATEN_CPU_CAPABILITY=avx2 must replay on any x86 machine, and
    flashrt-replay sets only that variable: oneDNN, which picks its own kernels (its AVX-512
    ones round differently on the bench model), must follow it in the recording process."""
    import os
    import subprocess
    import sys

    script = (
        "import os, torch\n"
        "from flashrt_ros.runtime import Engine, ModelConfig\n"
        "e = Engine.from_config(ModelConfig.bench(), max_seq_len=520)\n"
        "e.prefill(torch.randint(0, 32768, (512,), generator=torch.Generator().manual_seed(0)))\n"
        "print(os.environ.get('ONEDNN_MAX_CPU_ISA'), e.state_digest())\n")
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}

    def run(**extra) -> list[str]:
        out = subprocess.run([sys.executable, "-c", script], env={**env, **extra}, capture_output=True, text=True,
                             cwd=tmp_path, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split()

    implied = run(ATEN_CPU_CAPABILITY="avx2")
    explicit = run(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    assert implied == ["AVX2", explicit[1]]
