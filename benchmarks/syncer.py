"""Syncer throughput: decode, rebase, aggregate and outer step of one fragment,
single-threaded, against a single-threaded memory copy of the same fp32 bytes.

    python -m benchmarks.syncer [--smoke | --quick] [--out benchmarks/results/syncer.json]

One round of M deltas goes through the syncer's own per-fragment code
(:class:`syncer.fragment_state.FragmentState`), as the service runs it: each
delta is decoded from its wire codec (an int2 one into its packed codes and
scales, others into the fragment's buffers), offered (shape, finiteness, the
bounds on its figures, the rebase against its base version, its norm for the
quarantine), then the round closes (quarantine, weights, rebasing, the
weighted mean, the Nesterov outer step, and the canonical encoding of the new
global; with int2 globals, the default, in one compiled pass:
:mod:`syncer.kernels`). ``aggregate_gbps`` is the fp32 bytes of deltas processed per second
over all of it; ``memcpy_gbps`` is ``torch`` copying the same fp32 bytes of
one delta from one buffer to another, timed twice before each round; ``ratio``
is the first over the second. Each figure is the best of ``repeats`` rounds (and
of their copies). One torch thread throughout.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from broker.errors import MeasurementError
from broker.run.settings import RunSettings
from broker.wire.codecs import Codec
from broker.wire.messages import Delta
from syncer.config import OuterConfig
from syncer.fragment_state import FragmentState

LEARNERS = 4  # M deltas per round, all on the current version
C_STEPS, C_TOKENS = 12, 12 * 4096  # what a delta reports (one H of steps)
# (fragment sizes in MiB, repeats)
MODES: dict[str, tuple[tuple[int, ...], int]] = {
    "smoke": ((4,), 2),
    "quick": ((64,), 3),
    "full": ((64, 256), 5),
}
# The default delta codec first, then the denser ones.
DELTA_CODECS = tuple(dict.fromkeys((RunSettings().delta_codec.name, "int8", "int4")))


def _settings(global_codec: Codec) -> tuple[OuterConfig, RunSettings]:
    """The syncer's defaults, with LEARNERS learners and ``global_codec``."""
    run = RunSettings(learners=LEARNERS, quorum=LEARNERS, global_codec=global_codec)
    return OuterConfig(max_tokens_per_step=1 << 20), run


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def one_round(
    state: FragmentState, payloads: list[bytes], delta_codec: Codec, index: int
) -> dict[str, float]:
    """Seconds per stage for round ``index`` of ``state``: one delta per payload,
    every learner on the current version."""
    times = {"decode_s": 0.0, "offer_s": 0.0, "close_s": 0.0}
    wall_s = 10.0 * (index + 1)
    for m, payload in enumerate(payloads):
        delta = Delta(
            run_id="bench",
            learner_id=f"learner-{m}",
            incarnation=1,
            seq=index + 1,
            fragment=0,
            base_version=state.version,
            c_tokens=C_TOKENS,
            c_steps=C_STEPS,
            numel=state.numel,
            step=C_STEPS * (index + 1),
            codec=delta_codec,
            payload=payload,
        )
        start = time.perf_counter()
        tensor = state.decode(delta)
        times["decode_s"] += time.perf_counter() - start
        start = time.perf_counter()
        status = state.offer(delta, tensor, None, 0.0, wall_s=wall_s, step_s=None)
        times["offer_s"] += time.perf_counter() - start
        if status != "accepted":
            raise MeasurementError(f"the benchmark's delta was not accepted: {status}")
    start = time.perf_counter()
    result = state.close(wall_s=wall_s + 1.0)
    times["close_s"] = time.perf_counter() - start
    if result.included != len(payloads):
        raise MeasurementError(f"{result.included} of {len(payloads)} deltas merged")
    times["total_s"] = times["decode_s"] + times["offer_s"] + times["close_s"]
    return times


def measure(mib: int, delta_codec: Codec, global_codec: Codec, repeats: int) -> dict[str, Any]:
    """The best of ``repeats`` rounds of one fragment, after the rounds that
    allocate its buffers, which a running syncer does once: the first (the
    momentum, the buffers deltas decode into) and, until the versions kept
    (``staleness``) are all its own, each round's new version. Later rounds
    write into the memory of versions no longer kept."""
    numel = mib * 2**20 // 4
    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(numel, generator=gen)
    outer, run = _settings(global_codec)
    state = FragmentState(0, weights, outer, run, published_s=0.0)
    payloads = [
        delta_codec.encode(1e-3 * torch.randn(numel, generator=gen)) for _ in range(LEARNERS)
    ]
    warm_up = outer.staleness + 1
    for i in range(warm_up):
        one_round(state, payloads, delta_codec, i)
    # The copies are timed between the rounds, so that both see the machine as
    # it is then (memory bandwidth here moves by a quarter from minute to minute).
    source, target = torch.randn(numel), torch.empty(numel)
    rounds, copies = [], []
    for i in range(warm_up, warm_up + repeats):
        copies += [_timed(lambda: target.copy_(source)) for _ in range(2)]
        rounds.append(one_round(state, payloads, delta_codec, i))
    best = min(rounds, key=lambda r: r["total_s"])
    delta_bytes = LEARNERS * numel * 4
    copy = numel * 4 / min(copies) / 1e9
    gbps = delta_bytes / best["total_s"] / 1e9
    return {
        "fragment_bytes": numel * 4,
        "learners": LEARNERS,
        "delta_codec": delta_codec.name,
        "global_codec": global_codec.name,
        **{k: round(v, 4) for k, v in best.items()},
        "aggregate_gbps": round(gbps, 3),
        "memcpy_gbps": round(copy, 3),
        "ratio": round(gbps / copy, 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out",
        default="benchmarks/results/syncer.json",
        help="the results JSON; its PNG is written beside it",
    )
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--smoke", action="store_true", help="CI: 4 MB fragments")
    which.add_argument("--quick", action="store_true", help="64 MB fragments, 3 rounds each")
    ap.add_argument(
        "--global-codec",
        default=RunSettings().global_codec.name,
        help="the codec of published globals (default: the run's)",
    )
    args = ap.parse_args(argv)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    sizes, repeats = MODES[mode]
    torch.set_num_threads(1)
    global_codec = Codec.parse(args.global_codec)
    results = []
    for mib in sizes:
        for name in DELTA_CODECS:
            row = measure(mib, Codec.parse(name), global_codec, repeats)
            results.append(row)
            print(
                f"{mib:4d} MiB {name:5s} decode {row['decode_s']:.3f}s offer {row['offer_s']:.3f}s "
                f"close {row['close_s']:.3f}s: {row['aggregate_gbps']:.2f} GB/s, "
                f"memcpy {row['memcpy_gbps']:.2f} GB/s, ratio {row['ratio']:.3f}",
                flush=True,
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "mode": mode,
        "torch_threads": 1,
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ratio_target": 0.25,
        "results": results,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    _plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['fragment_bytes'] / 2**20:.0f} MB\n{r['delta_codec']}" for r in results]
    fig, ax = plt.subplots(figsize=(1.6 * len(results) + 2, 4))
    bottom = [0.0] * len(results)
    for stage in ("decode_s", "offer_s", "close_s"):
        values = [r[stage] for r in results]
        ax.bar(labels, values, bottom=bottom, label=stage.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for i, r in enumerate(results):
        ax.text(i, bottom[i], f"{r['ratio']:.2f}x memcpy", ha="center", va="bottom")
    ax.set_ylabel(f"seconds per round of {LEARNERS} deltas (one thread)")
    ax.set_title("Syncer: decode, offer (rebase, checks), close (aggregate, outer step)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
