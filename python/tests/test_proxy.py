"""The fault-injecting proxy the failure tests stand on must not itself leak or hang."""

import gc
import socket

from proxy import Proxy


def test_a_proxy_whose_upstream_is_gone_refuses_and_leaks_no_socket():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = "127.0.0.1:%d" % s.getsockname()[1]
    proxy = Proxy(dead)
    try:
        for _ in range(3):
            host, port = proxy.address.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=5) as c:
                # The proxy closes what it accepted: the client reads end of stream.
                assert c.recv(1) == b""
    finally:
        proxy.close()
    # Before the fix the accepted socket was dropped unclosed: a ResourceWarning, an error here.
    gc.collect()
