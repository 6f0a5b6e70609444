"""The lab's delay program: ``python -m shoal.lab.delay --ttl S [NAMESPACE:]Q=SECONDS ...``.

Holds each packet of netfilter queue Q of network namespace NAMESPACE (a name under
``/run/netns``; without one, its own) for SECONDS (the Rust loop in ``crates/lab``), for at most
``--ttl`` seconds, then accepts what it holds and exits. The lab starts one for all its hosts.
"""

from __future__ import annotations

import argparse
import time
from typing import Optional


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m shoal.lab.delay", description=__doc__.splitlines()[0])
    parser.add_argument("--ttl", type=float, required=True, help="seconds to run")
    parser.add_argument("--max-len", type=int, default=1 << 16, help="packets a queue may hold (more pass at once)")
    parser.add_argument("queues", nargs="+", help="[NAMESPACE:]QUEUE=SECONDS")
    args = parser.parse_args()
    queues: list[tuple[Optional[str], int, float]] = []
    for q in args.queues:
        where, _, rest = q.rpartition(":")
        num, _, delay = rest.partition("=")
        try:
            queues.append((where or None, int(num), float(delay)))
        except ValueError:
            parser.error(f"bad queue {q!r}: expected [NAMESPACE:]QUEUE=SECONDS, e.g. lab-a1:1=0.02")

    from shoal._native import lab_delay

    started = time.monotonic()
    namespaces = len({where for where, _, _ in queues})
    print(f"delay: holding {len(queues)} queues in {namespaces} namespaces for {args.ttl:.0f} s", flush=True)
    packets, max_held = lab_delay(queues, args.ttl, args.max_len)
    elapsed = time.monotonic() - started
    print(f"delay: done after {elapsed:.0f} s: {packets} packets, at most {max_held} held", flush=True)


if __name__ == "__main__":
    main()
