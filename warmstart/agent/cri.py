"""The node's container runtime, asked over its CRI socket (the one the kubelet uses) which image a pod's
container runs from. Its answer is the one the kubelet copies into the pod's status as `imageID`, but the
kubelet copies it only at its next relist of the runtime, up to a second after the container starts: a
restore that asks the runtime does not wait for it. The runtime knows the image from the container's
creation, before its process runs, so a container is asked about while created or running."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from warmstart.agent.proto import cri_pb2, cri_pb2_grpc

log = logging.getLogger(__name__)

POD_UID_LABEL = "io.kubernetes.pod.uid"  # set by the kubelet on every container it creates
CONTAINER_NAME_LABEL = "io.kubernetes.container.name"
CALL_TIMEOUT_SECONDS = 2.0
# A worker's process can be seen before the runtime lists its container (the process of a container being
# created), so a runtime that answers is asked again for this long, this often.
LIST_WAIT_SECONDS = 2.0
LIST_AGAIN_SECONDS = 0.05
LIVE_STATES = (cri_pb2.CONTAINER_CREATED, cri_pb2.CONTAINER_RUNNING)


class ContainerRuntime:
    """A CRI runtime service on a unix socket; every question answered "" when it cannot be asked."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket

    def container_image(
        self, pod_uid: str, container: str, stopping: Callable[[], bool] = lambda: False
    ) -> str:
        """The image of the pod's newest container of that name, created or running (the runtime's digested
        reference, as the kubelet reports it); "" when there is none within LIST_WAIT_SECONDS or the runtime
        does not answer."""
        if not self.socket.is_socket():
            return ""
        deadline = time.monotonic() + LIST_WAIT_SECONDS
        while (image := self._image_now(pod_uid, container)) == "":
            if time.monotonic() >= deadline or stopping():
                return ""
            time.sleep(LIST_AGAIN_SECONDS)
        return image or ""

    def _image_now(self, pod_uid: str, container: str) -> str | None:
        """The image, "" while no such container runs, None when the runtime does not answer."""
        try:
            with grpc.insecure_channel(f"unix://{self.socket}") as channel:
                runtime = cri_pb2_grpc.RuntimeServiceStub(channel)
                labels = {POD_UID_LABEL: pod_uid, CONTAINER_NAME_LABEL: container}
                named = cri_pb2.ListContainersRequest(filter=cri_pb2.ContainerFilter(label_selector=labels))
                listed = runtime.ListContainers(named, timeout=CALL_TIMEOUT_SECONDS)
                live = [found for found in listed.containers if found.state in LIVE_STATES]
                if not live:
                    return ""
                newest = max(live, key=lambda found: found.metadata.attempt)
                request = cri_pb2.ContainerStatusRequest(container_id=newest.id)
                return runtime.ContainerStatus(request, timeout=CALL_TIMEOUT_SECONDS).status.image_ref
        except grpc.RpcError as exc:
            log.warning("the container runtime at %s did not answer: %s", self.socket, exc)
            return None
