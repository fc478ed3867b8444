"""Operator faults against a real API server: its CRD deleted under live endpoints and created again, an
operator started before its CRD exists, plain-text error replies, a child the API server keeps refusing,
and log lines that must name their object. The real operator runs as a process; everything is loopback."""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from builders import endpoint_spec
from operator_process import OperatorProcess

from warmstart.api import labels as L
from warmstart.kube.client import KINDS, Kind, Kube, KubeError, TransientKubeError

pytestmark = [pytest.mark.integration, pytest.mark.reliability]

CRDS = Path(__file__).resolve().parents[2] / "crds"
ENDPOINT_CRD = f"{L.ENDPOINT_PLURAL}.{L.GROUP}"
WAIT = 120  # generous: a loaded 2-core machine
ENDPOINTS_UNDER_DELETION = 6
RECREATIONS = 2
RETRY_ENV = {"WARMSTART_OPERATOR_RETRY_BASE_SECONDS": "1", "WARMSTART_OPERATOR_RETRY_MAX_SECONDS": "4"}
FAULTS: Counter[str] = Counter()  # injected
SURVIVED: Counter[str] = Counter()


@pytest.fixture(scope="module", autouse=True)
def fault_tally(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and FAULTS:
        lines = ", ".join(f"{kind} {SURVIVED[kind]}/{count}" for kind, count in sorted(FAULTS.items()))
        reporter.write_line(f"\noperator faults survived/injected: {lines}")


def install_crds(kube) -> None:
    kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRDS))
    kube.kubectl("wait", "--for=condition=Established", "--timeout=60s", "-f", str(CRDS))


@pytest.fixture
def crds_back(kube) -> Iterator[None]:
    """The CRDs installed before and after the test (it deletes them; later tests need them)."""
    install_crds(kube)
    yield
    kube.wait_for(lambda: not crd_terminating(kube), timeout=WAIT, message="the endpoint CRD deletion")
    install_crds(kube)


@pytest.fixture
def start_operator(kube, tmp_path) -> Iterator[Any]:
    started: list[OperatorProcess] = []

    def start(**env: str) -> OperatorProcess:
        log = tmp_path / f"operator-{len(started)}.log"
        process = OperatorProcess(
            kube.kubeconfig, log, env={"WARMSTART_OPERATOR_RESYNC_SECONDS": "2", **RETRY_ENV, **env}
        )
        started.append(process)
        process.start()
        return process

    yield start
    for process in started:
        process.stop()
        assert "Traceback" not in process.log_path.read_text(errors="replace"), process.log_tail(120)


def crd_exists(kube) -> bool:
    return kube.kubectl("get", "crd", ENDPOINT_CRD, check=False).returncode == 0


def crd_terminating(kube) -> bool:
    result = kube.kubectl("get", "crd", ENDPOINT_CRD, "-o", "json", check=False)
    return result.returncode == 0 and bool(json.loads(result.stdout)["metadata"].get("deletionTimestamp"))


def delete_endpoints(kube, namespace: str) -> None:
    """While the operator runs, so that the test namespace is not left with endpoints nobody finalizes."""
    kube.kubectl("delete", "iep", "--all", "-n", namespace, "--timeout=120s")


def create_endpoint(kube, namespace: str, name: str, **spec: Any) -> None:
    body = {
        "apiVersion": L.API_VERSION,
        "kind": L.ENDPOINT_KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": endpoint_spec(**spec),
    }
    kube.kubectl("apply", "-f", "-", input=json.dumps(body))


