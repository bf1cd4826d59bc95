"""What a replay needs to rebuild the engine a session ran on."""
from __future__ import annotations

import os
import platform
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..capsule import TIERS
from ..capsule.diskformat import path_for
from ..errors import InvalidArgument
from ..runtime import Engine
from ..runtime.backends import cpu as cpu_backend
from ..serving.record import VERSION, SessionRecord


def session_of(engine: Engine, model_path: str, seed: int) -> SessionRecord:
    store = engine.capsules
    return SessionRecord(
        model_path=str(model_path or ""), seed=seed, dtype=str(engine.dtype).removeprefix("torch."),
        max_seq_len=engine.max_seq_len, prefill_chunk=engine.decoder.prefill_chunk, obs_dim=engine.config.obs_dim,
        action_dim=engine.config.action_dim, rollback_depth=engine.rollback_depth,
        budgets=tuple((t, store.budget_bytes(t)) for t in TIERS), spill=store.spill,
        disk_tier=store.dir is not None, signed=store.signed, model_fingerprint=engine.model_fingerprint,
        layout_fingerprint=engine.layout_fingerprint,
        # Replay is byte-exact on the same kernels: another torch (or another
        # flashrt_ros attention path) may round differently.
        torch=torch.__version__,
        # And at the same thread count: torch splits a large elementwise op (the MLP's
        # SiLU, for one) over its threads, and the last few elements of each share take
        # a scalar path that can round differently (prefill only; decode rows are small).
        torch_threads=torch.get_num_threads(),
        # And on the same vector kernels: torch picks its elementwise kernels by CPU
        # (AVX2 or AVX-512 on x86) and the two round differently.
        aten_cpu_capability=torch.backends.cpu.get_cpu_capability(),
        # Shown on a mismatch too: MKL, which runs torch.mm, picks its code by CPU model
        # and vendor, not only by instruction set.
        cpu=cpu_name(),
        # Graphed (fixed-shape) decode masks over every row; eager decode reads the live ones.
        cuda_graphs=engine.cuda_graphs, fixed_shapes=engine.fixed_shapes, device=engine.device.type,
        # Few-row products and linear attention on the CPU backend (which versions), or on
        # torch: they round differently.
        cpu_kernels=engine.cpu_kernels, kernels=tuple(native_kernels(engine).items()),
        # Disk capsules found in capsule_dir at start: the session may restore them.
        capsule_dir=str(store.dir or ""),
        preloaded=tuple((c.id, c.digest) for c in store.list() if c.tier == "disk"))


def cpu_name() -> str:
    """Vendor and model of this machine's CPU, as Linux reports them (else the architecture)."""
    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    fields: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return " ".join(filter(None, (fields.get("vendor_id"), fields.get("model name")))) or platform.machine()


def platform_of(engine: Engine) -> dict[str, Any]:
    """What of this process's platform decides how the engine's products round."""
    here = {"device": engine.device.type, "torch": torch.__version__,
            "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu": cpu_name(),
            "torch_threads": torch.get_num_threads(), "cpu_kernels": engine.cpu_kernels}
    kernels = native_kernels(engine)
    for kernel in cpu_backend.KERNELS:
        here[kernel] = kernels.get(kernel, "")
    return here


def platform_in(session: SessionRecord) -> dict[str, Any]:
    """The same, as another session record (a live node's) states it."""
    return session.platform(cpu_backend.KERNELS)


def platform_differences(session: SessionRecord, here: dict[str, Any]) -> list[str]:
    """What of the platform the session recorded differs ``here`` (``platform_of``, ``platform_in``):
    each one may round the products differently, so that only the portable verdict is promised
    (empty: the exact one is)."""
    recorded = session.platform(cpu_backend.KERNELS)
    return [f"{key} {recorded[key]!r} when recorded, {value!r} here" for key, value in here.items()
            if recorded[key] != value]


def native_kernels(engine: Engine) -> dict[str, str]:
    """The version of each C kernel the engine runs (none off the CPU backend)."""
    return cpu_backend.versions() if engine.cpu_kernels else {}


