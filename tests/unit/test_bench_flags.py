"""`proto-server bench <section>`: a section's flags are the fields of its settings classes,
declared once (core/settings.py's `setting`), read back with `from_flags`."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
from proto_server_bench.cli import SECTIONS, Section, build_parser
from proto_server_bench.fleet import FleetSettings
from proto_server_bench.memory import MemorySettings, MiB
from proto_server_bench.runner import BenchSettings

from proto_server.core.settings import from_flags

REQUIRED = {"vllm": ["--engine-url", "http://127.0.0.1:8701/v1", "--engine-pid", "7"]}


@pytest.mark.parametrize("section", SECTIONS, ids=lambda section: section.name)
def test_a_section_without_flags_runs_its_settings_defaults(section: Section) -> None:
    args = build_parser().parse_args([section.name, *REQUIRED.get(section.name, [])])
    given = {"engine_url": "http://127.0.0.1:8701/v1", "engine_pid": 7}
    for settings in section.settings:
        default = settings() if section.name != "vllm" else attrs.evolve(settings(), **given)
        assert from_flags(settings, args) == default


def test_a_flag_reads_what_its_field_declares() -> None:
    """A pair, a list, several values, another unit, a path, a yes/no flag."""
    parse = build_parser().parse_args
    fleet = from_flags(FleetSettings, parse(["fleet", "--turns", "3,6", "--context-tokens", "400",
                                             "--step-ms", "20", "--out", "x"]))  # fmt: skip
    assert (fleet.turns, fleet.context_tokens) == ((3.0, 6.0), (400.0, 1600.0))
    assert (fleet.step_s, fleet.out_dir) == (pytest.approx(0.02), Path("x"))
    memory = from_flags(MemorySettings, parse(["memory", "--mb", "2", "--steer-flood", "2", "3",
                                               "1", "--flood-max-memory", "5", "6"]))  # fmt: skip
    assert memory == MemorySettings(
        nbytes=2 * MiB, steer_flood=(2.0, 3.0, 1.0), flood_max_memory=(5, 6)
    )
    bench = from_flags(BenchSettings, parse(["all", "--transports", "ws-prototype,http-stateless",
                                             "--decode-rates", "65,1000", "--no-prefix-cache",
                                             "--output-kb", "2", "4"]))  # fmt: skip
    assert bench.transports == ("ws-prototype", "http-stateless")
    assert (bench.decode_rates, bench.prefix_cache, bench.output_kb) == (
        (65.0, 1000.0),
        False,
        (2.0, 4.0),
    )


def test_flags_of_another_section_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """A flag belongs to its section: fleet's --replicas means nothing to bench all."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["all", "--replicas", "2"])
    assert exited.value.code == 2 and "--replicas" in capsys.readouterr().err
