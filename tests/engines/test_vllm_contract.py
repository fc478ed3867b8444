"""The private vLLM surface the vLLM adapter relies on, checked against the pinned vLLM itself (no GPU).

`make test` installs the `vllm` extra's vLLM without its GPU-only needs into a cached directory beside the
dev environment (`vllm_contract_requirements.txt`, `make vllm-contract`); `vllm_contract.py` runs in a
process of its own with that directory on its path and reports every check, one test each here. Skipped,
with the reason, where that directory is missing and vLLM does not import here either. The checker's own
primitives are tested below on the standard library, so that each of its oracles is seen failing.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import vllm_contract
from vllm_contract import ContractError

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
REQUIREMENTS = HERE / "vllm_contract_requirements.txt"
SITE_ENV = "WARMSTART_VLLM_SITE"  # a directory holding the pinned vLLM (default: the one `make` installs)
CHECK_TIMEOUT_S = 600


def contract_site() -> Path:
    """Where `make vllm-contract` installs vLLM: named by the requirements' digest (the Makefile agrees)."""
    if os.environ.get(SITE_ENV):
        return Path(os.environ[SITE_ENV])
    cache = Path(os.environ.get("WARMSTART_CACHE") or Path.home() / ".cache" / "warmstart")
    return cache / "vllm-contract" / hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:16]


def pinned(requirements: list[str]) -> str:
    found = [line for line in requirements if re.fullmatch(r"vllm==[\w.]+", line.strip())]
    assert len(found) == 1, f"one exact vllm pin expected, got {found}"
    return found[0].strip().split("==")[1]


def checker_environment() -> dict[str, str]:
    """The checker's environment: the installed site first, or this interpreter's where vLLM imports."""
    env = dict(
        os.environ,
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        VLLM_LOGGING_LEVEL="WARNING",
    )
    site = contract_site()
    before = [path for path in env.get("PYTHONPATH", "").split(os.pathsep) if path]
    if (site / ".installed").exists():
        env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), *before])
        return env
    if importlib.util.find_spec("vllm") is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *before])  # this checkout's adapter
        return env
    pytest.skip(
        f"the pinned vLLM is not installed for the contract check ({site} is missing; `make vllm-contract` "
        f"installs it, `make test` does so first) and vLLM does not import here"
    )


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    env = checker_environment()
    out = tmp_path_factory.mktemp("vllm-contract") / "report.json"
    command = [sys.executable, str(HERE / "vllm_contract.py"), "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    assert out.exists(), (
        f"the checker crashed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return json.loads(out.read_text())


@pytest.mark.spawns
@pytest.mark.parametrize("key", [item.run.__name__ for item in vllm_contract.CHECKS])
def test_vllm_has_what_the_adapter_relies_on(report: dict[str, Any], key: str) -> None:
    result = {result["key"]: result for result in report["checks"]}[key]
    assert result["ok"], (
        f"vLLM {report['vllm']} breaks the adapter's contract: {result['name']} ({result['how']}; relied on "
        f"by {result['user']}): {result['detail']}"
    )


@pytest.mark.spawns
def test_the_checked_vllm_is_the_pinned_one(report: dict[str, Any]) -> None:
    assert report["vllm"] == pinned(REQUIREMENTS.read_text().splitlines())
    assert (
        len(report["checks"])
        == len(vllm_contract.CHECKS)
        == len({item.run.__name__ for item in vllm_contract.CHECKS})
    )


def test_the_contract_pins_the_vllm_extras_version() -> None:
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    assert pinned(extra) == pinned(REQUIREMENTS.read_text().splitlines())


# --- the checker's oracles, on stand-ins from the standard library (they must be able to fail) --------------


def test_a_call_check_fails_on_a_missing_name_a_reordered_parameter_or_an_unknown_keyword() -> None:
    assert "textwrap:indent(text, prefix" in vllm_contract.check_call("textwrap:indent", ("text", "prefix"))
    vllm_contract.check_call("textwrap:indent", ("text",), ("prefix", "predicate"))
    with pytest.raises(AttributeError, match="indentz"):
        vllm_contract.check_call("textwrap:indentz", ("text", "prefix"))
    with pytest.raises(ContractError, match=r"positional parameters \['text', 'prefix'\]"):
        vllm_contract.check_call("textwrap:indent", ("prefix", "text"))
    with pytest.raises(ContractError, match="does not bind"):
        vllm_contract.check_call("textwrap:indent", ("text", "prefix"), ("predicates",))
    with pytest.raises(ContractError, match="does not bind"):
        vllm_contract.check_call("textwrap:indent", ("text", "prefix", "predicate", "more"))


@dataclass
class Recorded:
    field_one: int = 0


class Owner:
    kind = "class attribute"

    def __init__(self) -> None:
        self.assigned: int = 1

    def method(self, first: int, second: int = 0) -> int:
        self.later = first
        return second

    @staticmethod
    def helper(first: int) -> int:
        return first


def test_methods_are_called_without_self_and_static_ones_as_they_are() -> None:
    here = f"{__name__}:Owner"
    vllm_contract.check_call(f"{here}.method", ("first", "second"))
    vllm_contract.check_call(f"{here}.helper", ("first",))
    with pytest.raises(ContractError):
        vllm_contract.check_call(f"{here}.method", ("self", "first"))


def test_an_attribute_check_sees_fields_assignments_and_class_attributes_and_fails_on_others() -> None:
    vllm_contract.check_attributes(f"{__name__}:Owner", ("kind", "assigned", "later"))
    vllm_contract.check_attributes(f"{__name__}:Recorded", ("field_one",))
    with pytest.raises(ContractError, match="has no missing"):
        vllm_contract.check_attributes(f"{__name__}:Owner", ("assigned", "missing"))


def test_a_failing_check_is_reported_with_where_it_failed() -> None:
    def broken() -> str:
        return vllm_contract.check_call("json:dumpz")

    results = vllm_contract.run_checks([vllm_contract.Check("broken", "import", "nowhere", broken)])
    assert not results[0].ok and "dumpz" in results[0].detail


def test_everything_read_of_the_engine_core_client_is_found() -> None:
    source = """
class Engine:
    def go(self):
        engine_core = self.engine_core
        engine_core.step_async(1, mode="x")
        self.engine_core.resources.engine_dead
        return self.engine_core.ranks
"""
    uses = vllm_contract.client_uses(ast.parse(source))
    assert sorted(uses) == ["ranks", "resources", "step_async"]
    call = uses["step_async"][0]
    assert call is not None and len(call.args) == 1 and call.keywords[0].arg == "mode"
    assert uses["ranks"] == [None]


def test_a_module_that_needs_the_gpu_driver_is_parsed_from_its_file_and_other_import_errors_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing = "raise ImportError('libcuda.so.1: cannot open shared object file')\n"
    (tmp_path / "needs_driver.py").write_text(failing + "class Pool:\n    instance = None\n")
    (tmp_path / "needs_other.py").write_text("raise ImportError('libsomething.so: missing')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module, tree, how = vllm_contract.import_or_source("needs_driver")
    assert module is None and "libcuda.so.1" in how and "needs_driver.py" in how
    assert "instance" in vllm_contract.assigned_attributes(vllm_contract.class_def(tree, "Pool"))
    with pytest.raises(ImportError, match="libsomething"):
        vllm_contract.import_or_source("needs_other")


def test_every_check_declares_how_it_checks() -> None:
    assert {item.how for item in vllm_contract.CHECKS} <= {"import", "run", "source", "ast"}
    assert all(inspect.isfunction(item.run) and item.user for item in vllm_contract.CHECKS)
