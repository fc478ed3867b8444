"""The node's container runtime, asked over its CRI socket (the one the kubelet uses) which image a pod's
container runs from. Its answer is the one the kubelet copies into the pod's status as `imageID`, but the
kubelet copies it only at its next relist of the runtime, up to a second after the container starts: a
restore that asks the runtime does not wait for it."""

from __future__ import annotations

import logging
from pathlib import Path

import grpc

from warmstart.agent.proto import cri_pb2, cri_pb2_grpc

log = logging.getLogger(__name__)

POD_UID_LABEL = "io.kubernetes.pod.uid"  # set by the kubelet on every container it creates
CONTAINER_NAME_LABEL = "io.kubernetes.container.name"
CALL_TIMEOUT_SECONDS = 2.0


class ContainerRuntime:
    """A CRI runtime service on a unix socket; every question answered "" when it cannot be asked."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket

    def running_image(self, pod_uid: str, container: str) -> str:
        """The image the pod's running container of that name runs from (the runtime's digested reference,
        as the kubelet reports it), "" when no such container runs or the runtime does not answer."""
        if not self.socket.is_socket():
            return ""
        try:
            with grpc.insecure_channel(f"unix://{self.socket}") as channel:
                runtime = cri_pb2_grpc.RuntimeServiceStub(channel)
                running = runtime.ListContainers(_running(pod_uid, container), timeout=CALL_TIMEOUT_SECONDS)
                if not running.containers:
                    return ""
                newest = max(running.containers, key=lambda found: found.metadata.attempt)
                request = cri_pb2.ContainerStatusRequest(container_id=newest.id)
                return runtime.ContainerStatus(request, timeout=CALL_TIMEOUT_SECONDS).status.image_ref
        except grpc.RpcError as exc:
            log.warning("the container runtime at %s did not answer: %s", self.socket, exc)
            return ""


def _running(pod_uid: str, container: str) -> cri_pb2.ListContainersRequest:
    return cri_pb2.ListContainersRequest(
        filter=cri_pb2.ContainerFilter(
            state=cri_pb2.ContainerStateValue(state=cri_pb2.CONTAINER_RUNNING),
            label_selector={POD_UID_LABEL: pod_uid, CONTAINER_NAME_LABEL: container},
        )
    )
