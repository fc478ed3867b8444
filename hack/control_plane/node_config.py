"""Configuration files of the real node's containerd, kubelet, kube-proxy and CNI network.

Paths in them are the standard ones (/var/lib/kubelet, /run/containerd, ...): the node runs in a mount
namespace of its own where those paths are bind mounts of the node's directories (see node.SHADOWED_DIRS).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from . import network, versions

CONTAINERD_SOCKET = "/run/containerd/containerd.sock"
CGROUP_ROOT = "warmstart-node"  # the first node's; each node's cgroup root is its name
CNI_BIN_DIR = "/usr/lib/cni"


def cni_bin_dir() -> str:
    """Debian's CNI plugins, or those of the node's tools folder (versions.node_tools_root)."""
    root = versions.node_tools_root()
    return str(root / "usr/lib/cni") if root is not None else CNI_BIN_DIR


CLUSTER_DOMAIN = "cluster.local"


def containerd_toml() -> str:
    # restrict_oom_score_adj: without CAP_SYS_RESOURCE (withheld on some VMs even from root) runc cannot lower
    # a container's oom_score_adj and every sandbox fails to start.
    return f"""\
version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
oom_score = 0
disabled_plugins = [
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs",
]

[grpc]
  address = "{CONTAINERD_SOCKET}"

[ttrpc]
  address = "{CONTAINERD_SOCKET}.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = "/var/lib/containerd/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{versions.PAUSE_IMAGE}"
  disable_apparmor = true
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "/run/containerd/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin_dir()}"
    conf_dir = "/etc/cni/net.d"
"""


def cni_conflist(addresses: network.NodeAddresses) -> str:
    bridge = {
        "type": "bridge",
        "bridge": network.POD_BRIDGE,
        "isGateway": True,
        "ipMasq": False,
        # A pod reaching itself through a Service comes back over its own veth.
        "hairpinMode": True,
        "ipam": {
            "type": "host-local",
            "ranges": [[{"subnet": str(addresses.pod_subnet)}]],
            "routes": [{"dst": "0.0.0.0/0"}],
        },
    }
    return json.dumps({"cniVersion": "1.0.0", "name": "warmstart", "plugins": [bridge]}, indent=2) + "\n"


def kubelet_config(
    addresses: network.NodeAddresses,
    ca_cert: Path,
    resolv_conf: Path,
    cgroup_root: str = CGROUP_ROOT,
    taints: tuple[str, ...] = (network.REAL_NODE_LABEL,),
) -> str:
    config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # Kubernetes 1.35 refuses cgroup v1 unless told otherwise (support is announced to end in 1.36).
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        # Every pod cgroup under one root of ours, so teardown finds and removes them all.
        "cgroupRoot": f"/{cgroup_root}",
        "cgroupsPerQOS": True,
        "enforceNodeAllocatable": ["pods"],
        "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCKET}",
        "address": addresses.node_ip,
        "port": network.KUBELET_PORT,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": str(ca_cert)},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "failSwapOn": False,
        # Lowering oom_score_adj needs CAP_SYS_RESOURCE, which some VMs withhold even from root.
        "oomScoreAdj": 0,
        # Images come from the project's build, not a registry: kubelet must never collect them.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        # Absolute floors, not percentages: 2% of a large, nearly full build disk put the node under
        # DiskPressure (no pod scheduled) with gigabytes still free.
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1Gi", "imagefs.available": "1Gi"},
        "serializeImagePulls": False,
        # CoreDNS listens on the node's own address (see corefile()); pods reach it through their bridge.
        "clusterDNS": [addresses.node_ip],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": str(resolv_conf),
        "volumePluginDir": "/var/lib/kubelet/volume-plugins",
        "registerNode": True,
        "registerWithTaints": [{"key": key, "value": "true", "effect": "NoSchedule"} for key in taints],
        "maxPods": 32,
        # A changed Secret or ConfigMap reaches a pod's volume at the pod's next periodic sync: 1 min by
        # default, which a Prometheus picking up a new ServiceMonitor (its generated configuration) waits.
        "syncFrequency": "10s",
        "shutdownGracePeriod": "0s",
    }
    return json.dumps(config, indent=2) + "\n"


# kube-proxy's least interval between two syncs of its rules, for a testbed that measures a cluster with it
# lowered ("100ms"); unset, kube-proxy's default (1 s), as most clusters run it.
MIN_SYNC_ENV = "WARMSTART_KUBE_PROXY_MIN_SYNC"


def proxy_sync() -> dict[str, str]:
    value = os.environ.get(MIN_SYNC_ENV, "").strip()
    if value and not any(digit in value for digit in "123456789"):
        # kube-proxy's config defaulting replaces a zero minSyncPeriod with its 1 s default.
        raise ValueError(
            f"{MIN_SYNC_ENV}={value}: kube-proxy reads a zero minSyncPeriod as its default, 1s; "
            "give a short non-zero duration such as 1ms"
        )
    return {"minSyncPeriod": value} if value else {}


def kube_proxy_config(
    addresses: network.NodeAddresses, kubeconfig: Path, hostname: str = network.NODE_NAME
) -> str:
    zero = "0s"
    config = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": hostname,
        "mode": "nftables",
        # Masquerading every Service connection lets a pod reach a Service whose endpoint shares its bridge
        # without br_netfilter (a module and sysctls global to the machine).
        "nftables": {"masqueradeAll": True, **proxy_sync()},
        "clusterCIDR": str(addresses.pod_subnet),
        "metricsBindAddress": "127.0.0.1:10249",
        "healthzBindAddress": "127.0.0.1:10256",
        "oomScoreAdj": 0,
        # Zeros leave the machine-wide conntrack sysctls alone.
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": zero,
            "tcpCloseWaitTimeout": zero,
            "udpTimeout": zero,
            "udpStreamTimeout": zero,
        },
    }
    return json.dumps(config, indent=2) + "\n"


def resolv_conf() -> str:
    # For the node's own processes and pods with dnsPolicy Default: no resolver, so a lookup fails at once.
    return "nameserver 127.0.0.1\noptions ndots:1 attempts:1 timeout:1\n"


def corefile(addresses: network.NodeAddresses, kubeconfig: Path) -> str:
    """The cluster's DNS: Services and pods of `cluster.local` (and their reverse names) from the apiserver;
    every other name is answered NXDOMAIN at once, so nothing is ever forwarded off the node."""
    return (
        f"{CLUSTER_DOMAIN}:53 in-addr.arpa:53 ip6.arpa:53 {{\n"
        f"    bind {addresses.node_ip}\n"
        "    errors\n"
        f"    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{\n"
        f"        kubeconfig {kubeconfig}\n"
        "        pods insecure\n"
        "        ttl 5\n"
        "    }\n"
        "}\n"
        ".:53 {\n"
        f"    bind {addresses.node_ip}\n"
        "    template ANY ANY {\n"
        "        rcode NXDOMAIN\n"
        "    }\n"
        "}\n"
    )
