"""The documentation site: the CRD reference is what the chart's CRDs say, and `mkdocs build --strict` passes,
so no page has a warning, a broken link or a link to a missing anchor (and a broken anchor does fail it)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_hack(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "hack" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_crd_reference_page_is_generated_from_the_charts_crds() -> None:
    crd_reference = load_hack("crd_reference")
    expected = crd_reference.render(sorted(crd_reference.CRD_DIR.glob("*.yaml")))
    committed = crd_reference.PAGE.read_text()
    assert committed == expected, "docs/reference/crds.md is stale: run hack/crd_reference.py"


def test_crd_reference_names_every_field_and_its_checks() -> None:
    page = (ROOT / "docs" / "reference" / "crds.md").read_text()
    for field in ("spec.snapshot.prestage", "spec.autoscaling.http.targetConcurrency", "status.identityHash"):
        assert f"`{field}`" in page, field
    assert "| `spec.replicas` | integer | `1` | 0 to 1000 |" in page.replace(
        '<a id="inferenceendpoint-spec-replicas"></a>', ""
    )
    # Who writes a status field comes from the typed model both components use.
    assert re.search(r"`status\.captureState` \| string \| [^|]* \| agent \|", page)
    assert re.search(r"`status\.retryAfter` \| string \(date-time\) \|  \| operator \|", page)


def test_cli_reference_page_is_generated_from_the_parsers() -> None:
    cli_reference = load_hack("cli_reference")
    assert cli_reference.PAGE.read_text() == cli_reference.render(), (
        "docs/reference/cli.md is stale: run hack/cli_reference.py"
    )


def mkdocs_build(config_dir: Path, site: Path) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: `make test` installs it (the docs extra)")
    pytest.importorskip("material", reason="mkdocs-material is not installed: `make test` installs it")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
    return subprocess.run(command, cwd=config_dir, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.spawns
def test_site_builds_strict_with_every_link_and_anchor_resolved(tmp_path: Path) -> None:
    built = mkdocs_build(ROOT, tmp_path / "site")
    assert built.returncode == 0, built.stdout + built.stderr
    assert "WARNING" not in built.stderr, built.stderr
    pages = {p.relative_to(tmp_path / "site").as_posix() for p in (tmp_path / "site").rglob("index.html")}
    for page in ("getting-started", "architecture", "reference/crds", "reference/cli", "benchmarks"):
        assert f"{page}/index.html" in pages, sorted(pages)


@pytest.mark.spawns
def test_a_link_to_a_missing_anchor_fails_the_build(tmp_path: Path) -> None:
    """The gate itself: strict mode with anchor validation turns a dead `#anchor` into a failed build."""
    copy = tmp_path / "repo"
    copy.mkdir()
    for name in ("mkdocs.yml", "BENCHMARKS.md", "RELIABILITY.md"):
        shutil.copy(ROOT / name, copy / name)
    shutil.copytree(ROOT / "docs", copy / "docs")
    index = copy / "docs" / "index.md"
    index.write_text(index.read_text() + "\nSee [the field](reference/crds.md#no-such-field).\n")
    built = mkdocs_build(copy, tmp_path / "site")
    assert built.returncode != 0
    assert "does not contain an anchor '#no-such-field'" in built.stdout + built.stderr


def test_readme_links_resolve() -> None:
    """README.md is the repository's front page, outside the site: each of its relative links names a file."""
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    relative = [link for link in links if "://" not in link]
    assert relative, "README links to no page of the documentation"
    missing = [link for link in relative if not (ROOT / link).exists()]
    assert not missing, missing
    for page, anchor in re.findall(r"\]\((docs/[^)#\s]+\.md)#([^)\s]+)\)", readme):
        headings = re.findall(r"^#+ (.+)$", (ROOT / page).read_text(), re.M)
        slugs = {re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", h.strip().lower())) for h in headings}
        assert anchor in slugs, f"README links to {page}#{anchor}, which has no such heading"


def test_every_command_and_option_says_what_it_does() -> None:
    """`warmstart --help` and each subcommand's: a one-line summary per command, a help text per option."""
    import argparse

    from warmstart.cli import build_parser

    silent: list[str] = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helps = {choice.dest: choice.help for choice in action._choices_actions}
                for name, sub in action.choices.items():
                    if not helps.get(name) or "\n" in helps[name]:
                        silent.append(f"{path} {name}: no one-line help")
                    walk(sub, f"{path} {name}")
            elif not action.help:
                silent.append(f"{path} {'/'.join(action.option_strings) or action.dest}: no help")

    walk(build_parser(), "warmstart")
    assert not silent, silent
