"""The operator's settings: each a flag of `warmstart operator` and an environment variable (the chart's
Deployment sets the variables)."""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator, model_validator

from warmstart.host.command_settings import CommaList, CommandSettings, Count, Port, Seconds, Text, setting
from warmstart.operator.diagnosis import AgentLookup, parse_selector
from warmstart.operator.placement import NODE_LOCAL, SNAPSHOT_STORES


class OperatorSettings(CommandSettings):
    namespace: CommaList = setting(
        [],
        "WARMSTART_OPERATOR_NAMESPACES",
        "watch this namespace (repeatable; globs like 'team-*' work; the "
        "variable: comma-separated); none: every namespace",
    )
    metrics_port: Port = setting(
        8080, "WARMSTART_OPERATOR_METRICS_PORT_NUMBER", "Prometheus metrics port, 0 to disable"
    )
    liveness_port: Port = setting(
        8081, "WARMSTART_OPERATOR_LIVENESS_PORT_NUMBER", "liveness endpoint port (/healthz), 0 to disable"
    )
    leader_election_namespace: Text = setting(
        "",
        "WARMSTART_OPERATOR_LEASE_NAMESPACE",
        "act only while holding a Lease in this namespace, so that one "
        "of several replicas acts; empty: act alone",
    )
    lease_name: Text = setting(
        "warmstart-operator", "WARMSTART_OPERATOR_LEASE_NAME", "the Lease's name", min_length=1
    )
    resync_seconds: Seconds = setting(
        60.0, "WARMSTART_OPERATOR_RESYNC_SECONDS", "seconds between reconciles of an unchanged endpoint"
    )
    capture_backoff_seconds: Seconds = setting(
        30.0,
        "WARMSTART_OPERATOR_CAPTURE_BACKOFF_SECONDS",
        "first wait before a failed capture is tried again (doubling after each failure)",
    )
    # Zero workers would leave kopf no thread to run a handler in.
    workers: Count = setting(4, "WARMSTART_OPERATOR_WORKERS", "endpoints reconciled at once")
    retry_base_seconds: Seconds = setting(
        1.0, "WARMSTART_OPERATOR_RETRY_BASE_SECONDS", "first wait before a failed reconcile is retried"
    )
    retry_max_seconds: Seconds = setting(
        120.0,
        "WARMSTART_OPERATOR_RETRY_MAX_SECONDS",
        "longest wait between retries of a failed reconcile",
    )
    snapshot_store: Literal[SNAPSHOT_STORES] = setting(  # type: ignore[valid-type]
        NODE_LOCAL,
        "WARMSTART_OPERATOR_SNAPSHOT_STORE",
        f"the node agents' kind of snapshot store, as the chart chose it ({', '.join(SNAPSHOT_STORES)}): "
        "restore pods prefer the snapshot's node when node-local",
    )
    agent_namespace: Text = setting(
        "",
        "WARMSTART_OPERATOR_AGENT_NAMESPACE",
        "the node agents' namespace (with the selector: the operator "
        "reports the nodes without an agent; neither: it does not check)",
    )
    agent_selector: Text = setting(
        "", "WARMSTART_OPERATOR_AGENT_SELECTOR", "the node agents' pod labels, key=value[,key=value]"
    )

    @field_validator("agent_selector")
    @classmethod
    def _selector_parses(cls, text: str) -> str:
        if text.strip():
            parse_selector(text, "the selector")
        return text

    @model_validator(mode="after")
    def _agents_named_together(self) -> OperatorSettings:
        if bool(self.agent_namespace.strip()) != bool(self.agent_selector.strip()):
            raise ValueError(
                "WARMSTART_OPERATOR_AGENT_NAMESPACE and WARMSTART_OPERATOR_AGENT_SELECTOR are set "
                "together or not at all"
            )
        return self

    @model_validator(mode="after")
    def _retries_grow(self) -> OperatorSettings:
        if self.retry_base_seconds > self.retry_max_seconds:
            raise ValueError(
                "--retry-base-seconds / WARMSTART_OPERATOR_RETRY_BASE_SECONDS must not be more than "
                "--retry-max-seconds / WARMSTART_OPERATOR_RETRY_MAX_SECONDS "
                f"(got {self.retry_base_seconds:g} and {self.retry_max_seconds:g})"
            )
        return self

    @property
    def agents(self) -> AgentLookup | None:
        if not self.agent_namespace.strip():
            return None
        return AgentLookup(self.agent_namespace.strip(), parse_selector(self.agent_selector, "the selector"))