def get(kube, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    result = kube.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def condition(body: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for cond in ((body or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == kind:
            return cond
    return {}


def served(kube, namespace: str, name: str) -> bool:
    """The operator took the endpoint on: its Deployment and a status (and no finalizer: nothing it must be
    around for when the endpoint or its CRD is deleted)."""
    body = get(kube, "iep", namespace, name) or {}
    return (
        not body.get("metadata", {}).get("finalizers")
        and bool(body.get("status", {}).get("phase"))
        and get(kube, "deployment", namespace, name) is not None
    )


def wait_served(kube, namespace: str, name: str) -> None:
    kube.wait_for(lambda: served(kube, namespace, name), timeout=WAIT, message=f"{namespace}/{name} served")


@pytest.mark.spawns
def test_plain_text_error_replies_read_as_their_status(kube, monkeypatch: pytest.MonkeyPatch) -> None:
    """The API server answers a path it does not serve with a text/plain '404 page not found'."""
    monkeypatch.setitem(KINDS, "Thing", Kind("not-served.warmstart.dev/v1", "things"))
    client = Kube(kube.api_client())
    FAULTS["plain-text 404"] += 1
    with pytest.raises(KubeError) as raised:
        client.list("Thing", "default", {})
    assert raised.value.status == 404 and not isinstance(raised.value, TransientKubeError)
    assert "404 page not found" in str(raised.value)
    assert client.get("Thing", "default", "one") is None
    assert client.served_verbs("Thing") == frozenset()
    assert client.served_verbs("ScaledObject") >= {"get", "patch"}  # a served kind, to contrast
    SURVIVED["plain-text 404"] += 1


@contextlib.contextmanager
def text_server(status: int, body: bytes) -> Iterator[str]:
    """An HTTP server on loopback whose every reply is `status` with `body` (what a proxy or a half-started
    server says); yields its address."""

    class Reply(BaseHTTPRequestHandler):
        def _reply(self) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_PATCH = do_POST = do_DELETE = _reply

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Reply)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("status", "body", "error", "words"),
    [
        (404, b"404 page not found\n", KubeError, "404 page not found"),
        (503, b"upstream connect error", TransientKubeError, "upstream connect error"),
        (502, b"", TransientKubeError, "empty reply"),
        (200, b"<html>gateway</html>", TransientKubeError, "not JSON"),
    ],
)
def test_non_json_replies_are_clean_api_errors(status: int, body: bytes, error: type, words: str) -> None:
    from kubernetes import client

    FAULTS["non-JSON reply"] += 1
    with text_server(status, body) as address:
        api = Kube(client.ApiClient(client.Configuration(host=address)))
        for call in (lambda: api.list("Pod", "x", {}), lambda: api.patch("Pod", "x", "y", {})):
            with pytest.raises(error) as raised:
                call()
            assert words in str(raised.value)
            assert type(raised.value) is error
            if status != 200:
                assert raised.value.status == status
    SURVIVED["non-JSON reply"] += 1


def refuse_deployments_of(kube, namespace: str, endpoint: str) -> str:
    """An admission policy refusing the endpoint's Deployment (as a quota or a policy engine would)."""
    policy = f"refuse-{namespace}"
    expression = f"object.metadata.name != '{endpoint}'"
    manifests = [
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": policy},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "resourceRules": [
                        {
                            "apiGroups": ["apps"],
                            "apiVersions": ["v1"],
                            "operations": ["CREATE", "UPDATE"],
                            "resources": ["deployments"],
                        }
                    ]
                },
                "validations": [{"expression": expression, "message": "refused by the test's policy"}],
            },
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": policy},
            "spec": {
                "policyName": policy,
                "validationActions": ["Deny"],
                "matchResources": {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
                },
            },
        },
    ]
    listing = {"apiVersion": "v1", "kind": "List", "items": manifests}
    kube.kubectl("apply", "-f", "-", input=json.dumps(listing))
    return policy


def policy_refuses(kube, namespace: str, name: str) -> bool:
    probe = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": {"app": "probe"}},
            "template": {
                "metadata": {"labels": {"app": "probe"}},
                "spec": {"containers": [{"name": "c", "image": "probe"}]},
            },
        },
    }
    result = kube.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(probe), check=False)
    return result.returncode != 0 and "refused by the test's policy" in result.stderr


RETRY_LINE = re.compile(r"(\S+)/(\S+): (\S+) reconcile failed \((\d+) in a row\), retrying in (\d+) s")


def retry_lines(log: str, namespace: str, name: str) -> list[tuple[str, int, int]]:
    """(handler, failures in a row, delay) of each failed reconcile of the endpoint the operator logged."""
    found = []
    for match in RETRY_LINE.finditer(log):
        if (match[1], match[2]) == (namespace, name):
            found.append((match[3], int(match[4]), int(match[5])))
    return found


@pytest.mark.spawns
def test_a_refused_child_is_reported_and_retried_with_backoff_from_one_path(
    kube, crds_installed, namespace, start_operator
) -> None:
    name = "refused"
    policy = refuse_deployments_of(kube, namespace, name)
    try:
        kube.wait_for(lambda: policy_refuses(kube, namespace, name), timeout=WAIT, message="the policy")
        operator = start_operator()
        FAULTS["refused child"] += 1
        create_endpoint(kube, namespace, name, snapshot={"enabled": False})

        def reported() -> dict[str, Any] | None:
            body = get(kube, "iep", namespace, name)
            degraded = condition(body, "Degraded")
            return body if degraded.get("reason") == "ApplyFailed" and degraded["status"] == "True" else None

        body = kube.wait_for(reported, timeout=WAIT, message="Degraded/ApplyFailed in status")
        assert body["status"]["phase"] == "Degraded"
        assert f"Deployment {namespace}/{name}" in condition(body, "Degraded")["message"]
        assert "refused by the test's policy" in condition(body, "Degraded")["message"]
        progressing = condition(body, "Progressing")
        assert (progressing["status"], progressing["reason"]) == ("False", "ApplyFailed")

        def warning_events() -> list[dict[str, Any]]:
            out = kube.kubectl("get", "events", "-n", namespace, "-o", "json").stdout
            return [
                event
                for event in json.loads(out)["items"]
                if event["involvedObject"]["name"] == name
                and (event["type"], event["reason"]) == ("Warning", "ApplyFailed")
            ]

        kube.wait_for(warning_events, timeout=WAIT, message="a Warning ApplyFailed Event")

        # Five failures in a row: 1, 2, 4, then the 4 s cap; one retry path: kopf's retries of the
        # endpoint's handler, after the operator's backoff.
        kube.wait_for(
            lambda: len(retry_lines(operator.log_path.read_text(), namespace, name)) >= 5,
            timeout=WAIT,
            message="five failed reconciles",
        )
        log = operator.log_path.read_text()
        lines = retry_lines(log, namespace, name)
        assert [failures for _, failures, _ in lines] == list(range(1, len(lines) + 1)), lines
        assert [delay for _, _, delay in lines[:5]] == [1, 2, 4, 4, 4], lines
        assert len({handler for handler, _, _ in lines}) == 1, lines  # the creation, retried
        kopf_retries = re.findall(rf"\[{namespace}/{name}\] Handler '[^']+' failed temporarily", log)
        assert len(lines) - 1 <= len(kopf_retries) <= len(lines), operator.log_tail()  # each one, by kopf
        assert not re.search(rf"\[{namespace}/{name}\] (Timer|Daemon) ", log), operator.log_tail()
        assert len(warning_events()) == 1  # reported once, not once a retry
    finally:
        kinds = "validatingadmissionpolicybinding,validatingadmissionpolicy"
        kube.kubectl("delete", kinds, policy, check=False)

    # The refusal lifted: the next retry (at most the cap away) applies the Deployment and clears Degraded.
    kube.wait_for(
        lambda: condition(get(kube, "iep", namespace, name), "Degraded").get("status") == "False",
        timeout=WAIT,
        message="Degraded False once the Deployment is accepted",
    )
    assert get(kube, "deployment", namespace, name) is not None
    SURVIVED["refused child"] += 1
    delete_endpoints(kube, namespace)


