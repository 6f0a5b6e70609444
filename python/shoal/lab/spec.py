"""What a lab is made of: hosts in sites, round-trip times, link caps, windows and loss.

A spec is written as a small dict (a JSON file for ``shoal lab up FILE``, or a named profile)::

    {
      "hosts": {"a1": {"site": "a"}, "a2": {"site": "a"}, "b1": {"site": "b", "rate": "100mbit", "rtt": 5}},
      "rtt": {"a": 1, "b": 1, "a-b": 40, "a2-b1": 60},   # ms: inside a site, between sites, pairs
      "rate": "1gbit",        # every host's link, both directions (htb); a host's own wins
      "window": 655360,       # TCP receive-buffer cap (bytes) inside every host; ditto
      "loss": 0.0,            # probability each packet a host receives is dropped; ditto
      "uplink": "300mbit",    # or {"a": "300mbit", ...}: each site's link to the others (htb both
                              # ways), shared by every flow leaving or entering the site
      "nat": {"home": {}}     # NAT routers; a host with "nat": "home" sits behind that one
    }

A pair of hosts gets the RTT named for the pair, else the one between (or inside) their sites,
else none; plus each host's own ``rtt`` (its access link: added to every path it is on). A host
without a site is a site of its own. Everything is checked here, before anything is built.

A host behind a NAT router (``"nat": "NAME"``) has a private address on the router's own LAN
(``172.16.K.0/24``); the router has a public one on the lab's subnet, masquerades what its hosts
send, and lets in only what answers it (no port forwarding, no inbound connection). Hosts behind
one router reach each other on their LAN; everyone else sees them all at the router's address
(``Spec.seen``). A router takes the site of its hosts, which must share one, and every other host
must be as far from each of them (a per-host ``rtt`` or a pair's RTT that sets them apart is
refused): the lab delays packets by the address they come from.
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Union

HOST_NAME = re.compile(r"^[a-z][a-z0-9]{0,9}$")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit)$")
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_SIZE = re.compile(r"^(\d+)\s*([kmg]?)i?b?$")
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


class SpecError(ValueError):
    """A lab spec names something wrong; the message says what."""


def parse_rate(text: Union[str, int]) -> int:
    """``"1gbit"``, ``"250mbit"`` (tc's units) or bits per second -> bits per second."""
    if isinstance(text, int):
        bits = text
    else:
        m = _RATE.match(str(text).strip().lower())
        if not m:
            raise SpecError(f"bad rate {text!r}: expected e.g. 100mbit, 1gbit")
        bits = int(float(m.group(1)) * _RATE_UNITS[m.group(2)])
    if bits < 8000:
        raise SpecError(f"rate {text!r} is below 8 kbit/s")
    return bits


def parse_size(text: Union[str, int]) -> int:
    """``"640K"``, ``"4M"`` or bytes -> bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text).strip().lower())
    if not m:
        raise SpecError(f"bad size {text!r}: expected bytes or e.g. 640K, 4M")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2)]


@dataclass(frozen=True)
class Host:
    name: str
    site: str
    address: str  # the one it binds and advertises: private behind a NAT
    rate: Optional[int]  # bits/s, both directions
    window: Optional[int]  # bytes: tcp_rmem max
    loss: float
    rtt: float = 0.0  # ms added to every path this host is on
    nat: Optional[str] = None  # the router it sits behind


@dataclass(frozen=True)
class Nat:
    """A NAT router: masquerades its hosts' traffic behind ``address``, lets in only replies."""

    name: str
    site: str
    address: str  # public, on the lab's subnet
    lan: str  # its hosts' subnet, e.g. 172.16.1.0/24; the router is .1 on it
    hosts: tuple[str, ...]

    @property
    def gateway(self) -> str:
        return str(next(ipaddress.ip_network(self.lan).hosts()))


@dataclass
class Spec:
    hosts: list[Host]
    rtt_ms: dict[frozenset, float] = field(default_factory=dict)  # {a, b} or {a} (same host/site)
    uplinks: dict[str, Optional[int]] = field(default_factory=dict)  # site -> bits/s; empty: one bridge
    nats: list[Nat] = field(default_factory=list)

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise SpecError(f"no host {name!r} in this lab (hosts: {', '.join(h.name for h in self.hosts)})")

    def nat(self, name: str) -> Nat:
        for n in self.nats:
            if n.name == name:
                return n
        raise SpecError(f"no NAT router {name!r} in this lab")

    def public(self, name: str) -> str:
        """The address the rest of the lab sees host ``name`` at: its own, or its router's."""
        h = self.host(name)
        return self.nat(h.nat).address if h.nat else h.address

    def seen(self, at: str, other: str) -> str:
        """The address host ``at`` sees packets from host ``other`` come from, and sends its own
        to: ``other``'s own on a shared LAN (the lab's public one, or a NAT's), else its public
        one."""
        return self.host(other).address if self.host(at).nat == self.host(other).nat else self.public(other)

    def rtt(self, a: str, b: str) -> float:
        """Added round-trip time in ms between hosts ``a`` and ``b``."""
        ha, hb = self.host(a), self.host(b)
        path = 0.0
        for key in (frozenset((a, b)), frozenset((ha.site, hb.site))):
            if key in self.rtt_ms:
                path = self.rtt_ms[key]
                break
        return path + ha.rtt + hb.rtt

    def to_dict(self) -> dict[str, Any]:
        return {
            "hosts": {h.name: {"site": h.site, "address": h.address, "rate": h.rate, "window": h.window, "loss": h.loss,
                               "rtt": h.rtt, "nat": h.nat} for h in self.hosts},
            "rtt": {"-".join(sorted(k)): v for k, v in self.rtt_ms.items()},
            "uplink": self.uplinks,
            "nat": {n.name: {"site": n.site, "address": n.address, "lan": n.lan, "hosts": list(n.hosts)}
                    for n in self.nats},
        }


def build(raw: dict[str, Any], subnet: str = "10.77.0.0/24", **overrides: Any) -> Spec:
    """Checks a spec dict and assigns addresses in ``subnet`` (hosts get .1, .2, ... in order).
    ``overrides`` (``rate``, ``window``, ``loss``, ``rtt`` between sites) win over the dict's
    lab-wide values; ``hosts=N`` grows or shrinks the lab to N hosts (``scaled``)."""
    raw = json.loads(json.dumps(raw))  # a deep copy that also proves it is plain data
    if overrides.get("hosts") is not None:
        raw = scaled(raw, overrides["hosts"])
    unknown = set(raw) - {"hosts", "rtt", "rate", "window", "loss", "uplink", "nat", "description"}
    if unknown:
        raise SpecError(f"unknown spec keys: {', '.join(sorted(unknown))}")
    for key in ("rate", "window", "loss", "uplink"):
        if overrides.get(key) is not None:
            raw[key] = overrides[key]
    hosts_raw = raw.get("hosts")
    if not isinstance(hosts_raw, dict) or not hosts_raw:
        raise SpecError("a spec needs a non-empty 'hosts' mapping")
    try:
        net = ipaddress.ip_network(subnet)
    except ValueError as e:
        raise SpecError(f"bad subnet {subnet!r}: {e}") from None
    if net.version != 4 or net.num_addresses - 2 < len(hosts_raw):
        raise SpecError(f"subnet {subnet} has no room for {len(hosts_raw)} IPv4 hosts")
    addresses = iter(net.hosts())

    hosts = []
    for name, h in hosts_raw.items():
        if not HOST_NAME.match(name) or name == "switch":
            raise SpecError(f"bad host name {name!r}: 1-10 lowercase letters and digits, starting with a letter")
        h = h or {}
        if not isinstance(h, dict):
            raise SpecError(f"host {name}: expected a mapping of its settings, not {h!r}")
        extra = set(h) - {"site", "rate", "window", "loss", "rtt", "nat"}
        if extra:
            raise SpecError(f"host {name}: unknown keys {', '.join(sorted(extra))}")
        site = h.get("site", name)
        if not isinstance(site, str) or not HOST_NAME.match(site):
            raise SpecError(f"host {name}: bad site {site!r}: 1-10 lowercase letters and digits, "
                            "starting with a letter")
        rate = h.get("rate", raw.get("rate"))
        window = h.get("window", raw.get("window"))
        loss = h.get("loss", raw.get("loss")) or 0.0
        if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not 0.0 <= loss < 1.0:
            raise SpecError(f"host {name}: loss {loss!r} is not a probability in [0, 1)")
        nat = h.get("nat")
        if nat is not None and nat not in (raw.get("nat") or {}):
            raise SpecError(f"host {name}: no NAT router {nat!r} in the spec's 'nat' mapping")
        address = "" if nat else str(next(addresses))  # behind a NAT: on its LAN, below
        hosts.append(Host(name, site, address, parse_rate(rate) if rate is not None else None,
                          parse_size(window) if window is not None else None, float(loss),
                          _ms(f"host {name}: rtt", h.get("rtt", 0)), nat))
    hosts, nats = _nats(raw.get("nat") or {}, hosts, addresses)
    spec = Spec(hosts, nats=nats)
    uplink = raw.get("uplink")
    if uplink is not None:
        sites = sorted({h.site for h in hosts})
        named = uplink if isinstance(uplink, dict) else {s: uplink for s in sites}
        if not set(named) <= set(sites):
            raise SpecError(f"uplink names sites {', '.join(sorted(set(named) - set(sites)))} this lab lacks")
        spec.uplinks = {s: parse_rate(named[s]) if named.get(s) is not None else None for s in sites}

    names = {h.name for h in hosts} | {h.site for h in hosts}
    rtts = dict(raw.get("rtt") or {})
    if overrides.get("rtt") is not None:  # between every two sites
        sites = sorted({h.site for h in hosts})
        rtts.update({f"{a}-{b}": overrides["rtt"] for i, a in enumerate(sites) for b in sites[i + 1:]})
    for key, ms in rtts.items():
        parts = key.split("-")
        if len(parts) not in (1, 2) or not set(parts) <= names:
            raise SpecError(f"rtt key {key!r}: expected SITE (inside it), SITE-SITE or HOST-HOST of this lab")
        spec.rtt_ms[frozenset(parts)] = _ms(f"rtt {key}", ms)
    for n in nats:  # the lab delays by source address: a router's hosts must look alike
        for o in spec.hosts:
            far = {spec.rtt(h, o.name) for h in n.hosts if h != o.name}
            if o.nat != n.name and len(far) > 1:
                raise SpecError(f"NAT {n.name}: its hosts {', '.join(n.hosts)} are not equally far from {o.name} "
                                f"({', '.join(f'{ms:g}' for ms in sorted(far))} ms); the rest of the lab sees them "
                                "at one address")
    return spec


def _nats(raw: dict[str, Any], hosts: list[Host], public: Any) -> tuple[list[Host], list[Nat]]:
    """Checks the ``nat`` mapping; gives each router a public address (after the hosts') and a LAN,
    and each host behind one its address there."""
    if not isinstance(raw, dict):
        raise SpecError(f"'nat' must map router names to their settings, not {raw!r}")
    names = {h.name for h in hosts}
    nats, placed = [], {}
    for k, (name, settings) in enumerate(raw.items()):
        if not HOST_NAME.match(name) or name == "switch" or name in names:
            raise SpecError(f"bad NAT router name {name!r}: 1-10 lowercase letters and digits, starting with a "
                            "letter, and no host's")
        if settings not in (None, {}):
            raise SpecError(f"NAT {name}: takes no settings yet, not {settings!r}")
        behind = [h for h in hosts if h.nat == name]
        if not behind:
            raise SpecError(f"NAT {name}: no host sits behind it")
        if len({h.site for h in behind}) > 1:
            sites = ", ".join(sorted({h.site for h in behind}))
            raise SpecError(f"NAT {name}: its hosts are in different sites ({sites})")
        if len(behind) > 250 or k >= 250:
            raise SpecError(f"NAT {name}: too many hosts or routers")
        lan = ipaddress.ip_network(f"172.16.{k + 1}.0/24")
        addresses = iter(list(lan.hosts())[1:])  # .1 is the router
        for h in behind:
            placed[h.name] = str(next(addresses))
        try:
            nats.append(Nat(name, behind[0].site, str(next(public)), str(lan), tuple(h.name for h in behind)))
        except StopIteration:
            raise SpecError(f"the subnet has no room for NAT router {name}") from None
    return [replace(h, address=placed[h.name]) if h.nat else h for h in hosts], nats


def scaled(raw: dict[str, Any], count: int) -> dict[str, Any]:
    """The spec ``raw`` with ``count`` hosts dealt over its sites in turn (in the order the sites
    first appear), named after their site: ``us1 eu1 ap1 us2 ...``. Each new host takes the
    settings of its site's first host; RTTs named for a pair of hosts are dropped."""
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 250:
        raise SpecError(f"hosts: {count!r} is not a number of hosts in [1, 250]")
    hosts_raw = raw.get("hosts")
    if not isinstance(hosts_raw, dict) or not hosts_raw:
        raise SpecError("a spec needs a non-empty 'hosts' mapping")
    first: dict[str, dict[str, Any]] = {}
    for name, h in hosts_raw.items():
        h = dict(h or {})
        first.setdefault(h.get("site", name), h)
    sites = list(first)
    hosts = {}
    for i in range(count):
        site = sites[i % len(sites)]
        hosts[f"{site}{i // len(sites) + 1}"] = dict(first[site], site=site)
    rtts = {k: v for k, v in (raw.get("rtt") or {}).items() if set(k.split("-")) <= set(sites)}
    return dict(raw, hosts=hosts, rtt=rtts)


def _ms(what: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 10_000:
        raise SpecError(f"{what}: {value!r} is not a number of milliseconds in [0, 10000]")
    return float(value)


def load(profile_or_file: str) -> dict[str, Any]:
    """A named profile, or a JSON spec file."""
    from .profiles import PROFILES

    if profile_or_file in PROFILES:
        return PROFILES[profile_or_file]
    path = Path(profile_or_file)
    if not path.is_file():
        raise SpecError(f"{profile_or_file!r} is neither a profile ({', '.join(PROFILES)}) nor a spec file")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SpecError(f"{path}: not JSON: {e}") from None
