"""One acting operator among its replicas: the replica holding a Lease (coordination.k8s.io) runs kopf.

kopf's peering pauses replicas of lower priority, and every replica when priorities tie; a Lease is how
Kubernetes controllers have exactly one replica act. A replica waits until it holds the Lease, then runs the
operator. One that cannot renew it in time must stop at once (a successor may already act): it exits,
for its pod to be restarted as a follower.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from typing import Any

from warmstart.kube.client import with_timeout

log = logging.getLogger(__name__)

LEASE_SECONDS = 15  # a silent leader is replaced after this long
RENEW_SECONDS = 10  # a leader that cannot renew within this long stops acting
RETRY_SECONDS = 2


class Leadership:
    """Campaigns for the Lease in a background thread; `leading` is set while this replica holds it."""

    def __init__(self, namespace: str, name: str, api_client: Any, on_lost: Callable[[], None]) -> None:
        from kubernetes import client
        from kubernetes.leaderelection import electionconfig, leaderelection
        from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

        logging.getLogger("leaderelection").setLevel(logging.WARNING)  # it logs each retry at INFO
        # This replica's name in the Lease: its pod's name (the hostname) and a random suffix.
        self.identity = f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"
        self.leading = threading.Event()
        self._on_lost = on_lost
        lock = LeaseLock(name, namespace, self.identity)
        # Not the client library's global default; each call bounded, so that a renewal cannot hang past
        # the deadline of the one before it.
        coordination = client.CoordinationV1Api(api_client)
        lock.api_instance = with_timeout(coordination, RENEW_SECONDS / 2)
        config = electionconfig.Config(
            lock, LEASE_SECONDS, RENEW_SECONDS, RETRY_SECONDS,
            onstarted_leading=self.leading.set, onstopped_leading=self._lost,
        )  # fmt: skip
        self._election = leaderelection.LeaderElection(config)
        self.lease = f"{namespace}/{name}"

    def wait_to_lead(self, cancelled: threading.Event) -> bool:
        """Start campaigning; block until this replica leads (True) or `cancelled` is set (False)."""
        log.info("waiting to hold Lease %s as %s", self.lease, self.identity)
        threading.Thread(target=self._election.run, name="leader-election", daemon=True).start()
        while not cancelled.is_set():
            if self.leading.wait(0.5):
                log.info("holding Lease %s: this replica acts", self.lease)
                return True
        return False

    def _lost(self) -> None:
        if self.leading.is_set():
            log.error("could not renew Lease %s in time: another replica may act now; stopping", self.lease)
            self._on_lost()


def exit_now() -> None:
    """What a replica that lost the Lease does: exit at once, mid-reconcile or not (every reconcile is
    idempotent), rather than act beside its successor while kopf winds down."""
    logging.shutdown()
    os._exit(1)
