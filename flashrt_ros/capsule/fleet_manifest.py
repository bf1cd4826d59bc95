"""The fleet manifest: one capsule in the fleet tier, signed, naming its chunks in order.

A manifest is canonical JSON (sorted keys, no spaces), so the same capsule published twice,
by any node, is the same bytes:

- ``format``, ``version``;
- ``capsule``: the capsule's header as its disk file carries it (``disk_capsules.header_for``):
  id, parent, position, creation time, model and layout fingerprints, capsule digest, history
  hash, region table, ranges, boundary log; with tier "fleet", no name (names are keys of their
  own, ``name_value``), unpinned, and ``nbytes`` its whole data;
- ``chunking``: {"rows", "bytes"} (``fleet_chunks.Chunking``);
- ``chunks``: [digest, length] per chunk, in order;
- ``signature``: HMAC-SHA256 with the capsule key over all of the above (``signing``).

A manifest is read only through ``decode``: the signature first (nothing unsigned is looked
at further), then the fingerprints, then every field a capsule file's header is checked for,
then the chunk list against the cut the layout, position and chunking give.
"""
from __future__ import annotations

import hashlib
import hmac
import json
from typing import NamedTuple

from . import signing
from .disk_capsules import header_for, info_from_header, log_from_header, merged, most_header_chars
from .errors import CorruptCapsule, FingerprintMismatch, UntrustedCapsule
from .fleet_chunks import DIGEST_CHARS, Chunking, Span, length, wire_chunks
from .fleet_config import MAX_CHUNK_BYTES, MAX_CHUNK_ROWS, MIN_CHUNK_BYTES
from .info import CapsuleInfo, is_capsule_id
from .layout import Layout

FORMAT = "flashrt-fleet-capsule"
VERSION = 2   # a reader refuses any other: the cut (``fleet_chunks``) is part of the format
_HEX = frozenset("0123456789abcdef")
_CHARS_PER_CHUNK = 96   # one ["<64 hex>", <length>] entry, with room to spare


class Manifest(NamedTuple):
    """A manifest as decoded and checked. ``info``: tier "fleet", no name."""

    info: CapsuleInfo
    log: tuple
    chunking: Chunking
    digests: tuple[str, ...]
    spans: list[Span]


def encode(info: CapsuleInfo, log_runs: tuple, layout: Layout, chunking: Chunking,
           digests: list[str], key: bytes) -> bytes:
    """The signed manifest of a capsule (``info``, digest final) cut by ``chunking`` into
    chunks named ``digests``."""
    position = info.position
    spans = wire_chunks(layout, position, chunking)
    if len(spans) != len(digests):
        raise ValueError(f"{len(digests)} chunk digests for a cut into {len(spans)} chunks")
    whole = info._replace(tier="fleet", name="", pinned=False, nbytes=layout.ranges_bytes(position))
    body = {"format": FORMAT, "version": VERSION,
            "capsule": header_for(whole, layout.ranges(position), log_runs),
            "chunking": {"rows": chunking.rows, "bytes": chunking.most_bytes},
            "chunks": [[d, length(s)] for d, s in zip(digests, spans)]}
    body[signing.FIELD] = signing.sign(key, body)
    return signing.canonical(body, ())


def most_bytes(layout: Layout) -> int:
    """A bound on a manifest for ``layout``: its header, and an entry per chunk of the finest cut."""
    chunks = layout.nbytes // MIN_CHUNK_BYTES + layout.max_position * len(layout.rows) + 2
    return most_header_chars(layout) + 256 + _CHARS_PER_CHUNK * chunks


def decode(raw: bytes, key: bytes, layout: Layout, kinds: frozenset[str], model_fingerprint: str,
           capsule_id: str) -> Manifest:
    """The manifest stored under ``capsule_id``'s key, checked for this engine. Raises
    UntrustedCapsule (unsigned, or signed with another key), FingerprintMismatch (another
    model or layout) or CorruptCapsule (anything else that does not hold)."""
    where = f"fleet capsule {capsule_id}"
    if len(raw) > most_bytes(layout):
        raise CorruptCapsule(f"{where}: a manifest of {len(raw)} bytes, more than one of this engine's "
                             f"capsules takes ({most_bytes(layout)})")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CorruptCapsule(f"{where}: the manifest is not JSON ({type(exc).__name__})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("version") != VERSION:
        raise CorruptCapsule(f"{where}: not a fleet manifest of version {VERSION}")
    signing.check(key, body, where)
    header = body.get("capsule")
    if not isinstance(header, dict):
        raise CorruptCapsule(f"{where}: the manifest has no capsule header")
    if header.get("model_fingerprint") != model_fingerprint:
        raise FingerprintMismatch(f"{where} was taken from model {shown_field(header, 'model_fingerprint')}, "
                                  f"this engine runs {model_fingerprint}")
    if header.get("layout_fingerprint") != layout.fingerprint:
        raise FingerprintMismatch(f"{where} has arena layout {shown_field(header, 'layout_fingerprint')}, this "
                                  f"engine has {layout.fingerprint} (other max_seq_len, dtype or model shape)")
    info = info_from_header(header, layout.table)._replace(tier="fleet")
    if info.id != capsule_id or not is_capsule_id(info.id):
        raise CorruptCapsule(f"{where}: the manifest describes capsule {info.id!r:.40}")
    position = info.position
    if position > layout.max_position:
        raise CorruptCapsule(f"{where}: position {position} is past this arena's {layout.max_position} rows")
    log_runs = log_from_header(header, position, kinds)
    ranges = header.get("ranges")
    if not isinstance(ranges, list) or not all(isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r)
                                               for r in ranges) \
            or merged([tuple(r) for r in ranges]) != layout.ranges(position):
        raise CorruptCapsule(f"{where}: holds other arena ranges than a capsule at position {position}")
    if info.nbytes != layout.ranges_bytes(position):
        raise CorruptCapsule(f"{where}: {info.nbytes} bytes, a capsule at position {position} has "
                             f"{layout.ranges_bytes(position)}")
    chunking = _chunking(body.get("chunking"), where)
    spans = wire_chunks(layout, position, chunking)
    digests = _chunk_list(body.get("chunks"), spans, where)
    return Manifest(info, log_runs, chunking, digests, spans)


