"""Peers behind NAT (``docs/nat.md``), in the lab's ``behind-nat`` profile: the master on a
public host, peers on the other public host and on two hosts behind one NAT router (which lets
nothing in). The master probes each newcomer's data port when it joins; a member that cannot be
dialed opens its links to the members that can itself (a reverse dial), and reaches the members
behind its own NAT on their LAN. Needs root (see test_lab.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import need_lab, run_peers
from test_all_reduce import check_matrix
from worker import inputs

from shoal.lab import PROFILES, Lab

HOSTS = ["a2", "c1", "c2"]  # one public, two behind the campus NAT


@pytest.fixture(scope="module")
def nat():
    need_lab()
    with Lab.up(PROFILES["behind-nat"], name=f"t{os.getpid()}z", subnet="10.213.0.0/24", ttl=900) as lab:
        yield lab


def test_peers_behind_a_nat_are_admitted_and_every_all_reduce_matches_numpy(nat, tmp_path):
    with nat.master("a1") as master:
        infos = run_peers(master, tmp_path, "matrix", 3, timeout=180, launch=lambda i, argv: nat.argv(HOSTS[i], argv),
                          connections=2, chunk_bytes=4096)
    check_matrix(infos, tmp_path)


def test_links_behind_a_nat_are_dialed_in_reverse_and_the_lan_directly(nat, tmp_path):
    with nat.master("a1") as master:
        out = run_peers(master, tmp_path, "links", 3, timeout=120, launch=lambda i, argv: nat.argv(HOSTS[i], argv))
    host_of = {o["rank"]: HOSTS[o["index"]] for o in out}
    for o in out:
        here = HOSTS[o["index"]]
        # One-shot links every member to every other, whoever can be dialed.
        (_, links), _ = o["after_oneshot"]
        got = {link["rank"]: (link["path"], link["dialable"]) for link in links}
        want = {}
        for rank, there in host_of.items():
            if rank != o["rank"]:
                behind = there != "a2"
                # Between a public host and one behind the NAT, the one behind opens both halves.
                want[rank] = ("reverse" if (here == "a2") != (there == "a2") else "direct", not behind)
        assert got == want, (here, got, want)
        assert all(link["streams_out"] and link["streams_in"] for link in links), links


def test_every_verb_and_tagged_transfers_cross_the_nat(nat, tmp_path):
    launch = lambda i, argv: nat.argv(HOSTS[i], argv)  # noqa: E731
    with nat.master("a1") as master:
        verbs = run_peers(master, tmp_path, "verbs", 3, timeout=180, launch=launch)
        p2p = sorted(run_peers(master, tmp_path, "p2p", 3, timeout=180, launch=launch, apart=True),
                     key=lambda r: r["rank"])
    by_rank = {i["rank"]: np.load(tmp_path / f"peer{k}.npz") for k, i in enumerate(verbs)}
    want = np.concatenate([inputs("float32", "sum", r) for r in range(3)])
    assert all(by_rank[r]["gather/float32"].tobytes() == want.tobytes() for r in range(3))
    for r in p2p:
        # Around the ring, a receive from any member (which the member behind the NAT opens to
        # every sender that can be dialed), several sends with one tag in order.
        assert r["ok"], r
        assert r["back"] == [[0] * 3, [1] * 3, [2] * 3], r
    assert p2p[0]["senders"] == {"1": [10, 11], "2": [20, 21]}, p2p[0]
