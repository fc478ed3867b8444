"""The checked-in CRDs (crds/ and the Helm chart's copies) are what the generator writes from the models."""

from __future__ import annotations

from pathlib import Path

import generate_crds as crds
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("directory", crds.OUTPUTS, ids=str)
def test_the_checked_in_crds_are_generated_from_the_models(directory: Path) -> None:
    expected = crds.files()
    assert sorted(path.name for path in (ROOT / directory).iterdir()) == sorted(expected)
    for name, text in expected.items():
        assert (ROOT / directory / name).read_text() == text, f"{directory / name} is stale: run make crds"


def test_the_output_is_the_same_every_time() -> None:
    assert crds.files() == crds.files()
    assert all(text.startswith(crds.HEADER) for text in crds.files().values())


def test_check_names_a_stale_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert crds.main(["--root", str(tmp_path)]) == 0
    assert crds.main(["--root", str(tmp_path), "--check"]) == 0
    stale = tmp_path / "charts" / "warmstart" / "crds" / "inferencesnapshots.yaml"
    stale.write_text(stale.read_text().replace("maxLength: 253", "maxLength: 254"))
    assert crds.main(["--root", str(tmp_path), "--check"]) == 1
    assert "charts/warmstart/crds/inferencesnapshots.yaml" in capsys.readouterr().err


def test_the_schema_is_structural() -> None:
    """No reference, union, title or null left from pydantic's JSON schema, and no default in a status."""
    text = "".join(crds.files().values())
    assert not any(word in text for word in ("$ref", "anyOf", "title:", "type: 'null'", "allOf"))
    for kind in crds.KINDS:
        assert "default:" not in str(crds.structural(kind.status, status=True))