def shown_field(header: dict, name: str) -> str:
    return repr(str(header.get(name))[:40])


def _chunking(value: object, where: str) -> Chunking:
    if not isinstance(value, dict) or set(value) != {"rows", "bytes"} \
            or not all(type(v) is int for v in value.values()) \
            or not 1 <= value["rows"] <= MAX_CHUNK_ROWS \
            or not MIN_CHUNK_BYTES <= value["bytes"] <= MAX_CHUNK_BYTES:
        raise CorruptCapsule(f"{where}: the manifest's chunking {str(value)[:80]} is out of range")
    return Chunking(value["rows"], value["bytes"])


def _chunk_list(value: object, spans: list[Span], where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) != len(spans):
        raise CorruptCapsule(f"{where}: the manifest lists {len(value) if isinstance(value, list) else 'no'} "
                             f"chunks, its capsule is cut into {len(spans)}")
    digests = []
    for i, (entry, chunk) in enumerate(zip(value, spans)):
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
                and len(entry[0]) == DIGEST_CHARS and set(entry[0]) <= _HEX
                and type(entry[1]) is int and entry[1] == length(chunk)):
            raise CorruptCapsule(f"{where}: chunk {i} of the manifest, {str(entry)[:100]}, is not "
                                 f"[digest, {length(chunk)}]")
        digests.append(entry[0])
    return tuple(digests)


def read_signed(raw: bytes, key: bytes, capsule_id: str) -> tuple[CapsuleInfo, list[str]]:
    """A manifest of any model checked for its signature and its header alone (what a list
    shows, what a hold extends): (info, chunk digests in order). Restoring it takes ``decode``."""
    where = f"fleet capsule {capsule_id}"
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise CorruptCapsule(f"{where}: the manifest is not JSON") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("version") != VERSION:
        raise CorruptCapsule(f"{where}: not a fleet manifest of version {VERSION}")
    signing.check(key, body, where)
    header, digests = body.get("capsule"), chunk_digests(raw)
    if not isinstance(header, dict) or not isinstance(header.get("region_table"), list) or digests is None:
        raise CorruptCapsule(f"{where}: the manifest lacks its header or its chunk list")
    info = info_from_header(header, tuple(header["region_table"]))._replace(tier="fleet")
    if info.id != capsule_id:
        raise CorruptCapsule(f"{where}: the manifest describes capsule {info.id!r:.40}")
    return info, digests


def chunk_digests(raw: bytes) -> list[str] | None:
    """The chunks a manifest names, read without any check (for collection, which must
    keep whatever any manifest under the prefix names); None if it names none readably."""
    try:
        chunks = json.loads(raw).get("chunks")
        return [entry[0] for entry in chunks if isinstance(entry[0], str)]
    except (ValueError, RecursionError, AttributeError, TypeError, IndexError, KeyError):
        return None


# ---- names --------------------------------------------------------------------------------------
def _name_tag(key: bytes, name: str, capsule_id: str) -> str:
    return hmac.new(key, f"{FORMAT}\0name\0{name}\0{capsule_id}".encode(), hashlib.sha256).hexdigest()


def name_value(key: bytes, name: str, capsule_id: str) -> str:
    """What a name's key holds: the capsule id, and a signature binding the name to it."""
    return f"{capsule_id} {_name_tag(key, name, capsule_id)}"


def name_target(key: bytes, name: str, value: bytes) -> str:
    """The capsule id a name's key points at; UntrustedCapsule unless signed with ``key``."""
    text = value.decode("ascii", "replace")
    capsule_id, _, tag = text.partition(" ")
    if not is_capsule_id(capsule_id) or not hmac.compare_digest(tag, _name_tag(key, name, capsule_id)):
        raise UntrustedCapsule(f"fleet name {name!r}: its entry is not signed with this engine's capsule key")
    return capsule_id
