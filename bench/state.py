"""Shared-state figures: hashing speed, a newcomer receiving a large state from several donors,
and the cost of a sync with nothing to repair compared with hashing the state.

    python bench/state.py --mib 256 --donors 3
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np
import shoal


def together(comms, fn):
    out = [None] * len(comms)

    def one(i):
        out[i] = fn(i, comms[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--donors", type=int, default=3)
    parser.add_argument("--tensors", type=int, default=4)
    args = parser.parse_args()
    per = (args.mib << 20) // args.tensors // 4
    n = args.donors + 1

    def state(fill: float) -> shoal.SharedState:
        return shoal.SharedState({f"t{k}": np.full(per, fill, np.float32) for k in range(args.tensors)})

    reference = state(1.5)
    started = time.perf_counter()
    reference.hashes()
    hash_s = time.perf_counter() - started
    print(f"hash {args.mib} MiB: {hash_s * 1e3:.0f} ms ({args.mib / 1024 / hash_s:.2f} GiB/s)")
    # What a sync's vote costs when all n peers share this machine: each hashes its state at once.
    many = [state(1.5) for _ in range(n)]
    started = time.perf_counter()
    together(many, lambda i, s: s.hashes())
    hash_all_s = time.perf_counter() - started
    print(f"hash {args.mib} MiB on {n} peers at once: {hash_all_s * 1e3:.0f} ms")
    del many
    with shoal.Master("127.0.0.1:0") as master:
        comms = [shoal.Communicator(master.address, timeout=120) for _ in range(n)]
        together(comms, lambda i, c: c.connect(timeout=60, min_world_size=n))
        states = [state(1.5) for _ in range(args.donors)] + [state(0.0)]
        infos = together(comms, lambda i, c: c.sync_shared_state(states[i]))
        newcomer = infos[-1]
        moved = newcomer.elapsed - hash_all_s
        print(f"newcomer received {newcomer.received_bytes >> 20} MiB from {len({d for donors in newcomer.received.values() for d in donors})} "
              f"donors: whole sync {newcomer.elapsed * 1e3:.0f} ms ({newcomer.received_bytes / newcomer.elapsed / 1e9:.2f} GB/s), "
              f"after the vote's hashing {moved * 1e3:.0f} ms ({newcomer.received_bytes / moved / 1e9:.2f} GB/s)")
        assert states[-1].hashes() == reference.hashes()
        for s in states:
            s.revision += 1
        infos = together(comms, lambda i, c: c.sync_shared_state(states[i]))
        nothing = max(i.elapsed for i in infos)
        print(f"sync with nothing to repair: {nothing * 1e3:.0f} ms = {nothing / hash_all_s:.2f}x the time the {n} "
              f"peers take to hash their states ({nothing / hash_s:.2f}x one peer hashing alone)")
        for c in comms:
            c.close()


if __name__ == "__main__":
    main()
