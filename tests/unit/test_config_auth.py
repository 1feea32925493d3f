"""Auth cannot be turned on with a key that matches nothing, or everything."""

from __future__ import annotations

import pytest

from proto_server.engine.default_model import DefaultModel
from proto_server.engine.simulated import SimulatedGenerator
from proto_server.server.process.config import ServerConfig
from proto_server.server.rollouts.responses import Responses
from proto_server.server.store import ANONYMOUS, owner_id


@pytest.mark.parametrize("keys", [("",), (" ",), ("k1", ""), ("k1", "\t")])
def test_server_config_refuses_blank_keys(keys: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="api_keys must not hold an empty or blank key"):
        ServerConfig(api_keys=keys)


def test_an_empty_token_never_matches_and_each_key_is_its_own_owner() -> None:
    keyed = Responses(SimulatedGenerator(DefaultModel()), ServerConfig(api_keys=("k1", "k2")))
    for header in (None, "", "Bearer", "Bearer ", "Bearer   ", "Basic k1", "Bearer k3"):
        assert keyed.tenants.owner(header) is None, header
    assert keyed.tenants.owner("Bearer k1") == owner_id("k1")
    assert keyed.tenants.owner("bearer  k2 ") == owner_id("k2") != owner_id("k1")
    open_ = Responses(SimulatedGenerator(DefaultModel()), ServerConfig())
    assert open_.tenants.owner(None) == open_.tenants.owner("Bearer anything") == ANONYMOUS
