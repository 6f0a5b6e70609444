"""The master's HTTP endpoints, ``shoal status`` and ``Communicator.stats()`` against a live run of
peer processes; the status page in headless Chromium, its screenshot checked for the ring and the
peer list."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
from conftest import clean_env, worker_argv

import shoal

PEERS, ROUNDS, HEARTBEAT = 3, 25, 1.0
# The peer that computes longer before each all-reduce, and by how much: the others wait for it.
SLOW, SLOW_S = 2, 0.05
# The run's one group: any but 0, so that nothing counts on the default.
GROUP = 3
# The page's colours of a ring member and of an accepted peer's mark in the list (status.html).
RING_RGB, ACCEPTED_RGB = (0xE6, 0x55, 0x0D), (0x31, 0xA3, 0x54)


class Run:
    def __init__(self, master: shoal.Master, status: dict, procs: list[subprocess.Popen], stop: Path, ids: list[int]):
        self.master, self.status, self.procs, self.stop, self.ids = master, status, procs, stop, ids
        self.http = master.http_address
        assert self.http is not None
        self.results: list[dict] = []

    def finish(self) -> list[dict]:
        """Lets the peers leave; their results, ``stats()`` included."""
        if not self.results:
            self.stop.touch()
            for p in self.procs:
                out, err = p.communicate(timeout=60)
                assert p.returncode == 0, err
                self.results.append(json.loads(out.strip().splitlines()[-1]))
        return self.results

    def get(self, path: str) -> tuple[int, str, str]:
        try:
            with urllib.request.urlopen(f"http://{self.http}{path}", timeout=10) as r:
                return r.status, r.headers["Content-Type"], r.read().decode()
        except urllib.error.HTTPError as e:
            with e:
                return e.code, e.headers["Content-Type"], e.read().decode()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """Three peers that measured their links, synced a state and all-reduced, still in the run
    while the tests read the master; their ``stats()`` once they leave."""
    tmp = tmp_path_factory.mktemp("status")
    stop = tmp / "stop"
    with shoal.Master("127.0.0.1:0", http_addr="127.0.0.1:0", heartbeat_timeout=HEARTBEAT) as master:
        procs = []
        for i in range(PEERS):
            spec = {"master": master.address, "index": i, "peers": PEERS, "rounds": ROUNDS, "stop": str(stop),
                    "heartbeat": HEARTBEAT, "out": str(tmp / f"peer{i}"), "group": GROUP, "slow": SLOW,
                    "slow_s": SLOW_S}
            procs.append(subprocess.Popen(worker_argv("watched", spec), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, env=clean_env()))
            time.sleep(0.2)
        # Each peer says what it did once done; its counters reach the master with its next heartbeat.
        done = [tmp / f"peer{i}.done" for i in range(PEERS)]
        deadline, status, ids = time.monotonic() + 60, None, []
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            if all(d.exists() for d in done):
                reports = [json.loads(d.read_text()) for d in done]
                ids = [r["peer"] for r in reports]
                did = {r["peer"]: r["all_reduce"] for r in reports}
                s = master.status()
                seen = {p["id"]: p.get("operations", {}).get("all_reduce", {}).get("succeeded") for p in s["peers"]}
                if seen == did:
                    status = s
                    break
            time.sleep(0.1)
        if status is None:
            stop.touch()
            pytest.fail(f"the run never came up: {[p.communicate(timeout=60) for p in procs]}")
        run = Run(master, status, procs, stop, ids)
        try:
            yield run
        finally:
            run.finish()


def metric(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {series} in\n{text}")


def test_status_lists_the_run(run: Run) -> None:
    code, kind, body = run.get("/status")
    assert code == 200 and kind == "application/json"
    s = json.loads(body)
    assert [p["state"] for p in s["peers"]] == ["accepted"] * PEERS
    assert {p["id"] for p in s["peers"]} == set(s["ring"]) and len(s["ring"]) == PEERS
    for p in s["peers"]:
        assert re.fullmatch(r"127\.0\.0\.1:\d+", p["addr"]) and p["group"] == GROUP and p["rank"] in range(PEERS)
        assert (p["dialable"], p["seen"]) == (True, "127.0.0.1"), "the master's probe, and where it saw the peer"
        assert p["operations"]["all_reduce"]["succeeded"] >= ROUNDS
        assert len(p["links"]) == PEERS - 1
    (g,) = s["groups"]
    assert g["group"] == GROUP and g["ring"] == s["ring"] and g["phase"] == "idle" and g["ring_epoch"] <= s["epoch"]
    assert g["revision"] == 7 and set(g["hashes"]) == {"w"}
    # optimize_topology measured every link but the diagonal.
    m = g["matrix"]
    assert sorted(m["peers"]) == sorted(s["ring"])
    assert all((m["bytes_per_s"][i][j] is None) == (i == j) for i in range(PEERS) for j in range(PEERS))
    assert s["operations"]["all_reduce"]["succeeded"] >= PEERS * ROUNDS
    assert "probe" in s["operations"], "the measurement counts apart from the application's calls"
    assert s["counters"]["joins"] == PEERS and s["counters"]["syncs_completed"] == 1
    assert s["running"] == []


def test_status_names_the_peer_that_holds_the_others_up(run: Run) -> None:
    """Peer ``SLOW`` calls every all-reduce 50 ms after the others: it is the run's straggler, on
    /status and /metrics alike, and nobody else is."""
    s = json.loads(run.get("/status")[2])
    slow = run.ids[SLOW]
    first = s["stragglers"][0]
    assert (first["peer"], first["group"], first["straggler"]) == (slow, GROUP, True), s["stragglers"]
    assert first["recent_last"] * 2 > first["recent_ops"] >= 5 and first["recent_median_late_s"] > SLOW_S / 2
    assert [t["peer"] for t in s["stragglers"] if t["straggler"]] == [slow]
    late = {p["id"]: p["late"] for p in s["peers"]}
    assert late[slow]["last"] * 2 > late[slow]["collectives"] >= ROUNDS, late
    assert late[slow]["seconds"] > ROUNDS * SLOW_S / 2, late
    text = run.get("/metrics")[2]
    for peer in run.ids:
        assert metric(text, f'shoal_straggler{{peer="{peer}"}}') == (peer == slow)
        assert metric(text, f'shoal_collectives_measured_total{{peer="{peer}"}}') >= ROUNDS
    assert metric(text, f'shoal_collectives_last_total{{peer="{slow}"}}') == late[slow]["last"]
    assert metric(text, f'shoal_lateness_seconds_total{{peer="{slow}"}}') == pytest.approx(late[slow]["seconds"])


def test_metrics_in_prometheus_text(run: Run) -> None:
    code, kind, text = run.get("/metrics")
    assert code == 200 and kind.startswith("application/openmetrics-text")
    assert text.rstrip().endswith("# EOF")
    assert metric(text, 'shoal_peers{state="accepted"}') == PEERS
    assert metric(text, 'shoal_peers{state="registered"}') == 0
    assert metric(text, "shoal_groups") == 1
    ok = metric(text, 'shoal_operations_succeeded_total{kind="all_reduce"}')
    assert ok >= PEERS * ROUNDS
    assert metric(text, 'shoal_operation_duration_seconds_count{kind="all_reduce"}') == ok
    assert metric(text, 'shoal_operation_duration_seconds_bucket{le="+Inf",kind="all_reduce"}') == ok
    assert metric(text, 'shoal_operation_bytes_total{kind="all_reduce",direction="tx"}') >= ok * (64 << 10) / 2
    assert metric(text, 'shoal_syncs_total{outcome="completed"}') == 1
    assert metric(text, f'shoal_shared_state_revision{{group="{GROUP}"}}') == 7
    assert metric(text, 'shoal_votes_total{vote="update_topology"}') >= 2
    assert metric(text, "shoal_peers_joined_total") == PEERS
    assert metric(text, "shoal_topology_epoch") >= PEERS
    assert metric(text, f'shoal_ring_epoch{{group="{GROUP}"}}') >= PEERS
    assert len(re.findall(r"^shoal_link_measured_bytes_per_second\{", text, re.M)) == PEERS * (PEERS - 1)
    # Every family has its HELP and TYPE, and every sample a family.
    families = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = re.match(r"[a-z_]+", line).group(0)  # type: ignore[union-attr]
            assert any(name == f or name.startswith(f + "_") for f in families), line


def test_pages_that_do_not_exist_and_other_methods(run: Run) -> None:
    assert run.get("/nothing")[0] == 404
    request = urllib.request.Request(f"http://{run.http}/status", data=b"x", method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=10)
    e.value.close()
    assert e.value.code == 405


def test_shoal_status_prints_the_run(run: Run) -> None:
    out = subprocess.run([sys.executable, "-m", "shoal.cli", "status", run.http], capture_output=True, text=True,
                         timeout=30, env=clean_env())
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert f"peers: {PEERS} accepted, 0 registered" in text
    for p in run.status["peers"]:
        assert re.search(rf"^p{p['id']}\s+{GROUP}\s+\d\s+accepted\s+{re.escape(p['addr'])}", text, re.M), text
    ring = " -> ".join(f"p{m}" for m in run.status["ring"] + run.status["ring"][:1])
    epoch = run.status["groups"][0]["ring_epoch"]
    assert f"ring of group {GROUP} (topology {epoch}, idle): {ring}; shared state at revision 7 (1 tensors)" in text
    assert re.search(r"^all_reduce\s+\d+", text, re.M) and "links measured by optimize_topology" in text
    assert re.search(rf"^p{run.ids[SLOW]}\s+{GROUP}\s+\d+ of \d+\s+[\d.]+ ms\s+yes$", text, re.M), text
    dead = subprocess.run([sys.executable, "-m", "shoal.cli", "status", "127.0.0.1:1"], capture_output=True,
                          text=True, timeout=30, env=clean_env())
    assert dead.returncode != 0 and "cannot read http://127.0.0.1:1/status" in dead.stderr


def chromium() -> str:
    """The Chromium binary; skipped where there is none, unless SHOAL_BROWSER_REQUIRED=1 (CI as
    root, where scripts/browser-deps installs it) makes that a failure."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if binary:
        return binary
    if os.environ.get("SHOAL_BROWSER_REQUIRED") == "1":
        pytest.fail("SHOAL_BROWSER_REQUIRED=1 but no chromium: run scripts/browser-deps")
    pytest.skip("no chromium: run scripts/browser-deps")


