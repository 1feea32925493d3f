"""The documentation site's promises that need no build: the flag page is generated, and says
what `serve` takes; the architecture page's transition table is the machine's, and every module
and method it names exists; a long module says why it is one.
(`mkdocs build --strict`, in .ci/run, checks the links and the nav.)"""

from __future__ import annotations

import argparse
import ast
import re
import unicodedata
from pathlib import Path

import pytest

from proto_server import flag_reference
from proto_server.core.response import transitions

ROOT = Path(__file__).resolve().parents[2]
FLAGS_PAGE = ROOT / "docs" / "flags.md"


def test_the_flag_page_is_the_generators_output() -> None:
    assert FLAGS_PAGE.read_text() == flag_reference.render(), (
        "docs/flags.md is stale: run python -m proto_server.flag_reference > docs/flags.md"
    )


def test_the_flag_page_lists_every_serve_flag_and_no_other(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The flags come from the settings' fields (core/settings.py) and `serve --help` lists
    them; the page must list each, and nothing else."""
    from proto_server.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    usage = capsys.readouterr().out.split("\n\n", 1)[0]  # the usage lines: every flag once
    flags = set(re.findall(r"(--[a-z0-9-]+)", usage))
    listed = set(re.findall(r"`(--[a-z0-9-]+)`", FLAGS_PAGE.read_text().split("|---|", 1)[1]))
    rows = re.findall(r"^\| `(--[a-z0-9-]+)`", FLAGS_PAGE.read_text(), re.M)

    def pair(flag: str) -> str:  # a bool's other half: --x and --no-x
        return f"--{flag[5:]}" if flag.startswith("--no-") else f"--no-{flag[2:]}"

    missing = {flag for flag in flags if flag not in listed and pair(flag) not in listed}
    assert not missing, f"serve flags docs/flags.md does not list: {sorted(missing)}"
    unknown = set(rows) - flags
    assert not unknown, f"docs/flags.md lists flags serve does not take: {sorted(unknown)}"


def test_every_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {page.name for page in (ROOT / "docs").glob("*.md")}
    assert pages == set(re.findall(r": ([a-z-]+\.md)$", nav, re.M))


def slug(heading: str) -> str:
    """A heading's anchor as MkDocs makes it (Python-Markdown's `toc.slugify`)."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def test_the_readme_links_only_to_pages_and_anchors_that_exist() -> None:
    """mkdocs checks the pages' links; the README is no page, so its links are checked here."""
    links = re.findall(r"\]\((docs/[^)#]+)(?:#([^)]+))?\)", (ROOT / "README.md").read_text())
    assert links, "the README links into the docs"
    assert [page for page, _ in links if not (ROOT / page).is_file()] == []
    for page, anchor in links:
        headings = re.findall(r"^#+ (.*)$", (ROOT / page).read_text(), re.M)
        assert not anchor or anchor in {slug(heading) for heading in headings}, (page, anchor)


def test_the_metrics_table_lists_every_metric_and_no_other() -> None:
    import prometheus_client

    import proto_server.server.process.metrics  # noqa: F401  (registers them)

    served = {
        family.name + ("_total" if family.type == "counter" else "")
        for family in prometheus_client.REGISTRY.collect()
        if family.name.startswith("proto_server_")
    }
    section = (ROOT / "docs" / "deployment.md").read_text().split("\n## Metrics\n", 1)[1]
    table = [row.split("|")[1] for row in section.splitlines() if row.startswith("| `")]
    listed = {name for cell in table for name in re.findall(r"`(proto_server_\w+)`", cell)}
    assert served - listed == set(), "metrics docs/deployment.md's table does not list"
    assert listed - served == set(), "metrics docs/deployment.md lists that /metrics lacks"


def test_the_tests_readme_names_every_test_module() -> None:
    """tests/README.md maps features to test files: a new file must be placed in it."""
    listed = (ROOT / "tests" / "README.md").read_text()
    missing = [
        path.stem
        for path in sorted((ROOT / "tests").rglob("test_*.py"))
        if not re.search(rf"\b{path.stem}\b", listed)
    ]
    assert not missing, f"add {missing} to tests/README.md's table"


#: A module longer than this says at its top why it is one module, until it is given a structure
#: (the goal: none is, and none has to say why).
LONG_MODULE_LINES = 500


def test_a_long_module_says_at_its_top_why_it_is_one() -> None:
    unexplained = []
    packages = (ROOT / "proto_server", ROOT / "benchmarks" / "proto_server_bench")
    for path in sorted(path for package in packages for path in package.rglob("*.py")):
        text = path.read_text()
        docstring = ast.get_docstring(ast.parse(text)) or ""
        if (
            text.count("\n") > LONG_MODULE_LINES
            and "Why one module of this length:" not in docstring
        ):
            unexplained.append(str(path.relative_to(ROOT)))
    assert not unexplained, f"split these, or say why each is one module: {unexplained}"


