"""ddiloco throttle: rates, the tc commands, and real limits on the veth links of
network namespaces (the learners of ``ddiloco local --netns``), with real
transfers through them; then a local run throttled and crashed from outside."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from broker.redis.server import free_port
from compose.netns import LocalNetwork
from compose.throttle import (
    IFB,
    ThrottleConfig,
    apply,
    burst_bytes,
    clear_commands,
    limits_of,
    parse_rate,
    set_commands,
)
from tests.servers import wait_until

REPO = Path(__file__).resolve().parents[1]
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("tc") is None,
    reason="network namespaces and tc need root and iproute2",
)


def test_rates_in_tc_units() -> None:
    assert parse_rate("10mbit") == 10_000_000
    assert parse_rate("500kbit") == 500_000
    assert parse_rate("2mbps") == 16_000_000
    assert parse_rate(" 1.5Gbit ") == 1_500_000_000
    for bad in ("10", "fast", "10mb", "-1mbit", "1kbit"):
        with pytest.raises(ValueError, match="rate="):
            parse_rate(bad)
    with pytest.raises(ValueError, match="not both"):
        ThrottleConfig(container="a", local="b")


def test_commands_limit_both_ways_and_undo_everything() -> None:
    cmds = [" ".join(c) for c in set_commands("eth0", 2_000_000)]
    tbf = f"tbf rate 2000000bit burst {burst_bytes(2_000_000)} latency 200ms"
    assert f"tc qdisc replace dev eth0 root {tbf}" in cmds  # upload
    assert f"tc qdisc replace dev {IFB} root {tbf}" in cmds  # download, through the ifb
    assert any("mirred egress redirect dev " + IFB in c for c in cmds)
    assert burst_bytes(2_000_000) == 16 * 1024 and burst_bytes(80_000_000) == 200_000
    undo = " ".join(" ".join(c) for c in clear_commands("eth0"))
    assert "del dev eth0 root" in undo and "del dev eth0 ingress" in undo and IFB in undo


def test_limits_read_from_tc_json() -> None:
    up = json.dumps([{"kind": "tbf", "root": True, "options": {"rate": 250000}}])
    assert limits_of(up, "[]") == {"up_bits": 2_000_000, "down_bits": None}
    fq = json.dumps([{"kind": "fq_codel", "root": True, "options": {}}])
    assert limits_of(fq, up) == {"up_bits": None, "down_bits": 2_000_000}


def _serve(address: str, port: int, size: int, results: dict[str, float]) -> threading.Thread:
    """Accept twice: receive ``size`` bytes, then send ``size`` bytes."""
    server = socket.create_server((address, port))

    def run() -> None:
        with server:
            conn, _ = server.accept()
            with conn:
                got = 0
                while got < size:
                    got += len(conn.recv(1 << 16))
                conn.sendall(b"k")
            conn, _ = server.accept()
            with conn:
                started = time.perf_counter()
                conn.sendall(os.urandom(size))
                conn.shutdown(socket.SHUT_WR)
                conn.recv(1)
                results["down_s"] = time.perf_counter() - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


CLIENT = """
import socket, sys, time
host, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with socket.create_connection((host, port), timeout=120) as s:
    t = time.perf_counter(); s.sendall(bytes(size)); s.recv(1); up = time.perf_counter() - t
with socket.create_connection((host, port), timeout=120) as s:
    got = 0
    while True:
        chunk = s.recv(1 << 16)
        if not chunk:
            break
        got += len(chunk)
    s.sendall(b"k")
print(up)
"""


def transfer(net: LocalNetwork, learner: str, size: int) -> dict[str, float]:
    """Seconds to send ``size`` bytes from the learner's namespace and back."""
    port = free_port()
    results: dict[str, float] = {}
    server = _serve(net.host_address, port, size, results)
    client = [sys.executable, "-c", CLIENT, net.host_address, str(port), str(size)]
    out = subprocess.run(
        net.command(learner, client), capture_output=True, text=True, timeout=300, check=True
    )
    server.join(timeout=60)
    return {"up_s": float(out.stdout), "down_s": results["down_s"]}


@needs_root
@pytest.mark.timeout(300)
def test_a_limit_holds_both_ways_and_clears(tmp_path: Path) -> None:
    size, rate = 1_000_000, "4mbit"
    floor_s = size * 8 / parse_rate(rate)
    net = LocalNetwork.create(["learner-0", "learner-1"])
    try:
        net.write(tmp_path)
        cfg = ThrottleConfig(rate=rate, local=str(tmp_path))
        assert transfer(net, "learner-0", size)["up_s"] < floor_s / 4  # unlimited first
        records = apply("set", cfg)
        assert [r["up_bits"] for r in records] == [4_000_000, 4_000_000]
        assert [r["down_bits"] for r in records] == [4_000_000, 4_000_000]
        limited = transfer(net, "learner-0", size)
        print(f"\nthrottled to {rate}: {size} bytes {limited} (floor {floor_s:.2f} s)")
        assert limited["up_s"] >= floor_s and limited["down_s"] >= floor_s
        records = apply("clear", ThrottleConfig(local=str(tmp_path)))
        assert all(r["up_bits"] is None and r["down_bits"] is None for r in records)
        free = transfer(net, "learner-0", size)
        assert free["up_s"] < floor_s / 4 and free["down_s"] < floor_s / 4
    finally:
        net.close()
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"ddl{net.tag}" not in names


