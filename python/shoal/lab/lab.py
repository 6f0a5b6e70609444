"""Builds, runs and removes a lab: network namespaces on one machine that behave like hosts on
a WAN (see ``docs/lab.md``).

Layout of a lab called NAME: a namespace ``NAME-switch`` holding a bridge, and one namespace
``NAME-HOST`` per host whose ``eth0`` is a veth into the bridge. With site uplinks, each site's
hosts plug into a bridge of their own (``b-SITE``), joined to the core bridge by a veth pair
(``u-SITE`` on the site's side, ``d-SITE`` on the core's) whose htb caps every flow leaving and
entering the site together, as a datacenter's WAN link does. Inside each host:

- htb on ``eth0`` caps what the host sends; htb on the switch's end caps what it receives;
- ``net.ipv4.tcp_rmem`` caps TCP receive windows (the per-flow limit of long fat pipes);
- iptables INPUT: first the ``SHOAL-FAULT`` chain (partitions, resets, blackholes), then random
  loss, then one NFQUEUE rule per sending host with a delay (``--queue-bypass``: if the delay
  program is gone, packets pass undelayed);
- a delay program (``python -m shoal.lab.delay``) holding each queue's packets for RTT/2.

A NAT router (``spec.py``) is a namespace ``NAME-ROUTER`` too: ``eth0`` on the bridge with its
public address, a bridge ``lan`` with a veth to each of its hosts (whose ``eth0`` sits on it, the
router their default route), MASQUERADE on what leaves through ``eth0``, and a FORWARD policy that
lets in only what conntrack knows as a reply. Every host's delays and faults key on the address
it sees the other at (``Spec.seen``); a fault's drop of what a host behind a NAT sends happens on
its way out (the ``SHOAL-FAULT-OUT`` chain of OUTPUT), where its destination still tells the
hosts of one router apart.

Everything is recorded before it is made, in ``/run/shoal-lab/NAME/state.json``
(``SHOAL_LAB_STATE`` moves it): ``down``, or the next ``up`` of the same name, removes what a
crashed run left. Every helper process runs under ``timeout`` (its time-to-live) and carries
``SHOAL_LAB_HELPER=NAME`` in its environment, so it is found and ended by PID.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from .spec import Host, Nat, Spec, build, parse_rate

IPT = "iptables-legacy"
FAULT_CHAIN = "SHOAL-FAULT"
FAULT_OUT_CHAIN = "SHOAL-FAULT-OUT"
FAULT_KINDS = ("partition", "blackhole", "reset", "loss", "slow")
TOXIPROXY_VERSION = "v2.12.0"
TOXIPROXY_API = "127.0.0.1:8474"
DEFAULT_TTL_S = 4 * 3600
PROBE = Path(__file__).with_name("probe.py")
_REALTIME = ["chrt", "--rr", "1"] if shutil.which("chrt") else []


class LabError(RuntimeError):
    """The lab cannot be built or used; the message says what to do."""


def state_root() -> Path:
    return Path(os.environ.get("SHOAL_LAB_STATE", "/run/shoal-lab"))


def unavailable() -> Optional[str]:
    """Why a lab cannot be built on this machine, or None."""
    if sys.platform != "linux":
        return "the lab needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the lab needs root (network namespaces, tc, iptables)"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), (IPT, "iptables"), ("timeout", "coreutils")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian package {package}; scripts/lab-deps installs it)"
    probe = f"shoal-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        nfq = subprocess.run(["ip", "netns", "exec", probe, IPT, "-A", "INPUT", "-s", "192.0.2.1", "-j", "NFQUEUE",
                              "--queue-num", "1", "--queue-bypass"], capture_output=True, text=True)
        if nfq.returncode != 0:
            return f"the kernel refuses iptables NFQUEUE rules: {nfq.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def toxiproxy_binary() -> Optional[str]:
    """The pinned toxiproxy server scripts/lab-deps installs, or ``SHOAL_TOXIPROXY``."""
    if os.environ.get("SHOAL_TOXIPROXY"):
        return os.environ["SHOAL_TOXIPROXY"]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    path = cache / "shoal" / "bin" / f"toxiproxy-server-{TOXIPROXY_VERSION}"
    return str(path) if path.is_file() else None


def _run(argv: Sequence[str], what: str) -> str:
    p = subprocess.run(list(argv), capture_output=True, text=True)
    if p.returncode != 0:
        raise LabError(f"{what}: `{' '.join(argv)}` failed: {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout


def _pid_alive_with(pid: int, marker: str) -> bool:
    """Whether ``pid`` is a live process carrying ``marker`` in its environment (a PID may have
    been reused since it was recorded)."""
    try:
        return marker.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


class Lab:
    """A lab that is up (or is being built). ``Lab.up(spec)`` builds one; ``Lab(name)`` attaches
    to one built by another process (``shoal lab up``)."""

    def __init__(self, name: str = "shoal") -> None:
        self.name = name
        self.dir = state_root() / name
        state = _read_state(name)
        if state is None or not state.get("complete"):
            raise LabError(f"no lab named {name!r} is up (shoal lab up PROFILE --name {name})")
        self.state = state
        self.spec = build(state["raw"], state["subnet"], **state["overrides"])

    # ---- building and removing -------------------------------------------------------------

    @classmethod
    def up(cls, raw: dict[str, Any], name: str = "shoal", subnet: str = "10.77.0.0/24", ttl: float = DEFAULT_TTL_S,
           **overrides: Any) -> "Lab":
        """Builds the lab ``raw`` (a spec dict or profile, see ``spec.py``) under ``name``,
        first removing whatever an earlier lab of that name left."""
        if not name or not name.replace("-", "").isalnum() or len(name) > 24:
            raise LabError(f"bad lab name {name!r}: letters, digits and '-', at most 24")
        spec = build(raw, subnet, **overrides)
        reason = unavailable()
        if reason:
            raise LabError(reason)
        with _locked():
            _down(name)
            lab_dir = state_root() / name
            lab_dir.mkdir(parents=True, exist_ok=True)
            state = {"raw": raw, "subnet": subnet, "overrides": overrides, "ttl": ttl, "created": time.time(),
                     "namespaces": [f"{name}-switch"] + [f"{name}-{h.name}" for h in [*spec.hosts, *spec.nats]],
                     "helpers": [], "faults": [], "complete": False}
            _write_state(name, state)
            try:
                _build(name, spec, state, ttl)
            except BaseException:
                _down(name)
                raise
            state["complete"] = True
            _write_state(name, state)
        return cls(name)

    def down(self) -> None:
        """Ends every process in the lab's hosts and removes its namespaces and state."""
        remove(self.name)

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # ---- using it --------------------------------------------------------------------------

    @property
    def hosts(self) -> list[str]:
        return [h.name for h in self.spec.hosts]

    def address(self, host: str) -> str:
        """The address ``host`` binds and advertises (behind a NAT, a private one)."""
        return self.spec.host(host).address

    def public_address(self, host: str) -> str:
        """The address the rest of the lab sees ``host`` at: its own, or its NAT router's."""
        return self.spec.public(host)

    def namespace(self, host: str) -> str:
        self.spec.host(host)
        return f"{self.name}-{host}"

    def argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def popen(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        return subprocess.Popen(self.argv(host, argv), **kwargs)

    def run(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(host, argv), **kwargs)

    def master(self, host: str, port: int = 48148, heartbeat_timeout: Optional[float] = None,
               tls: Optional[dict[str, str]] = None,
               http_port: Optional[int] = None) -> contextlib.AbstractContextManager[str]:
        """A ``shoal master`` process in ``host``; yields the address peers dial. ``tls``: its
        ``tls_cert``, ``tls_key`` and ``tls_ca``; ``http_port``: where it serves ``/status``,
        ``/metrics`` and the status page."""
        argv = [sys.executable, "-m", "shoal.cli", "master", "--listen", f"0.0.0.0:{port}"]
        if http_port is not None:
            argv += ["--http", f"0.0.0.0:{http_port}"]
        if heartbeat_timeout is not None:
            argv += ["--heartbeat-timeout", str(heartbeat_timeout)]
        for key, path in (tls or {}).items():
            argv += [f"--{key.replace('_', '-')}", path]
        return self._server(host, argv, "listening", "the master", port)

    @contextlib.contextmanager
    def _server(self, host: str, argv: list[str], ready: str, what: str, port: int) -> Iterator[str]:
        """Runs ``argv`` in ``host`` until the block ends; waits for ``ready`` on its first line
        and yields ``address:port``."""
        p = self.popen(host, argv, stdout=subprocess.PIPE, text=True)
        try:
            if ready not in (p.stdout.readline() if p.stdout else ""):
                raise LabError(f"{what} in {host} did not start")
            yield f"{self.address(host)}:{port}"
        finally:
            stop(p)

    # ---- faults ----------------------------------------------------------------------------

    def fault(self, kind: str, a: str, b: Optional[str] = None, probability: float = 0.05,
              rate: Optional[str] = None) -> None:
        """Breaks the path between hosts ``a`` and ``b`` (or between ``a`` and every other host):

        - ``partition``: nothing passes either way (silently dropped);
        - ``blackhole``: what ``a`` sends to ``b`` vanishes; the other direction still flows;
        - ``reset``: every TCP segment either way is answered with a reset;
        - ``loss``: each packet either way is dropped with ``probability``;
        - ``slow``: the path carries at most ``rate`` (e.g. ``"100mbit"``) each way: a congested
          path (its own htb class on each end, beside the host's cap).
        """
        if kind not in FAULT_KINDS:
            raise LabError(f"unknown fault {kind!r}: expected one of {', '.join(FAULT_KINDS)}")
        if kind == "loss" and not 0 < probability < 1:
            raise LabError(f"loss probability {probability} outside (0, 1)")
        bits = None
        if kind == "slow":
            if rate is None:
                raise LabError("a slow fault needs a rate, e.g. 100mbit")
            bits = parse_rate(rate)
            uncapped = [h for h in (a, b) if h is not None and not self.spec.host(h).rate]
            if uncapped:
                raise LabError(f"a slow fault needs hosts with a rate cap (htb); {uncapped[0]} has none")
        with _locked():
            state = _read_state(self.name) or self.state
            for other in self._others(a, b):
                f = {"kind": kind, "a": a, "b": other, "probability": probability if kind == "loss" else None,
                     "rate": bits}
                if f in state["faults"]:
                    continue
                if kind == "slow" and any(g["kind"] == "slow" and {g["a"], g["b"]} == {a, other}
                                          for g in state["faults"]):
                    raise LabError(f"the path between {a} and {other} is slow already: heal it first")
                if kind == "slow":
                    self._slow(f, add=True)
                for host, chain, rule in self._fault_rules(f):
                    _run(self.argv(host, [IPT, "-A", chain, *rule]), f"adding a {kind} fault")
                state["faults"].append(f)
            _write_state(self.name, state)
            self.state = state

    def heal(self, a: Optional[str] = None, b: Optional[str] = None) -> int:
        """Removes the faults between ``a`` and ``b`` (either order), or every fault of ``a``, or
        every fault. Returns how many were removed."""
        with _locked():
            state = _read_state(self.name) or self.state
            self._others(a, b)  # checks the names
            keep, removed = [], 0
            for f in state["faults"]:
                involved = {f["a"], f["b"]}
                if a is None or (a in involved and (b is None or involved == {a, b})):
                    if f["kind"] == "slow":
                        self._slow(f, add=False)
                    for host, chain, rule in self._fault_rules(f):
                        self.run(host, [IPT, "-D", chain, *rule], capture_output=True)
                    removed += 1
                else:
                    keep.append(f)
            state["faults"] = keep
            _write_state(self.name, state)
            self.state = state
        return removed

    def _others(self, a: Optional[str], b: Optional[str]) -> list[str]:
        if a is None:
            return []
        self.spec.host(a)
        if b is not None:
            self.spec.host(b)
            if a == b:
                raise LabError(f"a fault needs two different hosts, not {a} and {a}")
            return [b]
        return [h for h in self.hosts if h != a]

    def _slow(self, f: dict[str, Any], add: bool) -> None:
        """A slow fault's htb class on each end of its path (what each end sends to the other),
        numbered after the other end, or its removal."""
        for host, other in ((f["a"], f["b"]), (f["b"], f["a"])):
            n = 100 + self.hosts.index(other)
            if not add:
                self.run(host, ["tc", "filter", "del", "dev", "eth0", "parent", "1:", "prio", str(n)],
                         capture_output=True)
                self.run(host, ["tc", "class", "del", "dev", "eth0", "classid", f"1:{n}"], capture_output=True)
                continue
            _batch(["tc", "-n", self.namespace(host)],
                   [*_htb_class("eth0", n, f["rate"]), f"filter add dev eth0 parent 1: protocol ip prio {n} u32 match "
                    f"ip dst {self.spec.seen(host, other)}/32 flowid 1:{n}"], f"slowing {host} -> {other}")

    def _fault_rules(self, f: dict[str, Any]) -> list[tuple[str, str, list[str]]]:
        """The iptables rules (host, chain, arguments) of one fault between two hosts."""
        a, b = f["a"], f["b"]
        if f["kind"] == "slow":
            return []
        if f["kind"] == "partition":
            return [*self._dropping(b, a, ["-j", "DROP"]), *self._dropping(a, b, ["-j", "DROP"])]
        if f["kind"] == "blackhole":
            return self._dropping(a, b, ["-j", "DROP"])
        if f["kind"] == "loss":
            p = ["-m", "statistic", "--mode", "random", "--probability", str(f["probability"]), "-j", "DROP"]
            return [*self._dropping(b, a, p), *self._dropping(a, b, p)]
        # A reset itself must pass, or the other side's rule would swallow it.
        reset = ["-p", "tcp", "!", "--tcp-flags", "RST", "RST", "-j", "REJECT", "--reject-with", "tcp-reset"]
        return [*self._dropping(b, a, reset), *self._dropping(a, b, reset)]

    def _dropping(self, src: str, dst: str, action: list[str]) -> list[tuple[str, str, list[str]]]:
        """Where ``action`` meets what ``src`` sends ``dst``: as ``dst`` receives it, by the
        address it comes from; or, from a host behind a NAT to one off its LAN (whose address
        the rest of the lab shares with the router's other hosts), as ``src`` sends it."""
        seen = self.spec.seen
        if self.spec.host(src).nat and self.spec.host(src).nat != self.spec.host(dst).nat:
            return [(src, FAULT_OUT_CHAIN, ["-d", seen(src, dst), *action])]
        return [(dst, FAULT_CHAIN, ["-s", seen(dst, src), *action])]

    # ---- connection-level faults (toxiproxy) --------------------------------------------------

    def proxy(self, host: str, name: str, listen_port: int, upstream: str) -> str:
        """Starts (once per host) a toxiproxy server inside ``host`` and makes proxy ``name``
        listening on ``listen_port`` there and forwarding to ``upstream``; returns the address
        to dial. Toxics (``toxic``) then act on the connections through it."""
        binary = toxiproxy_binary()
        if binary is None:
            raise LabError(f"toxiproxy {TOXIPROXY_VERSION} is not installed: run scripts/lab-deps")
        with _locked():
            state = _read_state(self.name) or self.state
            running = [h for h in state["helpers"] if h["kind"] == "toxiproxy" and h["host"] == host
                       and _pid_alive_with(h["pid"], self._marker)]
            if not running:
                api_host, api_port = TOXIPROXY_API.split(":")
                _start_helper(self.name, state, host, "toxiproxy", [binary, "-host", api_host, "-port", api_port])
                _write_state(self.name, state)
                _wait_for(lambda: self._toxiproxy(host, "GET", "/version", check=False) is not None,
                           f"toxiproxy in {host} did not start (see {self.dir / f'toxiproxy-{host}.log'})")
            self.state = state
        self._toxiproxy(host, "POST", "/proxies", {"name": name, "listen": f"0.0.0.0:{listen_port}",
                                                   "upstream": upstream, "enabled": True})
        return f"{self.address(host)}:{listen_port}"

    def toxic(self, host: str, proxy: str, kind: str, stream: str = "downstream", name: Optional[str] = None,
              toxicity: float = 1.0, **attributes: Any) -> str:
        """Adds a toxic (``latency``, ``bandwidth``, ``reset_peer``, ``timeout``, ``slicer``,
        ``limit_data``, ...) to proxy ``proxy`` in ``host``; returns its name."""
        name = name or f"{kind}_{stream}"
        self._toxiproxy(host, "POST", f"/proxies/{proxy}/toxics", {"name": name, "type": kind, "stream": stream,
                                                                   "toxicity": toxicity, "attributes": attributes})
        return name

    def untoxic(self, host: str, proxy: str, name: str) -> None:
        self._toxiproxy(host, "DELETE", f"/proxies/{proxy}/toxics/{name}")

    def _toxiproxy(self, host: str, method: str, path: str, body: Any = None, check: bool = True) -> Any:
        # Its API listens inside the host's namespace: the request is made from there.
        script = ("import sys,urllib.request as u\n"
                  "r=u.Request('http://" + TOXIPROXY_API + "'+sys.argv[2],method=sys.argv[1],"
                  "data=sys.argv[3].encode() or None,headers={'Content-Type':'application/json'})\n"
                  "try:\n print(u.urlopen(r,timeout=5).read().decode())\n"
                  "except u.HTTPError as e:\n sys.exit(f'{e.code}: {e.read().decode()}')\n")
        p = self.run(host, [sys.executable, "-c", script, method, path, json.dumps(body) if body is not None else ""],
                     capture_output=True, text=True, timeout=20)
        if p.returncode != 0:
            if check:
                raise LabError(f"toxiproxy in {host}: {method} {path}: {p.stderr.strip().splitlines()[-1:]}")
            return None
        return json.loads(p.stdout) if p.stdout.strip() else {}

    # ---- measuring -------------------------------------------------------------------------

    def probe_server(self, host: str, port: int = 5201) -> contextlib.AbstractContextManager[str]:
        """A probe server (``probe.py serve``) in ``host``; yields its address."""
        return self._server(host, [sys.executable, str(PROBE), "serve", str(port)], "ready", "the probe server", port)

    def measure_rtt(self, a: str, b: str, count: int = 20, timeout: float = 10.0) -> dict:
        """TCP round trips of one byte from ``a`` to ``b``: median/min/max in ms."""
        with self.probe_server(b) as addr:
            return self.probe(a, ["rtt", addr, str(count), str(timeout)])

    def measure_throughput(self, a: str, b: str, streams: int = 1, seconds: float = 3.0, warmup: float = 1.5) -> dict:
        """What ``b`` receives from ``a`` over ``streams`` TCP connections, counted from
        ``warmup`` seconds after they start (slow start on a long path takes a while)."""
        with self.probe_server(b) as addr:
            return self.probe(a, ["stream", addr, str(streams), str(seconds), str(warmup)])

    def watch(self, host: str, server: str, seconds: float) -> subprocess.Popen:
        """Starts ``probe.py watch`` from ``host`` to a probe server's address (``probe_server``)
        and returns once it is connected; its last stdout line will be the JSON timeline."""
        p = self.popen(host, [sys.executable, str(PROBE), "watch", server, str(seconds)], stdout=subprocess.PIPE,
                       text=True)
        if "ready" not in (p.stdout.readline() if p.stdout else ""):
            p.kill()
            p.communicate()
            raise LabError(f"the probe in {host} could not connect to {server}")
        return p

    def probe(self, host: str, args: list[str]) -> dict:
        """Runs ``probe.py ARGS`` in ``host`` and returns its JSON answer."""
        p = self.run(host, [sys.executable, str(PROBE), *args], capture_output=True, text=True, timeout=120)
        if p.returncode != 0:
            raise LabError(f"probe {' '.join(args)} from {host} failed: {p.stderr.strip()}")
        return json.loads(p.stdout.strip().splitlines()[-1])

    # ---- internals -------------------------------------------------------------------------

    @property
    def _marker(self) -> str:
        return f"SHOAL_LAB_HELPER={self.name}"

    def status(self) -> dict[str, Any]:
        alive = [dict(h, alive=_pid_alive_with(h["pid"], self._marker)) for h in self.state["helpers"]]
        hosts = self.hosts
        return {
            "name": self.name,
            "hosts": self.spec.to_dict()["hosts"],
            "rtt_ms": {a: {b: self.spec.rtt(a, b) for b in hosts if b != a} for a in hosts},
            "uplinks": self.spec.uplinks,
            "nats": self.spec.to_dict()["nat"],
            "faults": self.state["faults"],
            "helpers": alive,
            "expires": self.state["created"] + self.state["ttl"],
        }


# ---- building, removing and the state file (module level: also used before a Lab exists) ----


def stop(p: subprocess.Popen, grace: float = 10.0) -> None:
    """Stops ``p`` (SIGTERM, then SIGKILL after ``grace`` seconds), reaps it and closes its pipes."""
    p.terminate()
    try:
        p.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()


def remove(name: str) -> None:
    """Removes whatever is left of lab ``name``: processes in its hosts, namespaces, state."""
    with _locked():
        _down(name)


def names() -> list[str]:
    """The labs this machine has state for."""
    root = state_root()
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """Serialises changes to labs (one lock for all: they are short, and no lock files pile up)."""
    state_root().mkdir(parents=True, exist_ok=True)
    with open(state_root() / "lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _read_state(name: str) -> Optional[dict]:
    try:
        return json.loads((state_root() / name / "state.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _write_state(name: str, state: dict) -> None:
    path = state_root() / name / "state.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(path)


def _start_helper(name: str, state: dict, host: str, kind: str, argv: list[str]) -> int:
    """Starts a helper in ``host`` under ``timeout`` (its time-to-live), detached from the caller
    (a shell starts it in the background and exits, so nobody has to reap it), and records its
    PID in ``state`` (the caller writes the state)."""
    remaining = max(1, int(state["created"] + state["ttl"] - time.time()))
    log = state_root() / name / f"{kind}-{host}.log"
    env = dict(os.environ, SHOAL_LAB_HELPER=name)
    command = ["ip", "netns", "exec", f"{name}-{host}", "timeout", "-s", "KILL", str(remaining + 5), *argv]
    background = 'log=$1; shift; "$@" </dev/null >>"$log" 2>&1 & echo $!'
    out = subprocess.run(["sh", "-c", background, "sh", str(log), *command],
                         env=env, capture_output=True, text=True, start_new_session=True, check=True).stdout
    pid = int(out.strip())
    state["helpers"].append({"kind": kind, "host": host, "pid": pid})
    return pid


def _down(name: str) -> None:
    """Removes everything the state of lab ``name`` records (missing pieces are fine)."""
    state = _read_state(name)
    marker = f"SHOAL_LAB_HELPER={name}"
    pids = [h["pid"] for h in (state or {}).get("helpers", []) if _pid_alive_with(h["pid"], marker)]
    namespaces = (state or {}).get("namespaces", [])
    existing = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    for ns in namespaces:
        if ns in existing:
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
            pids += [int(p) for p in out.split()]
    for pid in set(pids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for ns in namespaces:
        if ns in existing:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    shutil.rmtree(state_root() / name, ignore_errors=True)


def _build(name: str, spec: Spec, state: dict, ttl: float) -> None:
    """Builds the lab in a few batched commands per namespace (``ip -batch``, ``tc -batch``,
    ``iptables-restore``): 64 hosts take seconds, not the minute one command per change took."""
    sw = f"{name}-switch"
    ns = {h.name: f"{name}-{h.name}" for h in [*spec.hosts, *spec.nats]}
    _batch(["ip"], [f"netns add {n}" for n in (sw, *ns.values())], "creating the namespaces")
    plen = state["subnet"].split("/")[1]
    links, caps = ["link add br0 type bridge", "link set br0 up"], []
    for site, bits in spec.uplinks.items():
        bridge, up, down = f"b-{site}", f"u-{site}", f"d-{site}"
        links += [f"link add {bridge} type bridge", f"link set {bridge} up",
                  f"link add {up} type veth peer name {down}", f"link set {up} master {bridge} up",
                  f"link set {down} master br0 up"]
        if bits:
            caps += _cap(up, bits) + _cap(down, bits)  # what the site sends to the others; receives
    # On the lab's public network: the public hosts and the NAT routers.
    for h in [*(h for h in spec.hosts if not h.nat), *spec.nats]:
        port, bridge = f"h-{h.name}", f"b-{h.site}" if spec.uplinks else "br0"
        links += [f"link add {port} type veth peer name eth0 netns {ns[h.name]}", f"link set {port} master {bridge} up"]
        if isinstance(h, Host) and h.rate:
            caps += _cap(port, h.rate)  # what the host receives
    _batch(["ip", "-n", sw], links, "cabling the switch")
    if caps:
        _batch(["tc", "-n", sw], caps, "capping the switch's ports")
    on_public = [*(h.address for h in spec.hosts if not h.nat), *(n.address for n in spec.nats)]
    for n in spec.nats:
        _build_nat(ns[n.name], n, spec, plen, on_public, ns)

    queues: list[str] = []
    for h in spec.hosts:
        n = ns[h.name]
        # Neighbours are static: one kernel-wide table holds every namespace's learned entries
        # (1,024 by default), and 64 hosts that each learn 63 overflow it and drop SYNs.
        addressing = [f"link set eth0 address {_mac(h.address)}", "link set lo up"]
        if h.nat:  # on its router's LAN, which routes the rest
            nat = spec.nat(h.nat)
            lan = [nat.gateway, *(spec.host(o).address for o in nat.hosts)]
            addressing += [f"addr add {h.address}/{nat.lan.split('/')[1]} dev eth0", "link set eth0 up",
                           f"route add default via {nat.gateway}"]
        else:
            lan = on_public
            addressing += [f"addr add {h.address}/{plen} dev eth0", "link set eth0 up"]
        neighbours = [f"neigh replace {a} lladdr {_mac(a)} dev eth0 nud permanent" for a in lan if a != h.address]
        _batch(["ip", "-n", n], [*addressing, *neighbours], f"addressing {h.name}")
        if h.rate:
            _batch(["tc", "-n", n], _cap("eth0", h.rate), f"capping {h.name}'s link")  # what it sends
        if h.window:
            default = min(131072, h.window)
            _run(["ip", "netns", "exec", n, "sysctl", "-q", "-w", f"net.ipv4.tcp_rmem=4096 {default} {h.window}"],
                 f"capping {h.name}'s TCP windows")
        rules = [f":{FAULT_CHAIN} - [0:0]", f"-A INPUT -i eth0 -j {FAULT_CHAIN}",
                 f":{FAULT_OUT_CHAIN} - [0:0]", f"-A OUTPUT -o eth0 -j {FAULT_OUT_CHAIN}"]
        if h.loss:
            rules.append(f"-A INPUT -i eth0 -m statistic --mode random --probability {h.loss} -j DROP")
        # One queue per distinct one-way delay towards this host, keyed by the address each other
        # host's packets arrive from (the hosts behind one NAT share theirs, and their delay).
        delays = {spec.seen(h.name, o.name): spec.rtt(h.name, o.name) / 2000 for o in spec.hosts if o.name != h.name}
        numbers = {d: i + 1 for i, d in enumerate(sorted({d for d in delays.values() if d > 0}))}
        rules += [f"-A INPUT -i eth0 -s {source} -j NFQUEUE --queue-num {numbers[d]} --queue-bypass"
                  for source, d in delays.items() if d > 0]
        restore = subprocess.run(["ip", "netns", "exec", n, f"{IPT}-restore", "--noflush"],
                                 input="*filter\n" + "\n".join(rules) + "\nCOMMIT\n", capture_output=True, text=True)
        if restore.returncode != 0:
            raise LabError(f"{h.name}: loading its iptables rules failed: {restore.stderr.strip()}")
        queues += [f"{n}:{q}={d}" for d, q in numbers.items()]
    if queues:
        # One delay program for every host: it opens a queue socket inside each namespace. It is
        # the network, not a tenant: real-time priority, so that 64 busy peers on two cores do not
        # hold every packet past its delay (SYNs then time out).
        delay = [*_REALTIME, sys.executable, "-m", "shoal.lab.delay", "--ttl", str(ttl), *queues]
        _start_helper(name, state, "switch", "delay", delay)
        _write_state(name, state)
        want = {n: {q.rpartition(":")[2].split("=")[0] for q in queues if q.startswith(f"{n}:")} for n in ns.values()}
        _wait_for(lambda: all(w <= _bound_queues(n) for n, w in want.items() if w),
                  f"the delay program did not bind its queues (see {state_root() / name}/delay-switch.log)")


def _build_nat(namespace: str, nat: Nat, spec: Spec, plen: str, on_public: list[str], ns: dict[str, str]) -> None:
    """Router ``nat``: its public ``eth0`` (cabled to the switch already), a bridge ``lan`` with a
    veth to each of its hosts (their ``eth0``), masquerading out and only replies in."""
    links = [f"link set eth0 address {_mac(nat.address)}", f"addr add {nat.address}/{plen} dev eth0",
             "link set eth0 up", "link set lo up", "link add lan type bridge",
             f"link set lan address {_mac(nat.gateway)}", "link set lan up",
             f"addr add {nat.gateway}/{nat.lan.split('/')[1]} dev lan",
             *(f"neigh replace {a} lladdr {_mac(a)} dev eth0 nud permanent" for a in on_public if a != nat.address)]
    for host in nat.hosts:
        h = spec.host(host)
        links += [f"link add n-{host} type veth peer name eth0 netns {ns[host]}", f"link set n-{host} master lan up",
                  f"neigh replace {h.address} lladdr {_mac(h.address)} dev lan nud permanent"]
    _batch(["ip", "-n", namespace], links, f"cabling NAT {nat.name}")
    caps = [line for host in nat.hosts if spec.host(host).rate for line in _cap(f"n-{host}", spec.host(host).rate)]
    if caps:
        _batch(["tc", "-n", namespace], caps, f"capping what NAT {nat.name} passes to its hosts")
    _run(["ip", "netns", "exec", namespace, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"], f"routing in {nat.name}")
    # Its hosts' traffic goes out (and between them, bridged); only replies come in.
    rules = ["*nat", f"-A POSTROUTING -o eth0 -s {nat.lan} -j MASQUERADE", "COMMIT",
             "*filter", ":FORWARD DROP [0:0]", "-A FORWARD -i lan -j ACCEPT",
             "-A FORWARD -i eth0 -o lan -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
             "-A INPUT -i eth0 -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT", "-A INPUT -i eth0 -j DROP",
             "COMMIT"]
    restore = subprocess.run(["ip", "netns", "exec", namespace, f"{IPT}-restore"], input="\n".join(rules) + "\n",
                             capture_output=True, text=True)
    if restore.returncode != 0:
        raise LabError(f"NAT {nat.name}: loading its iptables rules failed: {restore.stderr.strip()}")


def _mac(address: str) -> str:
    """A host's MAC address, made of its IPv4 address (locally administered)."""
    return "02:00:" + ":".join(f"{int(b):02x}" for b in address.split("."))


def _batch(command: list[str], lines: list[str], what: str) -> None:
    """Runs ``command -batch -`` (``ip`` or ``tc``) over ``lines``, one change each."""
    p = subprocess.run([*command, "-batch", "-"], input="\n".join(lines) + "\n", capture_output=True, text=True)
    if p.returncode != 0:
        raise LabError(f"{what}: `{' '.join(command)} -batch` failed: {p.stderr.strip() or p.stdout.strip()}")


def _wait_for(ready: Callable[[], bool], message: str, timeout: float = 10.0) -> None:
    until = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > until:
            raise LabError(message)
        time.sleep(0.05)


def _bound_queues(namespace: str) -> set[str]:
    out = subprocess.run(["ip", "netns", "exec", namespace, "cat", "/proc/net/netfilter/nfnetlink_queue"],
                         capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _cap(dev: str, bits: int) -> list[str]:
    """``tc -batch`` lines: htb at ``bits``/s on ``dev``'s egress, with a byte FIFO holding ~50 ms
    at that rate."""
    return [f"qdisc replace dev {dev} root handle 1: htb default 1", *_htb_class(dev, 1, bits)]


def _htb_class(dev: str, minor: int, bits: int) -> list[str]:
    """``tc -batch`` lines: class ``1:minor`` of ``dev``'s root htb at ``bits``/s, with a byte FIFO
    holding ~50 ms."""
    rate = f"{bits}bit"
    burst = max(64 << 10, bits // 8 // 500)  # 2 ms at the rate, at least one large segment
    limit = max(256 << 10, bits // 8 // 20)
    return [f"class add dev {dev} parent 1: classid 1:{minor} htb rate {rate} ceil {rate} burst {burst} "
            f"cburst {burst} quantum 60000",
            f"qdisc add dev {dev} parent 1:{minor} handle {minor + 9}: bfifo limit {limit}"]