def blobs(mask: "list[list[bool]]") -> list[int]:
    """Sizes of the 4-connected regions of ``mask``."""
    h, w = len(mask), len(mask[0])
    seen = [[False] * w for _ in range(h)]
    sizes = []
    for y in range(h):
        for x in range(w):
            if mask[y][x] and not seen[y][x]:
                stack, n = [(y, x)], 0
                seen[y][x] = True
                while stack:
                    cy, cx = stack.pop()
                    n += 1
                    for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                        if 0 <= ny < h and 0 <= nx < w and mask[ny][nx] and not seen[ny][nx]:
                            seen[ny][nx] = True
                            stack.append((ny, nx))
                sizes.append(n)
    return sizes


def test_the_status_page_draws_the_ring_and_lists_the_peers(run: Run, tmp_path: Path) -> None:
    from PIL import Image

    binary = chromium()
    shot = tmp_path / "status.png"
    url = f"http://{run.http}/"
    browse = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1200,900",
              "--virtual-time-budget=5000", f"--user-data-dir={tmp_path / 'profile'}"]
    out = subprocess.run([*browse, f"--screenshot={shot}", url], capture_output=True, text=True, timeout=120)
    assert shot.exists(), out.stderr
    image = Image.open(shot).convert("RGB")
    w, h = image.size
    pixels = image.load()

    def regions(rgb: tuple[int, int, int], least: int) -> list[int]:
        mask = [[sum(abs(a - b) for a, b in zip(pixels[x, y], rgb)) < 30 for x in range(w)] for y in range(h)]
        return [n for n in blobs(mask) if n >= least]

    # One filled circle per ring member, one mark per accepted peer in the list.
    assert len(regions(RING_RGB, 200)) == PEERS, f"ring members drawn: see {shot}"
    assert len(regions(ACCEPTED_RGB, 80)) == PEERS, f"accepted peers listed: see {shot}"
    # And what the page wrote, after its script ran.
    dom = subprocess.run([*browse, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    assert f'id="summary">{PEERS} accepted, 0 registered' in dom, dom
    assert dom.count('<span class="mark accepted">') == PEERS
    for p in run.status["peers"]:
        assert f">p{p['id']}</text>" in dom and f"<td class=\"l\">{p['addr']}</td>" in dom
    # The stragglers' table names the slow peer first.
    table = dom[dom.index('id="stragglers"'):]
    assert table.index(f">p{run.ids[SLOW]}</td>") < table.index('<td class="l err">yes</td>'), table[:2000]


def test_each_peer_counts_its_own_work(run: Run) -> None:
    """Last: the peers leave to report their ``stats()``."""
    for r in run.finish():
        s = r["stats"]
        ops = s["operations"]["all_reduce"]
        assert (ops["started"], ops["succeeded"], ops["failed"]) == (ops["succeeded"], ops["succeeded"], 0)
        assert ops["succeeded"] >= ROUNDS and ops["tx_bytes"] > 0 and ops["seconds"] > 0
        assert s["failures"] == {} and s["running"] == []
        assert len(s["links"]) == PEERS - 1
        # A ring sends to one neighbour and receives from the other.
        assert all(link["tx_bytes"] + link["rx_bytes"] > 0 for link in s["links"])
        assert any(link["tx_bytes"] > 0 and link["tx_bytes_per_s"] > 0 for link in s["links"])
        assert s["operations"]["probe"]["succeeded"] > 0


def test_every_member_learns_how_late_each_called(run: Run) -> None:
    """Every all-reduce tells each participant how late every member called, the same figures on
    all of them; the slow peer's show it about ``SLOW_S`` late, and last."""
    results = run.finish()
    slow_rank = results[SLOW]["rank"]
    by_op: dict[tuple[int, int], list[list[float]]] = {}
    for r in results:
        for late in r["late"]:
            assert late["rank"] == r["rank"] and len(late["lateness"]) == PEERS
            by_op.setdefault(tuple(late["op"]), []).append(late["lateness"])
    assert len(by_op) == ROUNDS
    for op, figures in by_op.items():
        assert len(figures) == PEERS and all(f == figures[0] for f in figures), (op, figures)
        assert min(figures[0]) == 0.0, (op, figures)
    slow = sorted(f[0][slow_rank] for f in by_op.values())
    assert slow[ROUNDS // 2] > SLOW_S / 2, slow
    last = [late["last"] for late in results[0]["late"]]
    assert last.count(slow_rank) > ROUNDS // 2, last

