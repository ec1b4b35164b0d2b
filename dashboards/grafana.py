"""Provisioning through grafana-client: the Prometheus data source and the dashboard, created or
updated in place (fixed uids), so pushing twice leaves one of each."""

from __future__ import annotations

import os
from dataclasses import dataclass

from .ddtree_dashboard import DASHBOARD_UID, DATASOURCE_UID, dashboard_json


@dataclass(frozen=True)
class GrafanaAuth:
    url: str
    token: str | None = None
    user: str | None = None
    password: str | None = None

    @classmethod
    def from_env(cls, url: str | None = None, token: str | None = None, user: str | None = None, password: str | None = None):
        """Flags win over GRAFANA_URL, GRAFANA_TOKEN, GRAFANA_USER, GRAFANA_PASSWORD."""
        url = url or os.environ.get("GRAFANA_URL")
        if not url:
            raise ValueError("no Grafana URL: pass --grafana-url or set GRAFANA_URL")
        return cls(
            url=url,
            token=token or os.environ.get("GRAFANA_TOKEN"),
            user=user or os.environ.get("GRAFANA_USER"),
            password=password or os.environ.get("GRAFANA_PASSWORD"),
        )

    def credential(self):
        if self.token:
            return self.token
        if self.user:
            return (self.user, self.password or "")
        return None


def datasource_payload(prometheus_url: str) -> dict:
    """The Prometheus data source the dashboard's panels name (uid DATASOURCE_UID)."""
    return {
        "uid": DATASOURCE_UID,
        "name": "ddtree Prometheus",
        "type": "prometheus",
        "access": "proxy",
        "url": prometheus_url,
        "isDefault": False,
        "jsonData": {"httpMethod": "POST", "timeInterval": "15s"},
    }


def dashboard_payload(model: dict | None = None, folder_uid: str | None = None) -> dict:
    """The body of POST /api/dashboards/db: overwrite by uid, no numeric id (so it is idempotent)."""
    model = dict(model or dashboard_json())
    model.pop("id", None)
    model["uid"] = model.get("uid") or DASHBOARD_UID
    payload = {"dashboard": model, "overwrite": True, "message": "pushed by ddtree dashboards push"}
    if folder_uid:
        payload["folderUid"] = folder_uid
    return payload


def push(auth: GrafanaAuth, prometheus_url: str, folder_uid: str | None = None) -> dict:
    """Creates or updates the data source, then the dashboard. Returns Grafana's answer."""
    from grafana_client import GrafanaApi
    from grafana_client.client import GrafanaClientError

    api = GrafanaApi.from_url(auth.url, credential=auth.credential())
    source = datasource_payload(prometheus_url)
    try:
        existing = api.datasource.get_datasource_by_uid(DATASOURCE_UID)
    except GrafanaClientError as err:
        if getattr(err, "status_code", None) != 404:
            raise
        existing = None
    if existing:
        api.datasource.update_datasource_by_uid(DATASOURCE_UID, {**source, "id": existing["id"]})
    else:
        api.datasource.create_datasource(source)
    return api.dashboard.update_dashboard(dashboard_payload(folder_uid=folder_uid))
