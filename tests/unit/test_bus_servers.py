"""``Settings.nats_url`` → the client's server list (several URLs for a NATS cluster)."""

from __future__ import annotations

import pytest

from services.runtime.errors import SettingsError
from services.runtime.nats.auth import server_list


def test_one_url_is_a_one_server_list() -> None:
    assert server_list("nats://127.0.0.1:4222") == ["nats://127.0.0.1:4222"]


def test_comma_separated_urls_become_several_servers() -> None:
    assert server_list(" nats://a:4222, nats://b:4222 ,nats://c:4222,") == [
        "nats://a:4222",
        "nats://b:4222",
        "nats://c:4222",
    ]


def test_no_url_at_all_is_a_settings_error() -> None:
    with pytest.raises(SettingsError, match="nats_url"):
        server_list(" , ")
