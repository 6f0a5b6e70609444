"""Measures a lab path with real TCP: round-trip time and receiver-side throughput over N streams.

Runs as a plain script (no ``shoal`` import, so it starts fast inside a lab host)::

    probe.py serve PORT                       # prints "ready"; echoes and sinks until killed
    probe.py rtt ADDR:PORT COUNT TIMEOUT      # JSON: median/min/max ms of 1-byte round trips
    probe.py stream ADDR:PORT STREAMS SECONDS WARMUP
                                              # JSON: bits/s the receiver got, after a warm-up
    probe.py watch ADDR:PORT SECONDS          # prints "ready" once connected; then a byte out
                                              # every 50 ms; JSON: times of the echoes (from
                                              # "ready"), and of the error if any

Throughput is counted where the bytes arrive: the client asks the server for its byte count
after the warm-up and again ``SECONDS`` later, so bytes still in socket buffers do not count.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import struct
import sys
import threading
import time

_counters: dict[bytes, list[list[int]]] = {}
_lock = threading.Lock()


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = s.recv(n - len(buf))
        if not part:
            raise ConnectionError("closed")
        buf += part
    return buf


def _serve_one(s: socket.socket) -> None:
    try:
        mode = _recv_exact(s, 1)
        if mode == b"e":
            while data := s.recv(64):
                s.sendall(data)
        elif mode == b"s":
            counter = [0]
            with _lock:
                _counters.setdefault(_recv_exact(s, 8), []).append(counter)
            buf = bytearray(1 << 20)
            while n := s.recv_into(buf):
                counter[0] += n
        elif mode == b"q":
            session = _recv_exact(s, 8)
            with _lock:
                total = sum(c[0] for c in _counters.get(session, []))
            s.sendall(struct.pack("!Q", total))
    except OSError:
        pass
    finally:
        s.close()


def serve(port: int) -> None:
    srv = socket.create_server(("0.0.0.0", port), backlog=128)
    print("ready", flush=True)
    while True:
        s, _ = srv.accept()
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_serve_one, args=(s,), daemon=True).start()


def _connect(addr: str, timeout: float = 10.0) -> socket.socket:
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def rtt(addr: str, count: int, timeout: float) -> dict:
    s = _connect(addr, timeout)
    s.sendall(b"e")
    times = []
    for _ in range(count + 1):
        t0 = time.perf_counter()
        s.sendall(b"x")
        _recv_exact(s, 1)
        times.append((time.perf_counter() - t0) * 1e3)
    times = times[1:]  # the first may include the server thread starting
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "count": count}


def _query(addr: str, session: bytes) -> tuple[float, int]:
    with _connect(addr) as q:
        q.sendall(b"q" + session)
        total = struct.unpack("!Q", _recv_exact(q, 8))[0]
    return time.perf_counter(), total


def stream(addr: str, streams: int, seconds: float, warmup: float) -> dict:
    session = os.urandom(8)
    payload = memoryview(bytearray(1 << 20))
    socks = [_connect(addr) for _ in range(streams)]

    def pump(s: socket.socket) -> None:
        try:
            s.sendall(b"s" + session)
            s.settimeout(None)
            while True:
                s.sendall(payload)
        except OSError:
            pass

    for s in socks:
        threading.Thread(target=pump, args=(s,), daemon=True).start()
    time.sleep(warmup)
    t1, b1 = _query(addr, session)
    time.sleep(seconds)
    t2, b2 = _query(addr, session)
    return {"streams": streams, "seconds": t2 - t1, "bytes": b2 - b1, "bits_per_s": (b2 - b1) * 8 / (t2 - t1)}


def watch(addr: str, seconds: float) -> dict:
    """One live connection: a byte every 50 ms; when each echo came back (seconds from the
    start), and how the connection ended if it did. Shows a fault cutting it and healing."""
    s = _connect(addr)
    s.sendall(b"e")
    s.settimeout(None)
    print("ready", flush=True)
    start = time.perf_counter()
    echoes: list[float] = []
    outcome: dict = {}

    def read() -> None:
        try:
            while s.recv(64):
                echoes.append(time.perf_counter() - start)
            outcome["error"] = "closed"
        except OSError as e:
            outcome["error"] = type(e).__name__
        outcome["error_at"] = time.perf_counter() - start

    threading.Thread(target=read, daemon=True).start()
    try:
        while time.perf_counter() - start < seconds and "error" not in outcome:
            s.sendall(b"x")
            time.sleep(0.05)
    except OSError as e:
        outcome.setdefault("error", type(e).__name__)
        outcome.setdefault("error_at", time.perf_counter() - start)
    return {"echoes": echoes, **outcome}


def main(argv: list[str]) -> None:
    if argv[:1] == ["serve"]:
        serve(int(argv[1]))
    elif argv[:1] == ["rtt"]:
        print(json.dumps(rtt(argv[1], int(argv[2]), float(argv[3]))), flush=True)
    elif argv[:1] == ["watch"]:
        print(json.dumps(watch(argv[1], float(argv[2]))), flush=True)
        os._exit(0)
    elif argv[:1] == ["stream"]:
        print(json.dumps(stream(argv[1], int(argv[2]), float(argv[3]), float(argv[4]))), flush=True)
        os._exit(0)  # the pumping threads are blocked in sendall
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
