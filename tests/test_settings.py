"""The agent's and the operator's settings: one model each gives every setting its flag, variable, default and
bounds; the chart sets only variables the commands read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from support import container_settings, helm_template

from warmstart.agent.settings import AgentSettings
from warmstart.cli import COMMAND_MODULES, build_parser, named_command
from warmstart.host.command_settings import SettingsError, load
from warmstart.operator.settings import OperatorSettings

CHART = Path(__file__).resolve().parents[1] / "charts" / "warmstart"
# Read by other parts of the same process, not settings of the command: the object store's client
# (snapshot.remote.config), where the agent keeps its generated key (snapshot.keys).
OTHER_VARIABLES = ("WARMSTART_S3_", "WARMSTART_KEY_DIR")


def parse(*argv: str) -> Any:
    return build_parser().parse_args(list(argv))


def test_a_flag_wins_over_its_variable_which_wins_over_the_default(monkeypatch):
    monkeypatch.delenv("WARMSTART_AGENT_MAX_RESTORES", raising=False)
    assert load(AgentSettings, parse("agent", "--node", "n")).max_restores == 2
    monkeypatch.setenv("WARMSTART_AGENT_MAX_RESTORES", "5")
    assert load(AgentSettings, parse("agent", "--node", "n")).max_restores == 5
    assert load(AgentSettings, parse("agent", "--node", "n", "--max-restores", "7")).max_restores == 7
    monkeypatch.setenv("WARMSTART_AGENT_MAX_RESTORES", "")  # empty is unset, as in a pod spec
    assert load(AgentSettings, parse("agent", "--node", "n")).max_restores == 2


def test_every_problem_is_named_with_its_flag_and_variable(monkeypatch):
    monkeypatch.setenv("WARMSTART_AGENT_MAX_RESTORES", "0")
    monkeypatch.delenv("WARMSTART_NODE_NAME", raising=False)
    with pytest.raises(SettingsError) as caught:
        load(AgentSettings, parse("agent", "--pull-timeout", "soon", "--transparent-hugepages", "sometimes"))
    problems = str(caught.value).split("; ")
    assert sorted(problem.split(":")[0] for problem in problems) == [
        "--max-restores / WARMSTART_AGENT_MAX_RESTORES",
        "--node / WARMSTART_NODE_NAME",
        "--pull-timeout / WARMSTART_AGENT_PULL_TIMEOUT_SECONDS",
        "--transparent-hugepages / WARMSTART_AGENT_TRANSPARENT_HUGEPAGES",
    ]


@pytest.mark.parametrize("model", [AgentSettings, OperatorSettings])
def test_every_setting_has_its_own_variable_and_a_description(model):
    variables = [field.validation_alias for field in model.model_fields.values()]
    assert all(isinstance(v, str) and v.startswith("WARMSTART_") for v in variables)
    assert len(set(variables)) == len(variables)
    assert all(field.description for field in model.model_fields.values())


def _containers(*flags: str) -> dict[str, dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(helm_template(CHART, *flags).stdout) if d]
    return {
        d["kind"]: d["spec"]["template"]["spec"]["containers"][0]
        for d in docs
        if d["kind"] in ("DaemonSet", "Deployment")
    }


@pytest.mark.spawns
@pytest.mark.parametrize(
    "flags",
    [
        (),
        ("--set", "agent.objectStore.bucket=b", "--set", "agent.objectStore.credentialsSecret=s",
         "--set", "agent.transparentHugepages=always", "--set", "operator.replicas=2"),
    ],
    ids=["defaults", "tuned"],
)  # fmt: skip
def test_the_chart_sets_only_variables_its_commands_read(flags):
    """A variable the chart misspells would be ignored and its default used: every WARMSTART_* variable on
    the agent's and the operator's containers is one of that command's settings (or read elsewhere in it), and
    the settings they give load."""
    containers = _containers(*flags)
    for kind, command, model in (
        ("DaemonSet", "agent", AgentSettings),
        ("Deployment", "operator", OperatorSettings),
    ):
        container = containers[kind]
        known = {field.validation_alias for field in model.model_fields.values()}
        set_here = {item["name"] for item in container["env"] if item["name"].startswith("WARMSTART_")}
        unknown = {name for name in set_here - known if not name.startswith(OTHER_VARIABLES)}
        assert not unknown, f"the chart sets {sorted(unknown)} on the {command}, which reads no such setting"
        container_settings(container, command, model)  # raises SettingsError naming what it cannot use


def commands_of(parser: Any) -> set[str]:
    return set(next(action for action in parser._actions if action.dest == "command").choices)


@pytest.mark.parametrize("command", sorted(COMMAND_MODULES))
def test_a_command_line_builds_only_its_own_commands_parser(command: str) -> None:
    """Each entry of the command table names the module that registers that command (and no other)."""
    assert named_command(["--log-level", "DEBUG", command, "--help"]) == command
    assert commands_of(build_parser(command)) == {command}
    assert commands_of(build_parser()) == set(COMMAND_MODULES)
