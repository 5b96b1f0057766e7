"""The one Kubernetes client (lightkube), shared by the collector's pod watch and the executors.

Why lightkube ("One Kubernetes client"): it is small (pure Python over httpx, ~4 MB
with its models) where the official `kubernetes` package is a large generated client; its
in-cluster config authenticates with `BearerTokenFileAuth`, which re-reads the projected
service-account token when the server answers 401 (bound tokens are rotated by the kubelet and
expire within the hour; a client that reads the token once stops working); `list` returns the
collection's resourceVersion and `watch(resource_version=...)` resumes from it, and on 410 Gone
`list_then_watch` lists again.

It lives here, under the plumbing every part shares, so that the collectors (which must not import
the executors) and the executors use the same client and the same watch loop.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

from lightkube import ApiError, Client, KubeConfig

from xidstream.schemas.errors import ConfigError

__all__ = ["make_client", "list_then_watch", "ApiError", "SERVICE_ACCOUNT_DIR"]

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def make_client(kubeconfig: str | Path | None = None, *, timeout: float = 15.0,
                field_manager: str = "xidstream") -> Client:
    """A client for `kubeconfig`, or the in-cluster config (service-account token re-read on 401)
    when none is given. A clear ConfigError when neither works."""
    try:
        if kubeconfig:
            config = KubeConfig.from_file(str(kubeconfig))
        else:
            config = KubeConfig.from_service_account()
    except Exception as exc:  # noqa: BLE001 - lightkube raises several kinds; one clear message
        where = kubeconfig or f"the in-cluster service account ({SERVICE_ACCOUNT_DIR})"
        raise ConfigError(f"cannot load a Kubernetes config from {where}: {exc} "
                          f"(give --kubeconfig FILE outside a cluster)") from None
    return Client(config, timeout=timeout, field_manager=field_manager)


def list_then_watch(client: Client, res: Any, on_event: Callable[[str, Any], bool], *, namespace: str | None = None,
                    fields: dict | None = None, labels: dict | None = None) -> None:
    """List, then watch from the list's resourceVersion; on 410 Gone (the version was compacted
    away) list again and resume from the new one, so no change is lost. `on_event(type, obj)` gets
    ("LISTED", obj) for each listed object, then ADDED/MODIFIED/DELETED; return False to stop.
    Other errors (the API server restarting, a timeout) are the caller's to retry."""
    kw: dict[str, Any] = {"fields": fields, "labels": labels}
    if namespace is not None:
        kw["namespace"] = namespace
    while True:
        listing = client.list(res, **kw)
        for obj in listing:
            if on_event("LISTED", obj) is False:
                return
        rv = listing.resourceVersion
        try:
            for typ, obj in client.watch(res, resource_version=rv, **kw):
                if on_event(typ, obj) is False:
                    return
        except ApiError as exc:
            if exc.status.code != 410:
                raise
            log.info("watch of %s: resourceVersion %s is gone (410); listing again", res.__name__, rv)
