"""How kopf reaches the API server: with the credentials of the operator's own client (`warmstart.kube`),
not by loading the kubeconfig a second way. Importing this module registers the login handler."""

from __future__ import annotations

from typing import Any

import kopf

from warmstart.kube.client import load_configuration


@kopf.on.login()
def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    configuration = load_configuration()
    header = configuration.get_api_key_with_prefix("BearerToken") or ""
    scheme, _, token = header.rpartition(" ")
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        username=configuration.username or None,
        password=configuration.password or None,
        scheme=scheme or None,
        token=token or None,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
        trust_env=settings.networking.trust_env,
    )
