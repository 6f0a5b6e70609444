"""The lab's delay program, run inside a lab host: ``python -m shoal.lab.delay --ttl S Q=SECONDS ...``.

Holds each packet of netfilter queue Q for SECONDS (the Rust loop in ``crates/lab``), for at
most ``--ttl`` seconds, then accepts what it holds and exits. The lab starts one per host.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m shoal.lab.delay", description=__doc__.splitlines()[0])
    parser.add_argument("--ttl", type=float, required=True, help="seconds to run")
    parser.add_argument("--max-len", type=int, default=1 << 16, help="packets a queue may hold (more pass at once)")
    parser.add_argument("queues", nargs="+", help="QUEUE=SECONDS")
    args = parser.parse_args()
    queues = []
    for q in args.queues:
        num, _, delay = q.partition("=")
        try:
            queues.append((int(num), float(delay)))
        except ValueError:
            parser.error(f"bad queue {q!r}: expected QUEUE=SECONDS, e.g. 1=0.02")

    from shoal._native import lab_delay

    started = time.monotonic()
    print(f"delay: holding queues {queues} for {args.ttl:.0f} s", flush=True)
    packets, max_held = lab_delay(queues, args.ttl, args.max_len)
    elapsed = time.monotonic() - started
    print(f"delay: done after {elapsed:.0f} s: {packets} packets, at most {max_held} held", flush=True)


if __name__ == "__main__":
    main()
