"""Fuzz the wire decoder and the syncer's message handling with hostile input.

    python -m benchmarks.fuzz [--inputs 100000] [--seed 0] [--out benchmarks/results/fuzz.json]

Each input is one frame as it could come off the network: random bytes, a
valid frame with bytes flipped, cut or appended, or a valid checksum around a
header with hostile fields (wrong types, huge or negative numbers, unknown
codecs, lists where ids go, payloads that do not match). Every frame goes
through ``broker.wire.messages.decode``; every one that decodes goes, as a transport
would hand it over, into a real :class:`syncer.service.Syncer`'s ``handle``.
The only acceptable outcomes: ``WireError`` (counted by reason), or a message
the syncer accepts, refuses by reason, or ignores, with its global weights
finite afterwards. Anything else is a crash, recorded with the input that
caused it. Memory is bounded: the peak traced allocation is reported.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import struct
import sys
import tempfile
import time
import tracemalloc
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import torch

from broker.fragments import FragmentPlan, ParamSpec
from broker.run.initial_model import write_initial_model
from broker.run.settings import RunSettings
from broker.transport import Inbound, SyncerTransport, TransportStats
from broker.wire import messages as wire
from broker.wire.codecs import Codec
from broker.wire.messages import Delta, GlobalFragment, Heartbeat, WireError
from syncer.config import SyncerConfig
from syncer.service import Syncer

RUN = "fuzz"
NUMEL = 96  # two fragments of a small plan


class _Collect(SyncerTransport):
    """Stands in for a transport: the fuzzer hands frames to the syncer itself."""

    def __init__(self) -> None:
        self.stats = TransportStats()
        self.published = 0
        self.refused = 0

    def receive(self, timeout_s: float) -> list[Inbound]:
        return []

    def ack(self, items: list[Inbound]) -> None:
        pass

    def existing_globals(self, fragments: list[int]) -> dict[int, tuple[int, int]]:
        return {}

    def refuse(self, item: Inbound, reason: str) -> None:
        self.refused += 1

    def publish(
        self, fragment: GlobalFragment, snapshot: GlobalFragment | None = None, resume: bytes = b""
    ) -> None:
        self.published += 1

    def announce(self, fragment: GlobalFragment, resume: bytes = b"") -> None:
        pass

    def close(self) -> None:
        pass


def _syncer(folder: Path) -> Syncer:
    """A real syncer whose roster admits the fuzzer's 24 learner ids, so that hostile
    deltas reach rounds, merges and the outer step, not only the roster's door."""
    plan = FragmentPlan.build(
        [ParamSpec("a", (48,), "float32"), ParamSpec("b", (6, 8), "float32")], 2, sync_every=4
    )
    initial = folder / "initial.safetensors"
    write_initial_model(initial, plan, {"a": torch.zeros(48), "b": torch.ones(6, 8)})
    run = RunSettings(
        run_id=RUN, learners=24, quorum=1, fragments=2, sync_every=4, overlap=1,
        initial_model=str(initial),
    )  # fmt: skip
    cfg = SyncerConfig(run=run, checkpoint_dir=str(folder / "checkpoint"))
    return Syncer(cfg, transport=_Collect())


def _valid_messages(plan_hash: str) -> list[wire.Message]:
    payload = Codec().encode(torch.full((48,), 0.01))
    return [
        Delta(
            run_id=RUN, learner_id="l0", incarnation=1, seq=1, fragment=0, plan_hash=plan_hash,
            base_version=0, step=4, c_steps=4, c_tokens=64, sent_at=time.time(),
            codec=Codec(), numel=48, payload=payload,
        ),
        Heartbeat(run_id=RUN, learner_id="l0", incarnation=1, step=4, tokens=64,
                  step_time_s=0.1, sent_at=time.time()),
        wire.SnapshotRequest(run_id=RUN, learner_id="l0", fragments=[0, 1]),
        wire.Ack(run_id=RUN, learner_id="l0", incarnation=1, seqs=[1, 2]),
    ]  # fmt: skip


_HOSTILE_VALUES: list[Any] = [
    None, True, -1, 0, 1, 2**31, 2**62, 2**63 - 1, 2**64 - 1, -(2**63), 1e308, float("nan"),
    float("inf"), -0.0, "", "x" * 65, "a/b", "int4+zstd@8", "int9", "fp32+gzip", "fp32@7",
    [], [0] * 5000, [1, "x"], {}, {"k": 1}, b"\x00" * 8, "0123456789abcdef", "ddiloco",
]  # fmt: skip


def _frame(header: Any, payload: bytes) -> bytes:
    head = msgpack.packb(header, use_bin_type=True)
    body = wire.MAGIC + struct.pack("<II", len(head), len(payload)) + head + payload
    return body + struct.pack("<I", zlib.crc32(body))


def _header_of(msg: wire.Message) -> tuple[dict[str, Any], bytes]:
    frame = wire.encode(msg)
    head_len, payload_len = struct.unpack_from("<II", frame, 4)
    header = msgpack.unpackb(frame[12 : 12 + head_len], raw=False)
    return header, frame[12 + head_len : 12 + head_len + payload_len]


