"""Every numeric setting has a range, checked where the setting lives: a bad value is refused
when the server is configured, with the field named, never read as something else later."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest

from proto_server.core.ranges import InvalidSetting
from proto_server.engine.simulated import TimingModel
from proto_server.server.process.config import ServerConfig

REFUSED: list[tuple[type[Any], str, Any, str]] = [
    (ServerConfig, "port", -1, "between 0 and 65535"),
    (ServerConfig, "port", 65536, "between 0 and 65535"),
    (ServerConfig, "max_message_bytes", 0, "at least 1024"),
    (ServerConfig, "max_message_bytes", 1023, "at least 1024"),
    (ServerConfig, "max_event_bytes", 65535, "at least 65536"),
    (ServerConfig, "client_queue_events", 0, "at least 1"),
    (ServerConfig, "chunk_queue", 0, "at least 1"),
    (ServerConfig, "handshake_timeout_s", 0, "positive"),
    (ServerConfig, "max_request_head_bytes", 0, "at least 1"),
    (ServerConfig, "max_connection_lifetime_s", -5.0, "positive"),
    (ServerConfig, "max_connection_lifetime_s", math.nan, "positive"),
    (ServerConfig, "send_timeout_s", 0, "positive"),
    (ServerConfig, "send_timeout_s", math.nan, "positive"),
    (ServerConfig, "max_connections", 0, "at least 1"),
    (ServerConfig, "probe_connections", -1, "at least 0"),
    (ServerConfig, "suspend_timeout_s", 0, "positive"),
    (ServerConfig, "max_suspended_rollouts", 0, "at least 1"),
    (ServerConfig, "shutdown_grace_s", -1, "positive"),
    (ServerConfig, "drain_delay_s", math.inf, "between 0 and 3600"),
    (ServerConfig, "reattach_grace_s", -1, "between 0 and 3600"),
    (ServerConfig, "reattach_grace_s", math.inf, "between 0 and 3600"),
    (ServerConfig, "reattach_keep_bytes", 100, "at least 1024"),
    (ServerConfig, "max_background", 0, "at least 1"),
    (ServerConfig, "max_queued_requests", 0, "at least 1"),
    (ServerConfig, "max_queued_requests", -1, "at least 1"),
    (ServerConfig, "max_lanes", 0, "at least 1"),
    (ServerConfig, "max_pending_steers", 0, "at least 1"),
    (ServerConfig, "max_memory_bytes", 1000, "at least 1048576"),
    (ServerConfig, "max_connection_memory_bytes", 0, "at least 1048576"),
    (ServerConfig, "prepare_threads", 0, "at least 1"),
    (ServerConfig, "kv_capacity_tokens", -1, "at least 0"),
    (ServerConfig, "kv_target_fill", 0, "between 0.01 and 1"),
    (ServerConfig, "kv_target_fill", 1.5, "between 0.01 and 1"),
    (ServerConfig, "admission_growth", 0.5, "between 1 and 100"),
    (ServerConfig, "admission_growth", 101, "between 1 and 100"),
    (ServerConfig, "admission_ttl_s", 0, "positive"),
    (ServerConfig, "admission_ttl_median", -1.0, "between 0 and 1000"),
    (ServerConfig, "admission_bypass", -1, "between 0 and 1000000"),
    (ServerConfig, "admission_timeout_s", -1, "positive"),
    (ServerConfig, "pause_timeout_s", 0, "positive"),
    (ServerConfig, "admission_sync_interval_s", 0, "between 0.01 and 60"),
    (ServerConfig, "admission_sync_interval_s", 61, "between 0.01 and 60"),
    (TimingModel, "prefill_tokens_per_s", 0, "positive"),
    (TimingModel, "decode_tokens_per_s", -1, "positive"),
    (TimingModel, "burst_tokens_per_s", 0, "positive"),
    (TimingModel, "burst_share", 1.5, "between 0 and 1"),
    (TimingModel, "burst_share", math.nan, "between 0 and 1"),
]


@pytest.mark.parametrize(("cls", "field", "value", "why"), REFUSED)
def test_a_setting_out_of_range_is_refused_and_named(
    cls: type[Any], field: str, value: Any, why: str
) -> None:
    with pytest.raises(InvalidSetting) as refused:
        cls(**{field: value})
    assert refused.value.field == field
    assert why in refused.value.why and str(value) in refused.value.why


def test_every_numeric_setting_has_a_range() -> None:
    for cls in (ServerConfig, TimingModel):
        for field in attrs.fields(cls):
            if field.type in ("int", "float", "float | None"):
                assert field.validator is not None, f"{cls.__name__}.{field.name}"
                assert any(r[:2] == (cls, field.name) for r in REFUSED), field.name


@pytest.mark.parametrize(
    "settings",
    [
        {"port": 0},
        {"port": 65535},
        {"max_message_bytes": 1024},
        {"max_queued_requests": 1, "max_connections": 1},
        {"max_connection_lifetime_s": math.inf},
    ],
)
def test_the_edges_of_each_range_are_accepted(settings: dict[str, Any]) -> None:
    ServerConfig(**settings)


def test_the_edges_of_the_timing_model_are_accepted() -> None:
    TimingModel(burst_share=0, burst_tokens_per_s=None)
    TimingModel(burst_share=1, burst_tokens_per_s=4000)


def test_a_key_weight_must_be_positive() -> None:
    with pytest.raises(InvalidSetting) as refused:
        ServerConfig(key_weights=(("key:" + "0" * 32, 0.0),))
    assert refused.value.field == "key_weights"