def engine_for(session: SessionRecord, device: str = "cpu", capsule_dir: str | None = None,
               capsule_key: bytes | None = None, strict: bool = True, mtp_head: str | None = None) -> Engine:
    """A fresh engine like the recorded one; refuses if its fingerprints come out different,
    and, when ``strict`` (for the exact verdict), if it cannot run the recorded kernels.

    Its disk tier is a new temporary folder, holding copies of the capsules the
    session found at start, taken from ``capsule_dir`` (default: the recorded one).
    ``capsule_key``: the key a session that signed its capsule files ran with (not recorded);
    ``mtp_head``: the MTP head file it ran with (not recorded either; the fingerprint covers it).
    """
    if session.version != VERSION:
        raise InvalidArgument(f"session format version {session.version!r}, this replay reads {VERSION}")
    if session.signed and capsule_key is None:
        raise InvalidArgument("the session signed its capsule files with a key, which is not recorded: "
                              "pass the same key file with --capsule-key-file")
    if session.disk_tier:
        folder = tempfile.mkdtemp(prefix="flashrt-replay-")
        _copy_preloaded(session.preloaded, Path(capsule_dir or session.capsule_dir), Path(folder))
        capsule_dir = folder
    engine = Engine.load(session.model_path, seed=session.seed, mtp_head=mtp_head or None,
                         policy_dims=(session.obs_dim, session.action_dim), device=device,
                         dtype=getattr(torch, session.dtype), max_seq_len=session.max_seq_len,
                         prefill_chunk=session.prefill_chunk, rollback_depth=session.rollback_depth,
                         budgets=session.budget_bytes or None, spill=session.spill, capsule_dir=capsule_dir,
                         capsule_key=capsule_key if session.signed else None, cuda_graphs=session.cuda_graphs,
                         static_shapes=session.fixed_shapes, cpu_kernels=session.cpu_kernels)
    try:
        _check_rebuilt(engine, session, strict)
    except BaseException:
        engine.close()
        raise
    return engine


def _check_rebuilt(engine: Engine, session: SessionRecord, strict: bool) -> None:
    """InvalidArgument when ``engine`` is not the one the session ran on."""
    if strict and engine.cpu_kernels != session.cpu_kernels:   # only True can be refused here
        raise InvalidArgument(f"the session ran on the CPU backend's C kernels (flashrt_ros.runtime.backends.cpu), "
                              f"which are not built here or cannot serve device {engine.device.type}: rebuild the package with "
                              f"a C compiler (colcon build, or pip install .), or replay on a CPU")
    recorded = dict(session.kernels)
    for kernel, version in native_kernels(engine).items():
        if strict and recorded.get(kernel, "") != version:
            raise InvalidArgument(f"the session ran {kernel} kernel {recorded.get(kernel, '')!r}, this build has "
                                  f"{version!r}: their results may round differently")
    for key in ("model_fingerprint", "layout_fingerprint"):
        if getattr(engine, key) != getattr(session, key):
            raise InvalidArgument(f"the rebuilt engine's {key} differs from the recorded one: "
                                  f"different weights or layout ({session.model_path or 'embedded default'}; "
                                  f"a node that served with mtp_head needs the same file: --mtp-head)")
    loaded = {c.id: c.digest for c in engine.capsules.list()}
    for capsule_id, capsule_digest in session.preloaded:
        if loaded.get(capsule_id) != capsule_digest:
            raise InvalidArgument(f"capsule {capsule_id}, which the session started with, did not load "
                                  f"with its recorded digest (see the warnings above)")


def _copy_preloaded(preloaded: tuple[tuple[str, str], ...], source: Path, folder: Path) -> None:
    for capsule_id, _ in preloaded:
        path = path_for(source, capsule_id)
        if not path.is_file():
            raise InvalidArgument(f"the session started with capsule {capsule_id} from {source}, which is not "
                                  f"there now: pass the folder that holds {path.name} with --capsule-dir")
        shutil.copyfile(path, path_for(folder, capsule_id))
