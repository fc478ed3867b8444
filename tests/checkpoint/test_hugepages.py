"""The node's transparent huge pages mode: read, selected only when it differs, and put back after a block.

Files stand in for the kernel's: the tests never change the machine's own setting.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from warmstart.checkpoint import hugepages


class KernelSetting:
    """Behaves like /sys/kernel/mm/transparent_hugepage/enabled: a word written, the list read back."""

    def __init__(self, selected: str) -> None:
        self.selected, self.writes = selected, 0

    def read_text(self) -> str:
        return " ".join(f"[{mode}]" if mode == self.selected else mode for mode in hugepages.MODES) + "\n"

    def write_text(self, word: str) -> None:
        self.selected, self.writes = word, self.writes + 1

    def __fspath__(self) -> str:  # where its writability is asked: a file anyone may write
        return os.devnull


def test_the_hugepages_mode_is_read_and_set_only_when_it_differs(tmp_path: Path) -> None:
    enabled = tmp_path / "enabled"
    enabled.write_text("always [madvise] never\n")
    assert hugepages.current_mode(enabled) == "madvise"
    assert hugepages.set_mode("madvise", enabled) == "madvise"
    assert enabled.read_text() == "always [madvise] never\n"  # already selected: not written
    assert hugepages.set_mode("always", enabled) == "madvise"
    assert enabled.read_text() == "always"  # the word the kernel takes
    with pytest.raises(ValueError, match="must be one of always, madvise, never"):
        hugepages.set_mode("sometimes", enabled)
    enabled.write_text("garbage")
    with pytest.raises(ValueError, match="does not say which mode"):
        hugepages.current_mode(enabled)


def test_a_mode_is_selected_for_a_block_and_the_earlier_one_comes_back_even_on_an_error() -> None:
    setting = KernelSetting("madvise")
    with hugepages.selected("always", setting):  # type: ignore[arg-type]
        assert hugepages.current_mode(setting) == "always"  # type: ignore[arg-type]
    assert setting.selected == "madvise" and setting.writes == 2
    with pytest.raises(RuntimeError), hugepages.selected("never", setting):  # type: ignore[arg-type]
        raise RuntimeError("the block failed")
    assert setting.selected == "madvise"
    with hugepages.selected(None, setting):  # type: ignore[arg-type]
        pass
    assert setting.writes == 4  # None: the node's setting is not touched
