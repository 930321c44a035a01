"""Writes tests/vectors/snapshots/*.jsonl: one engine-snapshot exchange per open design (see its README).

No design is merged upstream and none has code to capture from: each exchange follows the pull
request's description as docs/protocol.md section 4 gives it, encoded by the simulator's
``snapshot_reply`` over the engine's own batch payloads (vLLM 0.33.0, SGLang 0.5.23).
Run from the repository root: ``.venv/bin/python -m tools.snapshot_vectors``.
"""

import json
from pathlib import Path

import msgspec

from bridge.simulator import PROFILES, EngineCache, _fill, encode_batch, snapshot_reply
from bridge.snapshot import REQUEST
from tests.support.vectors import plain

P = PROFILES["vllm-0.33.0"]
UUID = bytes.fromhex("5f0c6a1e3b7d4c2a9e410d8b2f6a7c19")
TOPIC = b"kv-events"
T0 = 1700000000.0


def stored(hashes, parent, medium="GPU"):
    tokens = list(range(16000 + 16 * hashes[0] % 1000, 16000 + 16 * hashes[0] % 1000 + 16 * len(hashes)))
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 16,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


def removed(hashes, medium="GPU"):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": 0}


H = [0x08B37C993AF4B208, 0xA6EAF652BA3F2E1D, 0x4522700C3989AA32, 0x9E3779B97F4A7C15, 0x1234567890ABCDEF, 0x0FEDCBA987654321]
# Published before the bridge met the engine (seqs 0-4), then live seqs 5-8; the snapshot is cut at 6.
HISTORY = {
    0: [stored([H[0], H[1]], None)],
    1: [stored([H[1]], None), stored([H[1]], None, "CPU")],  # a second GPU copy, and a CPU copy
    2: [stored([H[2]], H[1])],
    3: [removed([H[0]])],
    4: [stored([H[3]], H[2])],
    5: [stored([H[4]], H[3]), removed([H[2]])],
    6: [removed([H[1]])],
    7: [stored([H[5]], H[4])],
    8: [removed([H[3]]), stored([H[0]], None)],
}
CUT = 6
decoder = msgspec.msgpack.Decoder()


def row(design, kind, frames, **extra):
    out = {
        "producer": "vllm" if design.startswith("vllm") else "sglang",
        "version": "pr" + design.split("-")[1],
        "kind": kind,
        "dp_rank": 0,
        "frames": [f.hex() for f in frames],
    }
    out.update(extra)
    return out


for design in ("vllm-57789", "vllm-50134", "sglang-34407"):
    P = PROFILES["sglang-0.5.23" if design.startswith("sglang") else "vllm-0.33.0"]
    history = {s: [_fill(P, e["type"], e) for e in evs] for s, evs in HISTORY.items()}
    cache = EngineCache()
    for s in range(CUT + 1):
        cache.apply(history[s])
    at_seed = EngineCache()
    for s in range(CUT + 2):
        at_seed.apply(history[s])
    at_end = EngineCache()
    for s in range(CUT + 3):
        at_end.apply(history[s])
    uuid = UUID if design != "sglang-34407" else b""
    rows = []
    for s in (5, 6):
        payload = encode_batch(P, T0 + s, history[s], 0)
        rows.append(row(design, "live", [TOPIC, s.to_bytes(8, "big") + uuid, payload], decoded=plain(decoder.decode(payload))))
    rows.append(row(design, "snapshot_request", [b"", REQUEST], socket="replay" if design == "vllm-50134" else "snapshot"))
    messages = snapshot_reply(design, P, cache, cut=CUT, ts=T0 + CUT, instance=uuid, topic=TOPIC, epoch=0)
    for m in messages:
        frames = m[1:]  # after the empty delimiter
        rows.append(row(design, "snapshot_reply", frames))
    for s in (7, 8):
        payload = encode_batch(P, T0 + s, history[s], 0)
        rows.append(row(design, "live", [TOPIC, s.to_bytes(8, "big") + uuid, payload], decoded=plain(decoder.decode(payload))))
    blocks = sorted([m, g, format(h, "016x"), n] for (h, m, g), n in at_seed.counts.items())
    rows.append(
        row(
            design,
            "expected_state",
            [],
            cut=CUT,
            seeded_at=CUT + 1,
            blocks_at_cut=sorted([m, g, format(h, "016x"), n] for (h, m, g), n in cache.counts.items()),
            blocks_at_seed=blocks,
            blocks_at_end=sorted([m, g, format(h, "016x"), n] for (h, m, g), n in at_end.counts.items()),
        )
    )
    out = Path("tests/vectors/snapshots") / f"{design}.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(out, len(rows), out.stat().st_size)