def test_no_benchmark_module_is_long_or_says_why_it_is_one() -> None:
    """The benchmarks (benchmarks/proto_server_bench) have been given a structure: a module per
    idea, none over the limit, none defending its length."""
    long_or_defended = [
        path.name
        for path in sorted((ROOT / "benchmarks" / "proto_server_bench").rglob("*.py"))
        if path.read_text().count("\n") > LONG_MODULE_LINES
        or "Why one module of this length:" in path.read_text()
    ]
    assert not long_or_defended, f"split these, a module per idea: {long_or_defended}"


def test_every_flag_the_benchmarks_flag_table_names_is_a_sections_flag() -> None:
    """docs/benchmarks.md's flag table against the sections' parsers (their settings' fields):
    a flag renamed or gone would send a reader to an error."""
    from proto_server_bench.cli import build_parser

    (subcommands,) = [a for a in build_parser()._actions if a.choices and a.dest == "section"]
    sections: dict[str, argparse.ArgumentParser] = subcommands.choices  # type: ignore[assignment]
    flags = {
        option
        for parser in sections.values()
        for action in parser._actions
        for option in action.option_strings
    }
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    table = page.split("\n## Flags\n", 1)[1].split("\n## ", 1)[0]
    named = {
        flag
        for row in table.splitlines()
        if row.startswith("| `")
        for flag in re.findall(r"`(--[a-z][\w-]*)", row.split(" | ")[0])
    }
    assert named, "the flag table names no flags any more"
    assert sorted(named - flags) == []


def test_the_architecture_pages_transition_table_is_the_machines() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    start = "<!-- the transitions table: transitions.table_markdown() -->\n"
    table = page.split(start, 1)[1].split("<!-- end of the transitions table -->", 1)[0]
    assert table == transitions.table_markdown(), (
        "docs/architecture.md's transitions table is stale: paste transitions.table_markdown()"
    )


def test_every_module_and_method_the_architecture_page_names_exists() -> None:
    # a newcomer follows these names through the code: one that was renamed or moved away
    # sends them nowhere
    page = (ROOT / "docs" / "architecture.md").read_text()
    package = ROOT / "proto_server"
    sources = {path: path.read_text() for path in package.rglob("*.py")}
    modules = set(re.findall(r"`((?:wire|core|engine|server|client|testing)/[\w/]*\w\.py)`", page))
    missing = sorted(name for name in modules if not (package / name).is_file())
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"
    methods = set(re.findall(r"`([A-Z]\w+)\.(_?[a-z]\w*)`", page))
    assert methods, "the walk of one response.append names no methods any more"
    unknown = sorted(
        f"{cls}.{name}"
        for cls, name in methods
        if not any(
            re.search(rf"^class {cls}\b", text, re.M)
            and re.search(rf"^\s+(?:async )?def {name}\b|^\s+{name}\b\s*[:=]", text, re.M)
            for text in sources.values()
        )
    )
    assert not unknown, f"docs/architecture.md names methods that do not exist: {unknown}"


def walk_layers(step: str) -> dict[str, list[str]]:
    """The modules a step of the walk names, by layer (`server/<room>` for the server's)."""
    found: dict[str, list[str]] = {}
    for module in sorted(set(re.findall(r"`((?:wire|core|engine|server)/[\w/]*\w\.py)`", step))):
        parts = module.split("/")
        layer = "/".join(parts[:2]) if parts[0] == "server" else parts[0]
        found.setdefault(layer, []).append(module)
    return found


def test_each_step_of_the_walk_opens_at_most_one_module_per_layer() -> None:
    # a newcomer following one event opens one room per layer at each step, not a search
    page = (ROOT / "docs" / "architecture.md").read_text()
    walk = page.split("## One `response.append`", 1)[1].split("\n## ", 1)[0]
    steps = re.findall(r"^\d+\. \*\*.*?(?=\n\d+\. \*\*|\n\n|\Z)", walk, re.M | re.S)
    assert len(steps) >= 8, "the walk of one response.append lost its numbered steps"
    crowded = {
        step.split("**")[1]: modules
        for step in steps
        for modules in walk_layers(step).values()
        if len(modules) > 1
    }
    assert not crowded, f"steps that name several modules of one layer: {crowded}"
    assert walk_layers(
        "`server/dialects/a.py` `server/rollouts/b.py` `core/x/c.py` `core/d.py`"
    ) == {
        "server/dialects": ["server/dialects/a.py"],
        "server/rollouts": ["server/rollouts/b.py"],
        "core": ["core/d.py", "core/x/c.py"],
    }


def test_no_issue_number_where_a_reader_cannot_resolve_it() -> None:
    # the issue tracker is the team's, not the users': docs, help and code say what they mean
    # (the benchmarks' page keeps its history, which names the issues that set its goals)
    places = [
        *(ROOT / "docs").glob("*.md"),
        ROOT / "README.md",
        *(ROOT / "proto_server").rglob("*.py"),
    ]
    found = [
        f"{path.relative_to(ROOT)}: {match}"
        for path in places
        if path.name != "benchmarks.md"
        for match in re.findall(r"\bissues? #?\d+\b", path.read_text(), re.I)
    ]
    assert not found, f"issue numbers a reader cannot resolve: {found}"
