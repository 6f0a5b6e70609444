"""Named lab topologies to start from (``shoal lab up NAME``); see ``spec.py`` for the format.
Rates, windows, loss, the RTT between sites and the number of hosts (``--hosts 64``, dealt over
the sites in turn) can be changed at ``up`` time."""

from __future__ import annotations

from typing import Any

PROFILES: dict[str, dict[str, Any]] = {
    "two-sites": {
        "description": "2+2 hosts: 1 ms inside a site, 40 ms between the sites, 1 Gbit/s links",
        "hosts": {"a1": {"site": "a"}, "a2": {"site": "a"}, "b1": {"site": "b"}, "b2": {"site": "b"}},
        "rtt": {"a": 1, "b": 1, "a-b": 40},
        "rate": "1gbit",
    },
    "three-continents": {
        "description": "2 hosts in each of 3 sites: 20, 80 and 150 ms between them, 1 ms inside, 1 Gbit/s links",
        "hosts": {
            "us1": {"site": "us"}, "us2": {"site": "us"},
            "eu1": {"site": "eu"}, "eu2": {"site": "eu"},
            "ap1": {"site": "ap"}, "ap2": {"site": "ap"},
        },
        # Not a metric on purpose, like the internet: ap-us (150) is slower than ap-eu-us (100),
        # so the order of a ring matters.
        "rtt": {"us": 1, "eu": 1, "ap": 1, "eu-ap": 20, "us-eu": 80, "us-ap": 150},
        "rate": "1gbit",
    },
    "world": {
        "description": "2 hosts in each of 5 cloud regions (us-east, us-west, eu, ap, sa), round trips between "
                       "them as public clouds measure them (62-255 ms), 1 ms inside, 1 Gbit/s links; grow it "
                       "with --hosts",
        "hosts": {f"{site}{i}": {"site": site} for i in (1, 2) for site in ("use", "usw", "eu", "ap", "sa")},
        # Rounded medians between public cloud regions (Virginia, Oregon, Frankfurt, Tokyo, Sao Paulo).
        "rtt": {"use": 1, "usw": 1, "eu": 1, "ap": 1, "sa": 1,
                "use-usw": 62, "use-eu": 88, "use-ap": 145, "use-sa": 115,
                "usw-eu": 145, "usw-ap": 100, "usw-sa": 175,
                "eu-ap": 225, "eu-sa": 200, "ap-sa": 255},
        "rate": "1gbit",
    },
    "behind-nat": {
        "description": "2 public hosts in site a (the master's first), 1 host behind a home NAT router (site b), 2 "
                       "behind one campus NAT router (site c): 30-50 ms between the sites, 1 ms inside, 1 Gbit/s",
        "hosts": {"a1": {"site": "a"}, "b1": {"site": "b", "nat": "home"}, "c1": {"site": "c", "nat": "campus"},
                  "c2": {"site": "c", "nat": "campus"}, "a2": {"site": "a"}},
        "nat": {"home": {}, "campus": {}},
        "rtt": {"a": 1, "b": 1, "c": 1, "a-b": 30, "a-c": 40, "b-c": 50},
        "rate": "1gbit",
    },
    "long-fat-pipe": {
        "description": "2 hosts 40 ms apart on 1 Gbit/s links, TCP windows capped at 640 KiB (~100 Mbit/s per flow)",
        "hosts": {"x": {}, "y": {}},
        "rtt": {"x-y": 40},
        "rate": "1gbit",
        "window": 655360,
    },
}
