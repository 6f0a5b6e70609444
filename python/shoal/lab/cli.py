"""``shoal lab``: build a WAN on this machine and run things in it (root; see docs/lab.md).

  shoal lab up two-sites                 # or three-continents, long-fat-pipe, or a spec.json
  shoal lab exec a1 shoal master --listen 10.77.0.1:48148
  shoal lab fault partition b1           # b1 from every other host; or: fault reset a1 b2
  shoal lab heal
  shoal lab down
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional, Sequence

from .lab import DEFAULT_TTL_S, FAULT_KINDS, Lab, LabError, names, remove
from .profiles import PROFILES
from .spec import SpecError, load


def main(argv: Optional[Sequence[str]] = None) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--name", default=os.environ.get("SHOAL_LAB", "shoal"),
                        help="lab name, so that several can coexist (default $SHOAL_LAB or 'shoal')")
    parser = argparse.ArgumentParser(prog="shoal lab", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("profiles", help="list the named topologies")
    up = sub.add_parser("up", parents=[common], help="build a lab (removing an earlier one of the same name)")
    up.add_argument("spec", help=f"a profile ({', '.join(PROFILES)}) or a JSON spec file")
    up.add_argument("--subnet", default="10.77.0.0/24", help="IPv4 subnet for the hosts (default 10.77.0.0/24)")
    up.add_argument("--rate", help="every host's link cap, both directions, e.g. 100mbit, 1gbit")
    up.add_argument("--window", help="TCP receive-buffer cap inside every host, e.g. 640K")
    up.add_argument("--uplink", help="every site's link to the others, both directions, shared by all its flows, "
                                     "e.g. 300mbit")
    up.add_argument("--loss", type=float, help="probability each packet a host receives is dropped")
    up.add_argument("--rtt", type=float, help="round-trip ms between every two sites")
    up.add_argument("--hosts", type=int, help="this many hosts, dealt over the spec's sites in turn (e.g. 64)")
    up.add_argument("--ttl", type=float, default=DEFAULT_TTL_S, help=f"helpers end after this many seconds "
                                                                     f"(default {DEFAULT_TTL_S})")
    down = sub.add_parser("down", parents=[common], help="remove a lab")
    down.add_argument("--all", action="store_true", help="remove every lab on this machine")
    status = sub.add_parser("status", parents=[common], help="hosts, RTTs, faults and helpers of a lab")
    status.add_argument("--json", action="store_true")
    ex = sub.add_parser("exec", parents=[common], help="run a command inside a host")
    ex.add_argument("host")
    ex.add_argument("cmd", nargs=argparse.REMAINDER)
    fault = sub.add_parser("fault", parents=[common], help="break the path between two hosts, or one and all others")
    fault.add_argument("kind", choices=FAULT_KINDS)
    fault.add_argument("a")
    fault.add_argument("b", nargs="?")
    fault.add_argument("--probability", type=float, default=0.05, help="for loss (default 0.05)")
    fault.add_argument("--rate", help="for slow: what the path carries each way, e.g. 100mbit")
    heal = sub.add_parser("heal", parents=[common], help="remove faults: all, a host's, or a pair's")
    heal.add_argument("a", nargs="?")
    heal.add_argument("b", nargs="?")
    measure = sub.add_parser("measure", parents=[common], help="TCP RTT and throughput from one host to another")
    measure.add_argument("a")
    measure.add_argument("b")
    measure.add_argument("--streams", default="1,16", help="parallel streams to try (default 1,16)")
    measure.add_argument("--seconds", type=float, default=3.0)
    proxy = sub.add_parser("proxy", parents=[common], help="a toxiproxy proxy inside a host (connection faults)")
    proxy.add_argument("host")
    proxy.add_argument("proxy", help="the proxy's name")
    proxy.add_argument("port", type=int, help="port it listens on, in that host")
    proxy.add_argument("upstream", help="ADDR:PORT it forwards to")
    toxic = sub.add_parser("toxic", parents=[common], help="add (or --remove) a toxic on a proxy")
    toxic.add_argument("host")
    toxic.add_argument("proxy")
    toxic.add_argument("type", help="latency, bandwidth, reset_peer, timeout, slicer, limit_data, slow_close, ...")
    toxic.add_argument("attributes", nargs="*", help="KEY=NUMBER, e.g. latency=100 jitter=10")
    toxic.add_argument("--stream", choices=["upstream", "downstream"], default="downstream")
    toxic.add_argument("--toxicity", type=float, default=1.0)
    toxic.add_argument("--remove", action="store_true", help="remove the toxic named TYPE instead")

    args = parser.parse_args(argv)
    try:
        _dispatch(args)
    except (LabError, SpecError) as e:
        raise SystemExit(f"shoal lab: {e}")


def _dispatch(args: argparse.Namespace) -> None:
    if args.command == "profiles":
        for name, p in PROFILES.items():
            print(f"{name:18} {p['description']}")
    elif args.command == "up":
        lab = Lab.up(load(args.spec), name=args.name, subnet=args.subnet, ttl=args.ttl, rate=args.rate,
                     window=args.window, loss=args.loss, rtt=args.rtt, uplink=args.uplink, hosts=args.hosts)
        _print_status(lab)
        print(f"\nrun in a host: shoal lab exec{_flag(args.name)} {lab.hosts[0]} CMD...    remove: shoal lab down"
              f"{_flag(args.name)}")
    elif args.command == "down":
        for name in names() if args.all else [args.name]:
            remove(name)
            print(f"removed lab {name}")
    elif args.command == "status":
        lab = Lab(args.name)
        print(json.dumps(lab.status(), indent=1)) if args.json else _print_status(lab)
    elif args.command == "exec":
        if not args.cmd:
            raise LabError("exec needs a command")
        argv = Lab(args.name).argv(args.host, args.cmd)
        os.execvp(argv[0], argv)
    elif args.command == "fault":
        Lab(args.name).fault(args.kind, args.a, args.b, probability=args.probability, rate=args.rate)
    elif args.command == "heal":
        print(f"removed {Lab(args.name).heal(args.a, args.b)} fault(s)")
    elif args.command == "measure":
        lab = Lab(args.name)
        r = lab.measure_rtt(args.a, args.b)
        print(f"rtt {args.a} -> {args.b}: median {r['median_ms']:.2f} ms "
              f"(min {r['min_ms']:.2f}, max {r['max_ms']:.2f}; "
              f"target {lab.spec.rtt(args.a, args.b):.1f})")
        for n in (int(s) for s in args.streams.split(",")):
            t = lab.measure_throughput(args.a, args.b, n, args.seconds)
            print(f"{n:3} stream(s): {t['bits_per_s'] / 1e6:8.1f} Mbit/s")
    elif args.command == "proxy":
        print(Lab(args.name).proxy(args.host, args.proxy, args.port, args.upstream))
    elif args.command == "toxic":
        lab = Lab(args.name)
        if args.remove:
            lab.untoxic(args.host, args.proxy, args.type)
            return
        attributes = {}
        for kv in args.attributes:
            key, _, value = kv.partition("=")
            try:
                attributes[key] = int(value)
            except ValueError:
                raise LabError(f"bad toxic attribute {kv!r}: expected KEY=INTEGER") from None
        print(lab.toxic(args.host, args.proxy, args.type, stream=args.stream, toxicity=args.toxicity, **attributes))


def _flag(name: str) -> str:
    return "" if name == "shoal" else f" --name {name}"


def _print_status(lab: Lab) -> None:
    st = lab.status()
    print(f"lab {lab.name}: {len(lab.hosts)} hosts, helpers end in {max(0, st['expires'] - time.time()) / 60:.0f} min")
    print(f"  {'host':10} {'site':6} {'address':15} {'rate':>10} {'window':>9} {'loss':>6}")
    for name, h in st["hosts"].items():
        rate = f"{h['rate'] / 1e6:g}Mbit" if h["rate"] else "-"
        print(f"  {name:10} {h['site']:6} {h['address']:15} {rate:>10} {h['window'] or '-':>9} {h['loss'] or '-':>6}")
    # By site pair where every host pair of the two sites has one RTT; else pair by pair.
    by_sites: dict[tuple[str, ...], dict[float, list[str]]] = {}
    for i, a in enumerate(lab.hosts):
        for b in lab.hosts[i + 1:]:
            sites = tuple(sorted({lab.spec.host(a).site, lab.spec.host(b).site}))
            by_sites.setdefault(sites, {}).setdefault(lab.spec.rtt(a, b), []).append(f"{a}-{b}")
    rtts = []
    for sites, values in by_sites.items():
        single = [("-".join(sites), ms) for ms in values] if len(values) == 1 else []
        rtts += [f"{name} {ms:g}" for name, ms in single or [(p, ms) for ms, ps in values.items() for p in ps] if ms]
    print("  rtt (ms): " + "  ".join(rtts))
    for nat, n in st["nats"].items():
        print(f"  NAT {nat} at {n['address']} (site {n['site']}, LAN {n['lan']}): {' '.join(n['hosts'])}")
    if st["uplinks"]:
        caps = (f"{site} {bits / 1e6:g}Mbit" if bits else f"{site} -" for site, bits in st["uplinks"].items())
        print("  site uplinks: " + "  ".join(caps))
    for f in st["faults"]:
        detail = f" p={f['probability']}" if f["probability"] else ""
        detail += f" {f['rate'] / 1e6:g} Mbit/s" if f.get("rate") else ""
        print(f"  fault: {f['kind']} {f['a']} {f['b']}{detail}")
    dead = [f"{h['kind']} in {h['host']}" for h in st["helpers"] if not h["alive"]]
    if dead:
        print(f"  ended helpers (time-to-live, or killed): {', '.join(dead)}", file=sys.stderr)


if __name__ == "__main__":
    main()
