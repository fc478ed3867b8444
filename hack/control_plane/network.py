"""Addresses of the real node. They exist only inside the two network namespaces the node creates, the
node's and the apiserver's, joined by a veth pair (CNI's bridge and the pods' veths hang off the node's),
so no packet to or from them reaches an interface of the machine itself. They are chosen, when the control
plane starts, from ranges that overlap none of the machine's own addresses and routes, so no address the node
uses is ever one of the machine's (documentation ranges are used by some VMs' own interfaces)."""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
from dataclasses import dataclass

NODE_NAME = "warmstart-node"
# The real node's label and taint: only pods that tolerate the taint run there, so the suite's other pods
# (meant for the kwok nodes) never land on it.
REAL_NODE_LABEL = "warmstart.dev/real-node"
# A second real node (for what needs two: a snapshot captured on one node restored on the other) carries the
# real node's label and taint and a taint of its own, so pods meant for the first never land on it.
SECOND_NODE_NAME = "warmstart-node-b"
SECOND_NODE_LABEL = "warmstart.dev/second-node"
NODE_LINK = "node0"
API_LINK = "api0"  # the first node's link on the apiserver's side; the second node's is api1
POD_BRIDGE = "cni0"
SERVICE_SUBNET = ipaddress.ip_network("10.0.0.0/20")  # room for thousands of endpoints' Services
KUBELET_PORT = 10250

NODE_NETWORK_CANDIDATES = ("198.51.100.0/24", "203.0.113.0/24", "10.254.253.0/24", "172.31.253.0/24")
POD_SUBNET_CANDIDATES = ("10.245.0.0/24", "10.246.0.0/24", "172.31.254.0/24", "10.254.254.0/24")


@dataclass(frozen=True)
class NodeAddresses:
    """The node's link network (node .2, apiserver .1) and the pods' subnet."""

    node_network: ipaddress.IPv4Network
    pod_subnet: ipaddress.IPv4Network

    @property
    def node_ip(self) -> str:
        return str(self.node_network.network_address + 2)

    @property
    def api_ip(self) -> str:
        """Where the node and its pods reach the apiserver (the `kubernetes` Service's endpoint): the node's
        gateway listens here in the apiserver's namespace and forwards to the apiserver on loopback."""
        return str(self.node_network.network_address + 1)

    @property
    def gateway_destinations(self) -> tuple[ipaddress.IPv4Network, ...]:
        """What the apiserver may reach through the gateway (kubelet, pods, Services): all inside the node."""
        return (self.node_network, self.pod_subnet, SERVICE_SUBNET)

    def to_json(self) -> dict[str, str]:
        return {"node_network": str(self.node_network), "pod_subnet": str(self.pod_subnet)}

    @classmethod
    def from_json(cls, data: dict[str, str]) -> NodeAddresses:
        return cls(ipaddress.ip_network(data["node_network"]), ipaddress.ip_network(data["pod_subnet"]))  # type: ignore[arg-type]


def machine_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network the machine's own interfaces and routes use (the default route aside); none known
    without iproute2 (and then no real node can start either)."""
    found: list[ipaddress.IPv4Network] = []
    if shutil.which("ip") is None:
        return found
    addresses = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    for line in addresses.splitlines():
        words = line.split()
        if "inet" in words:
            found.append(ipaddress.ip_interface(words[words.index("inet") + 1]).network)
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True, check=True).stdout
    for line in routes.splitlines():
        words = line.split()
        if words and words[0] != "default":
            destination = words[1] if words[0] in ("unreachable", "blackhole", "prohibit") else words[0]
            if destination != "default":
                found.append(ipaddress.ip_network(destination, strict=False))
        if "via" in words:
            found.append(ipaddress.ip_network(words[words.index("via") + 1]))
    return found


def first_free(candidates: tuple[str, ...], taken: list[ipaddress.IPv4Network]) -> ipaddress.IPv4Network:
    for text in candidates:
        candidate = ipaddress.ip_network(text)
        if not any(candidate.overlaps(network) for network in taken):
            return candidate  # type: ignore[return-value]
    raise RuntimeError(f"every candidate range overlaps this machine's networks: {candidates}")


def choose(count: int = 2) -> tuple[NodeAddresses, ...]:
    """Addresses for `count` real nodes: each its own link network and pod subnet, overlapping nothing."""
    taken = [*machine_networks(), SERVICE_SUBNET]
    chosen = []
    for _ in range(count):
        node_network = first_free(NODE_NETWORK_CANDIDATES, taken)
        pod_subnet = first_free(POD_SUBNET_CANDIDATES, [*taken, node_network])
        chosen.append(NodeAddresses(node_network, pod_subnet))
        taken += [node_network, pod_subnet]
    return tuple(chosen)
