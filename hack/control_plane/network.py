"""Addresses of the real node. They exist only inside the two network namespaces the node creates, the
node's and the apiserver's, joined by a veth pair (CNI's bridge and the pods' veths hang off the node's),
so no packet to or from them reaches an interface of the machine itself."""

from __future__ import annotations

import ipaddress

NODE_NAME = "warmstart-node"
# The documentation range (RFC 5737): nothing real is ever numbered from it.
NODE_NETWORK = ipaddress.ip_network("192.0.2.0/24")
NODE_IP = "192.0.2.2"
# Where the node and its pods reach the apiserver (the `kubernetes` Service's endpoint): a gateway listens
# here inside the apiserver's namespace and forwards to the apiserver on the machine's loopback.
API_IP = "192.0.2.1"
NODE_LINK = "node0"
API_LINK = "api0"
POD_BRIDGE = "cni0"
POD_SUBNET = ipaddress.ip_network("10.245.0.0/24")
SERVICE_SUBNET = ipaddress.ip_network("10.0.0.0/24")
KUBELET_PORT = 10250

# Destinations the apiserver may reach through the gateway (kubelets, pods, Services): all inside the node.
GATEWAY_DESTINATIONS = (NODE_NETWORK, POD_SUBNET, SERVICE_SUBNET)
