"""The ``shoal`` command: ``shoal master``, ``shoal status``, ``shoal bench``, ``shoal demo``, ``shoal lab``,
``shoal certs``."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        from . import __version__

        print(f"shoal {__version__}")
        return
    commands = {"master": _master, "status": _status, "bench": _bench, "demo": _demo, "lab": _lab, "certs": _certs}
    if not argv or argv[0] not in commands:
        print("usage: shoal {master,status,bench,demo,lab,certs} [options]  (shoal COMMAND --help for more)",
              file=sys.stderr)
        raise SystemExit(0 if argv[:1] in (["-h"], ["--help"]) else 2)
    commands[argv[0]](argv[1:])


def _master(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="shoal master", description="Run a shoal master in the foreground.")
    parser.add_argument("--listen", default="0.0.0.0:48148", help="HOST:PORT to listen on (default 0.0.0.0:48148)")
    parser.add_argument("--heartbeat-timeout", type=float, default=None,
                        help="seconds a silent peer is tolerated (default: as its heartbeats' gaps say, 7.5-60)")
    parser.add_argument("--secret-file", default=None,
                        help="file holding the run's secret (peers pass it as secret= or SHOAL_SECRET)")
    parser.add_argument("--http", default=None, metavar="ADDR",
                        help="HOST:PORT to serve /metrics, /status and the status page on (SHOAL_HTTP_ADDR)")
    parser.add_argument("--state-dir", default=None, metavar="DIR",
                        help="keep the run here; a master started on it again carries the run on")
    parser.add_argument("--tls-cert", default=None, metavar="PEM",
                        help="the master's certificate: every connection under mutual TLS (SHOAL_TLS_CERT)")
    parser.add_argument("--tls-key", default=None, metavar="PEM", help="its private key (SHOAL_TLS_KEY)")
    parser.add_argument("--tls-ca", default=None, metavar="PEM",
                        help="the run's CA: peers must present a certificate it signed (SHOAL_TLS_CA)")
    args = parser.parse_args(argv)
    import shoal

    secret = None
    if args.secret_file is not None:
        try:
            with open(args.secret_file, encoding="utf-8") as f:
                secret = f.read().removesuffix("\n")
        except OSError as e:
            raise SystemExit(f"shoal master: cannot read the secret file: {e}") from None
    try:
        master = shoal.Master(args.listen, secret=secret, heartbeat_timeout=args.heartbeat_timeout,
                              http_addr=args.http, state_dir=args.state_dir, tls_cert=args.tls_cert,
                              tls_key=args.tls_key, tls_ca=args.tls_ca)
    except ValueError as e:
        raise SystemExit(f"shoal master: {e}") from None
    # The handlers come first: whoever reads the line below may signal at once.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        master.start()
    except OSError as e:
        raise SystemExit(f"shoal master: {e}")
    print(f"shoal master listening on {master.address}", flush=True)
    if master.http_address is not None:
        print(f"status page on http://{master.http_address}/ (metrics: /metrics, JSON: /status)", flush=True)
    while not stop.wait(0.5):
        pass
    master.stop()


def _status(argv: Sequence[str]) -> None:
    from . import status

    status.main(argv)


def _bench(argv: Sequence[str]) -> None:
    from . import bench

    bench.main(argv)


def _demo(argv: Sequence[str]) -> None:
    from . import demo

    demo.main(argv)


def _lab(argv: Sequence[str]) -> None:
    from .lab import cli

    cli.main(argv)


def _certs(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="shoal certs",
        description="Make a run's TLS certificates: its CA (ca.pem, ca.key) and, for each host, HOST.pem and "
                    "HOST.key signed by it. A CA already in the directory signs the new hosts' certificates.")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory to write them to")
    parser.add_argument("--host", action="append", default=[], metavar="HOST", required=True,
                        help="an IP address or DNS name the master or a peer is dialed at (repeat per host)")
    args = parser.parse_args(argv)
    from . import _native

    try:
        ca, new_ca, hosts = _native.make_certs(args.out, args.host)
    except ValueError as e:
        raise SystemExit(f"shoal certs: {e}") from None
    print(f"{'made' if new_ca else 'kept'} the run's CA: {ca}  (give it to every process as SHOAL_TLS_CA; "
          f"keep ca.key private)")
    for host, cert, key in hosts:
        print(f"{host}: SHOAL_TLS_CERT={cert} SHOAL_TLS_KEY={key}")


if __name__ == "__main__":
    main()