OBJECT_LINE = re.compile(r" kopf\.objects: \[(\S+)\] ")


@pytest.mark.spawns
def test_every_log_line_about_an_object_names_it(kube, crds_installed, namespace, start_operator) -> None:
    operator = start_operator()
    create_endpoint(kube, namespace, "named", snapshot={"enabled": False})
    wait_served(kube, namespace, "named")
    kube.kubectl("patch", "iep", "named", "-n", namespace, "--type=merge", "-p", '{"spec":{"replicas":2}}')
    kube.wait_for(
        lambda: (get(kube, "deployment", namespace, "named") or {}).get("spec", {}).get("replicas") == 2,
        timeout=WAIT,
        message="the scale reaching the Deployment",
    )
    kube.wait_for(
        lambda: operator.log_path.read_text(errors="replace").count(f"[{namespace}/named] Handler ") >= 2,
        timeout=WAIT,
        message="the creation and the update handled, in the log",
    )
    kube.kubectl("delete", "iep", "named", "-n", namespace, "--timeout=120s")
    operator.stop()
    lines = operator.log_path.read_text(errors="replace").splitlines()
    about_objects = [line for line in lines if " kopf.objects: " in line]
    unnamed = [line for line in about_objects if not OBJECT_LINE.search(line)]
    assert about_objects and not unnamed, "\n".join(unnamed[:20])
    ours = [line for line in lines if " warmstart.operator." in line and "CRD " not in line]
    assert all(re.search(r"[a-z0-9-]+/[a-z0-9.-]+", line) for line in ours), "\n".join(ours[:20])


@pytest.fixture
def crds_installed(kube) -> None:
    install_crds(kube)


@pytest.mark.spawns
def test_deleting_the_crd_under_live_endpoints_completes_then_a_new_crd_is_served(
    kube, crds_back, namespace, start_operator
) -> None:
    operator = start_operator()
    names = [f"churn-{i}" for i in range(ENDPOINTS_UNDER_DELETION)]
    for name in names:
        create_endpoint(kube, namespace, name)
    for name in names:
        wait_served(kube, namespace, name)
    pid = operator.process.pid
    for cycle in range(RECREATIONS):
        FAULTS["CRD deleted under endpoints"] += 1
        kube.kubectl("delete", "crd", ENDPOINT_CRD, "--wait=false")
        kube.wait_for(lambda: not crd_exists(kube), timeout=WAIT, message="the CRD deletion to complete")
        assert operator.alive(), operator.log_tail()
        SURVIVED["CRD deleted under endpoints"] += 1

        FAULTS["CRD created again"] += 1
        install_crds(kube)
        name = f"after-{cycle}"
        create_endpoint(kube, namespace, name)
        wait_served(kube, namespace, name)
        assert operator.process.pid == pid and operator.alive()  # served without a restart of the process
        SURVIVED["CRD created again"] += 1
    delete_endpoints(kube, namespace)


@pytest.mark.spawns
def test_an_operator_started_before_its_crd_exists_serves_it_once_created(
    kube, crds_back, namespace, start_operator
) -> None:
    kube.kubectl("delete", "crd", ENDPOINT_CRD, "--wait=true", "--timeout=120s")
    operator = start_operator()
    pid = operator.process.pid
    FAULTS["CRD absent at start"] += 1
    install_crds(kube)
    create_endpoint(kube, namespace, "late")
    wait_served(kube, namespace, "late")
    assert operator.process.pid == pid and operator.alive()
    SURVIVED["CRD absent at start"] += 1
    delete_endpoints(kube, namespace)
