"""The control plane's pure logic: go.mod generation, certificates, node objects, waiting."""

from __future__ import annotations

import ipaddress
import json
import shutil
import threading
from pathlib import Path

import pytest
from control_plane import build, host_state, pki, versions
from control_plane.cluster import ControlPlane, fake_gpu_node, node_is_ready, wait_for
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

UPSTREAM_GO_MOD = """\
module k8s.io/kubernetes

go 1.25.0

require (
\tk8s.io/api v0.0.0
\tgithub.com/google/uuid v1.6.0
)

replace (
\tk8s.io/api => ./staging/src/k8s.io/api
\tk8s.io/client-go => ./staging/src/k8s.io/client-go
\tgithub.com/example/fork => github.com/example/fork v1.2.3
)
"""


def test_staging_modules_are_only_the_local_replacements():
    assert build.staging_modules(UPSTREAM_GO_MOD) == ["k8s.io/api", "k8s.io/client-go"]


def test_generated_go_mod_pins_staging_modules_to_the_matching_release():
    generated = build.kubernetes_go_mod(UPSTREAM_GO_MOD)
    staging = versions.staging_version()
    assert f"\tk8s.io/kubernetes v{versions.KUBERNETES}\n" in generated
    assert f"\tk8s.io/api => k8s.io/api {staging}\n" in generated
    assert f"\tk8s.io/client-go => k8s.io/client-go {staging}\n" in generated
    assert "./staging" not in generated


def test_staging_version_maps_minor_and_patch():
    assert versions.staging_version("1.35.4") == "v0.35.4"
    assert versions.staging_version("1.36.0") == "v0.36.0"


def test_build_is_not_cached_in_an_empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("WARMSTART_CACHE", str(tmp_path))
    assert versions.cache_root() == tmp_path / "k8s"
    assert not build.is_cached()


def test_stale_stamp_is_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("WARMSTART_CACHE", str(tmp_path))
    versions.bin_dir().mkdir(parents=True)
    for name in versions.BINARIES:
        (versions.bin_dir() / name).write_text("")
    versions.stamp_path().write_text('{"kubernetes": "1.30.0"}')
    assert not build.is_cached()
    versions.stamp_path().write_text(json.dumps(versions.wanted_stamp()))
    assert build.is_cached()


def load_cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_certificates_chain_to_the_ca_with_the_right_identities(tmp_path: Path):
    generated = pki.generate(tmp_path)
    ca = load_cert(generated.ca_cert)
    serving = load_cert(generated.serving_cert)
    admin = load_cert(generated.admin_cert)
    serving.verify_directly_issued_by(ca)
    admin.verify_directly_issued_by(ca)

    addresses = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("127.0.0.1") in addresses.get_values_for_type(x509.IPAddress)
    assert "kubernetes.default.svc" in addresses.get_values_for_type(x509.DNSName)
    assert (
        ExtendedKeyUsageOID.SERVER_AUTH
        in serving.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    )

    organizations = admin.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    assert [o.value for o in organizations] == ["system:masters"]
    assert (generated.service_account_key.stat().st_mode & 0o077) == 0


def test_fake_node_offers_eight_gpus_and_is_managed_by_kwok():
    node = fake_gpu_node("kwok-gpu-0")
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
    assert not node_is_ready(node)
    node["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    assert node_is_ready(node)
    node["spec"] = {"taints": [{"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}]}
    assert not node_is_ready(node)


def test_wait_for_returns_the_first_truthy_value():
    answers = iter([None, 0, [], "done"])
    assert wait_for(lambda: next(answers), timeout=30, interval=0) == "done"


def test_wait_for_names_what_it_waited_for_and_the_last_error():
    def failing() -> bool:
        raise ValueError("not there")

    with pytest.raises(TimeoutError, match=r"the widget.*not there"):
        wait_for(failing, timeout=0, interval=0, message="the widget")


def test_missing_binary_names_the_build_command(tmp_path: Path):
    plane = ControlPlane(state_dir=tmp_path / "state", bin_dir=tmp_path / "bin")
    with pytest.raises(RuntimeError, match="hack/control-plane build"):
        plane.start()


@pytest.mark.spawns
def test_a_gpu_node_is_labelled_as_gpu_feature_discovery_labels_it(tmp_path: Path, monkeypatch):
    from control_plane import gpu_node

    smi = tmp_path / "nvidia-smi"
    row = "NVIDIA H200, 580.159.04, 9.0, 143771"
    smi.write_text(f'#!/bin/sh\necho "{row}"\necho "{row}"\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert gpu_node.node_labels() == {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": "NVIDIA-H200",
        "nvidia.com/gpu.count": "2",
        "nvidia.com/gpu.memory": "143771",
        "nvidia.com/gpu.compute.major": "9",
        "nvidia.com/gpu.compute.minor": "0",
        "nvidia.com/cuda.driver.major": "580",
    }


def test_the_node_runs_the_tools_folder_when_one_is_given(tmp_path: Path, monkeypatch):
    from control_plane import node_config

    monkeypatch.delenv("WARMSTART_NODE_TOOLS", raising=False)
    assert node_config.cni_bin_dir() == "/usr/lib/cni"
    monkeypatch.setenv("WARMSTART_NODE_TOOLS", str(tmp_path))
    assert node_config.cni_bin_dir() == f"{tmp_path}/usr/lib/cni"
    assert f'bin_dir = "{tmp_path}/usr/lib/cni"' in node_config.containerd_toml()


def test_cgroup_pids_reads_every_cgroup_of_a_tree(tmp_path: Path):
    for number, relative in enumerate(("", "kubepods", "kubepods/pod-a/c1", "kubepods/pod-b")):
        (tmp_path / relative).mkdir(parents=True, exist_ok=True)
        (tmp_path / relative / "cgroup.procs").write_text(f"{100 + number}\n{200 + number}\n")
    assert host_state.cgroup_pids(tmp_path) == {100, 101, 102, 103, 200, 201, 202, 203}
    assert host_state.cgroup_pids(tmp_path / "absent") == set()


def test_cgroup_pids_skips_cgroups_removed_while_it_looks(tmp_path: Path):
    """The kubelet removes a pod's cgroups whenever a pod ends, also while a teardown collects pids."""
    pods = [tmp_path / f"pod-{number}" / "container" for number in range(300)]
    for pod in pods:
        pod.mkdir(parents=True)
        (pod / "cgroup.procs").write_text("7\n")

    def remove_pods() -> None:
        for pod in pods:
            shutil.rmtree(pod.parent)

    remover = threading.Thread(target=remove_pods)
    remover.start()
    while remover.is_alive():
        assert host_state.cgroup_pids(tmp_path) <= {7}
    remover.join()
    assert host_state.cgroup_pids(tmp_path) == set()
