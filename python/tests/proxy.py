"""A fault-injecting TCP proxy for tests: forwards every connection accepted on ``address`` to
``upstream``, and on command adds latency, stops forwarding (a blackholed path: connections stay
open, bytes go nowhere), or resets every connection (RST)."""

from __future__ import annotations

import socket
import struct
import threading
import time


class Proxy:
    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.latency = 0.0
        self.blackhole = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self._listener.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def reset_all(self) -> None:
        """Resets every open connection on both sides."""
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._listener.close()
        self.reset_all()

    def _accept(self) -> None:
        while not self._closed:
            try:
                down, _ = self._listener.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(self.upstream)
            except OSError:
                # The upstream is gone (a killed peer): the connection is refused, as it would be.
                down.close()
                continue
            for s in (down, up):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed:
                    down.close()
                    up.close()
                    return
                self._conns += [down, up]
            threading.Thread(target=self._pump, args=(down, up), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                # A blackholed path holds what it read and forwards nothing until healed.
                while self.blackhole.is_set():
                    time.sleep(0.01)
                if self.latency:
                    time.sleep(self.latency)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