@needs_root
@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_local_run_throttled_and_crashed_from_outside(tmp_path: Path) -> None:
    """ddiloco local --netns: ddiloco throttle limits its learners' links, ddiloco
    chaos SIGKILLs one; the launcher counts a chaos kill (not a crash), restarts
    it, and the run finishes; the namespaces are gone afterwards."""
    out = tmp_path / "run"
    local = subprocess.Popen(
        [sys.executable, "-m", "compose.cli", "local", "--netns", "--learners", "2",
         "--steps", "400", "--fragments", "2", "--sync-every", "4", "--overlap", "1",
         "--model-d-model", "64", "--model-n-layer", "2", "--model-n-head", "2",
         "--model-seq-len", "64", "--batch-size", "8", "--restart-s", "1",
         "--eval-every-s", "5", "--no-progress", "--out", str(out)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:

        def stepping() -> bool:
            return (
                all(
                    '"step"' in (out / "learners" / f"learner-{i}.jsonl").read_text()
                    for i in range(2)
                    if (out / "learners" / f"learner-{i}.jsonl").exists()
                )
                and len(list((out / "learners").glob("*.jsonl"))) == 2
            )

        wait_until(stepping, 300, interval_s=0.5, what="both learners training")
        cli = [sys.executable, "-m", "compose.cli"]
        set_out = subprocess.run(
            [*cli, "throttle", "set", "--local", str(out), "--rate", "8mbit"],
            cwd=REPO, capture_output=True, text=True, check=True, timeout=60,
        ).stdout  # fmt: skip
        assert [json.loads(x)["up_bits"] for x in set_out.splitlines()] == [8_000_000] * 2
        chaos = subprocess.run(
            [*cli, "chaos", "--local", str(out), "--target", "learner", "--mtbf-s", "0.5",
             "--max-kills", "1", "--seed", "3"],
            cwd=REPO, capture_output=True, text=True, check=True, timeout=120,
        ).stdout  # fmt: skip
        kills = [json.loads(x) for x in chaos.splitlines() if '"kill"' in x]
        assert len(kills) == 1 and kills[0]["role"] == "learner"
        output, _ = local.communicate(timeout=500)
        assert local.returncode == 0, output
    finally:
        if local.poll() is None:
            local.kill()
            local.wait()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["learner_kills"] == 1 and summary["learner_restarts"] == 1
    events = [json.loads(x) for x in (out / "launcher.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["event"] == "process_crash"]
    killed = [e for e in events if e["event"] == "process_kill" and e["reason"] == "chaos"]
    assert [e["process"] for e in killed] == [kills[0]["process"]]
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    netns = json.loads((out / "netns.json").read_text())
    assert not any(v["netns"] in names for v in netns.values())


@needs_root
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_data_parallel_ranks_meet_through_their_throttled_links(tmp_path: Path) -> None:
    """ddiloco local --netns --mode ddp --link-rate: the ranks' all-reduce crosses
    their own limited links, and the summary counts what each interface sent: a
    two-rank ring all-reduce sends each rank about the model's fp32 bytes per step."""
    from learner.model import GPT, ModelConfig

    out, steps = tmp_path / "run", 10
    done = subprocess.run(
        [sys.executable, "-m", "compose.cli", "local", "--netns", "--link-rate", "50mbit",
         "--mode", "ddp", "--learners", "2", "--steps", str(steps), "--model-d-model", "64",
         "--model-n-layer", "2", "--model-n-head", "2", "--model-seq-len", "64",
         "--batch-size", "8", "--no-progress", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    model = GPT(ModelConfig(d_model=64, n_layer=2, n_head=2, seq_len=64))
    model_bytes = 4 * sum(p.numel() for p in model.parameters())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps_per_learner"] == steps
    links = summary["link_bytes"]
    assert sorted(links) == ["learner-0", "learner-1"]
    for counts in links.values():
        # Every step's all-reduce, plus the rendezvous, the start's broadcast and headers.
        assert steps * model_bytes <= counts["tx_bytes"] <= 3 * (steps + 1) * model_bytes
        assert steps * model_bytes <= counts["rx_bytes"] <= 3 * (steps + 1) * model_bytes
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    netns = json.loads((out / "netns.json").read_text())
    assert not any(v["netns"] in names for v in netns.values())


def test_link_rate_needs_namespaces() -> None:
    from compose.local import LocalConfig

    with pytest.raises(ValueError, match="add --netns"):
        LocalConfig(link_rate="10mbit")
    with pytest.raises(ValueError, match="rate="):
        LocalConfig(netns=True, link_rate="fast")


@needs_root
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_terminated_local_run_stops_its_processes_and_removes_its_namespaces(
    tmp_path: Path,
) -> None:
    """SIGTERM to ``ddiloco local`` (a timeout, a benchmark stopping it) must not
    leave learners training on or namespaces behind."""
    out = tmp_path / "run"
    local = subprocess.Popen(
        [sys.executable, "-m", "compose.cli", "local", "--netns", "--mode", "ddp",
         "--learners", "2", "--steps", "100000", "--model-d-model", "64",
         "--model-n-layer", "2", "--model-n-head", "2", "--model-seq-len", "64",
         "--batch-size", "8", "--no-progress", "--out", str(out)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_until(
            lambda: '"step"' in _read(out / "learners" / "learner-0.jsonl"),
            240, interval_s=0.5, what="the ranks training",
        )  # fmt: skip
        pids = json.loads((out / "processes.json").read_text()).values()
        local.terminate()
        local.wait(timeout=120)
    finally:
        if local.poll() is None:
            local.kill()
            local.wait()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    netns = json.loads((out / "netns.json").read_text())
    assert not any(v["netns"] in names for v in netns.values())


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""
