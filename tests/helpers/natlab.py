"""A small emulated internet in network namespaces: a public network and a home network behind a NAT router.

    public  (11.0.0.0/24, "public" addresses): the peers of a public host, 11.0.0.2
    router  11.0.0.1 on the public side, 192.168.7.1 on the home side; MASQUERADE out of the public side
    home    (192.168.7.0/24, private): peers behind the NAT, 192.168.7.2, default route via the router

The public side has no route to 192.168.7.0/24: a connection from the home network reaches the public host
from 11.0.0.1 (the router), and nothing on the public side can open a connection to the home network, unless
``forward`` adds a port forwarding (DNAT) on the router. Each namespace lives as long as a sleeping holder
process (started through ``Peers``' process groups, so the test's teardown ends it), with veth pairs made inside
them (none is ever left in this namespace). Needs root (CAP_NET_ADMIN), ``unshare``, ``nsenter``, ``ip`` and ``iptables``: ``missing``
says what is not there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from helpers.swarm_util import Peers

PUBLIC_IP, ROUTER_PUBLIC_IP = "11.0.0.2", "11.0.0.1"
HOME_IP, ROUTER_HOME_IP = "192.168.7.2", "192.168.7.1"


def missing() -> str | None:
    """Why the lab cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN) to create network namespaces and veth pairs"
    for tool in ("unshare", "nsenter", "ip", "iptables"):
        if shutil.which(tool) is None:
            extra = " (apt-get install -y iptables)" if tool == "iptables" else ""
            return f"`{tool}` is not installed{extra}"
    for cmd in (["unshare", "-n", "true"], ["unshare", "-n", "iptables", "-t", "nat", "-L", "-n"]):
        try:
            r = subprocess.run(cmd, capture_output=True, timeout=20)
        except subprocess.TimeoutExpired:
            return f"`{' '.join(cmd)}` did not finish in 20 s"
        if r.returncode != 0:
            return f"`{' '.join(cmd)}` failed: {r.stderr.decode(errors='replace').strip()[:200]}"
    return None


class NatLab:
    """The three namespaces; ``start`` runs a command in one of them as a peer of ``peers``."""

    def __init__(self, peers: Peers):
        self.peers = peers
        self.holders = {name: peers.start(f"ns-{name}", ["unshare", "-n", "sleep", "infinity"], module="")
                        for name in ("public", "router", "home")}
        self._links()

    def ns(self, name: str) -> list[str]:
        return ["nsenter", f"--net=/proc/{self.holders[name].pid}/ns/net"]

    def sh(self, name: str, *cmd: str) -> None:
        subprocess.run([*self.ns(name), *cmd], check=True, capture_output=True, timeout=20)

    def _links(self) -> None:
        for a, b in (("public", "router"), ("home", "router")):  # made inside the lab: nothing shows up here
            self.sh(a, "ip", "link", "add", f"v{a[:3]}", "type", "veth", "peer", "name", f"v{a[:3]}r",
                    "netns", str(self.holders[b].pid))
        for name, dev, addr in (("public", "vpub", f"{PUBLIC_IP}/24"), ("router", "vpubr", f"{ROUTER_PUBLIC_IP}/24"),
                                ("router", "vhomr", f"{ROUTER_HOME_IP}/24"), ("home", "vhom", f"{HOME_IP}/24")):
            self.sh(name, "ip", "addr", "add", addr, "dev", dev)
            self.sh(name, "ip", "link", "set", dev, "up")
        for name in self.holders:
            self.sh(name, "ip", "link", "set", "lo", "up")
        self.sh("home", "ip", "route", "add", "default", "via", ROUTER_HOME_IP)
        self.sh("router", "sysctl", "-qw", "net.ipv4.ip_forward=1")
        self.sh("router", "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "vpubr", "-j", "MASQUERADE")

    def forward(self, port: int) -> None:
        """Port forwarding on the router: TCP ``port`` of its public address goes to the home host."""
        self.sh("router", "iptables", "-t", "nat", "-A", "PREROUTING", "-i", "vpubr", "-p", "tcp", "--dport", str(port),
                "-j", "DNAT", "--to-destination", f"{HOME_IP}:{port}")

    def start(self, name: str, where: str, args: list[str]) -> subprocess.Popen:
        """``p2prl <args>`` in namespace ``where``, logging to the peers' ``<name>.log``."""
        return self.peers.start(name, [*self.ns(where), sys.executable, "-m", "p2prl.cli", *args], module="")