def _well_formed_hostile(rng: random.Random, valid: list[wire.Message]) -> bytes:
    """A frame that decodes, with values chosen to hurt: what a buggy or malicious
    learner that speaks the format sends (the syncer's own checks must hold)."""
    template = valid[0] if rng.random() < 0.8 else valid[1]
    fields = dict(template.__dict__)
    big = [0, 1, 2, 7, 2**20, 2**40, 2**62, 2**63 - 1]
    for name in ("incarnation", "seq", "base_version", "step", "c_steps", "c_tokens", "tokens"):
        if name in fields and rng.random() < 0.5:
            fields[name] = rng.choice(big) if rng.random() < 0.5 else rng.randrange(0, 64)
    if "fragment" in fields and rng.random() < 0.3:
        fields["fragment"] = rng.choice([0, 1, 2, 2**31])
    fields["learner_id"] = f"l{rng.randrange(24)}"
    if "step_time_s" in fields:
        fields["step_time_s"] = rng.choice([0.0, 1e-9, 0.1, 1e9])
    if "payload" in fields:
        numel = rng.choice([48, 48, 48, 47, 96, 0])
        values = torch.randn(numel, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
        scale = rng.choice([1e-3, 1.0, 1e3, 1e30, 3e38])
        values = values * scale
        if numel and rng.random() < 0.2:
            values[rng.randrange(numel)] = rng.choice([float("nan"), float("inf")])
        codec = rng.choice([Codec(), Codec("bf16"), Codec("int8"), Codec("int4", "zstd")])
        fields.update(codec=codec, numel=numel, payload=codec.encode(values))
    return wire.encode(type(template)(**fields), max_payload_bytes=1 << 20)


def make_input(rng: random.Random, valid: list[wire.Message]) -> bytes:
    """One hostile frame."""
    kind = rng.randrange(8)
    if kind >= 6:
        return _well_formed_hostile(rng, valid)
    base = wire.encode(rng.choice(valid))
    if kind == 0:  # noise, sometimes behind a valid prefix
        noise = rng.randbytes(rng.randrange(0, 512))
        return (base[:12] + noise) if rng.random() < 0.5 else noise
    if kind == 1:  # flipped bytes
        data = bytearray(base)
        for _ in range(rng.randrange(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return bytes(data)
    if kind == 2:  # cut or extended
        cut = rng.randrange(len(base))
        return base[:cut] if rng.random() < 0.5 else base + rng.randbytes(rng.randrange(1, 64))
    # A valid checksum around a hostile header: what an attacker who read the
    # format would send.
    header, payload = _header_of(rng.choice(valid))
    for _ in range(rng.randrange(1, 4)):
        field = rng.choice(list(header))
        header[field] = rng.choice(_HOSTILE_VALUES)
    if kind == 4 and rng.random() < 0.5:
        header[rng.choice(["extra", "v2", "payload"])] = 1
    if kind == 5:  # a payload that does not match its header
        payload = rng.choice([b"", payload[: len(payload) // 2], payload * 2, rng.randbytes(192)])
    return _frame(header, payload)


def fuzz(inputs: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()
    crashes: list[dict[str, str]] = []
    with tempfile.TemporaryDirectory() as folder:
        syncer = _syncer(Path(folder))
        valid = _valid_messages(syncer.plan.plan_hash)
        tracemalloc.start()
        started = time.perf_counter()
        for _ in range(inputs):
            data = make_input(rng, valid)
            try:
                msg = wire.decode(data, max_payload_bytes=1 << 20)
            except WireError as e:
                outcomes[f"wire:{e.reason}"] += 1
                continue
            except Exception as e:  # the decoder must raise nothing else
                crashes.append({"where": "decode", "error": repr(e), "input": data.hex()})
                continue
            if not isinstance(msg, (Delta, Heartbeat)):
                outcomes[f"ignored:{msg.KIND}"] += 1  # not for the syncer's event loop
                continue
            before = (
                sum(syncer.metrics.rejected.values())
                + syncer.metrics.duplicates
                + syncer.metrics.deltas_applied
            )
            try:
                syncer.handle([Inbound(msg, token=None)])
                syncer.drain()  # close what the input opened: the merge runs too
            except Exception as e:
                crashes.append({"where": "syncer", "error": repr(e), "input": data.hex()})
                continue
            after = (
                sum(syncer.metrics.rejected.values())
                + syncer.metrics.duplicates
                + syncer.metrics.deltas_applied
            )
            outcomes["syncer:" + ("handled" if after > before else "heartbeat_or_held")] += 1
            if not all(torch.isfinite(s.weights).all() for s in syncer.states.values()):
                crashes.append(
                    {"where": "state", "error": "non-finite global", "input": data.hex()}
                )
        seconds = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rejected = dict(syncer.metrics.rejected)
        applied = syncer.metrics.deltas_applied
    return {
        "benchmark": "fuzz",
        "inputs": inputs,
        "seed": seed,
        "crashes": len(crashes),
        "first_crashes": crashes[:10],
        "outcomes": dict(sorted(outcomes.items())),
        "syncer_rejected_by_reason": rejected,
        "syncer_deltas_applied": applied,
        "inputs_per_s": round(inputs / seconds, 1),
        "peak_traced_bytes": peak,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--inputs", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/fuzz.json", help="the results JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR)  # refusals are expected here, by the thousand
    result = fuzz(args.inputs, args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    summary = {k: v for k, v in result.items() if k not in ("first_crashes", "outcomes")}
    print(json.dumps(summary, indent=2))
    return 1 if result["crashes"] else 0


if __name__ == "__main__":
    sys.exit(main())
