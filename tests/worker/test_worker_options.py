"""`warmstart worker` flags: what reaches the engine and the engine process, and what is refused."""

from __future__ import annotations

import argparse

import pytest

from warmstart.api.worker_options import WorkerOptions, add_worker_arguments, worker_flags_problem
from warmstart.worker.options import check_worker_args


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    return parser.parse_args(list(flags))


def engine_options(args: argparse.Namespace) -> dict:
    return WorkerOptions.of(args).engine_options()


def engine_argv(args: argparse.Namespace, mode: str) -> list[str]:
    return WorkerOptions.of(args).engine_argv(mode)


def test_dtype_auto_leaves_the_model_its_own_dtype() -> None:
    assert "dtype" not in engine_options(parse("--dtype", "auto"))
    assert engine_options(parse("--dtype", "bfloat16"))["dtype"] == "bfloat16"


def test_release_weights_is_left_to_the_engine_unless_given() -> None:
    assert "release_weights" not in engine_options(parse())
    assert engine_options(parse("--no-release-weights"))["release_weights"] is False
    for flags, passed in (((), None), (("--release-weights",), "--release-weights"),
                          (("--no-release-weights",), "--no-release-weights")):  # fmt: skip
        argv = engine_argv(parse(*flags), "cold")
        assert [a for a in argv if a.endswith("release-weights")] == ([passed] if passed else [])
        assert engine_options(parse(*argv)) == engine_options(parse(*flags))  # the engine process agrees


def test_revision_reaches_vllm_and_is_refused_for_the_builtin_engine() -> None:
    vllm = parse("--engine", "vllm", "--model", "Qwen/Qwen3-8B", "--revision", "abc123")
    assert engine_options(vllm)["engine_args"] == {"revision": "abc123"}
    assert engine_options(parse(*engine_argv(vllm, "cold")))["engine_args"] == {"revision": "abc123"}
    builtin = parse("--revision", "abc123")
    assert check_worker_args(builtin).endswith("it needs --engine vllm")


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        (["--max-num-seqs", "8", "--compile"], None),
        (["--max-num-seq", "8"], "unrecognized arguments: --max-num-seq 8"),  # no abbreviations
        (["--dtype", "int4"], "argument --dtype: invalid choice: 'int4'"),
    ],
)
def test_worker_flags_problem_speaks_argparses_words(flags, problem) -> None:
    found = worker_flags_problem(flags)
    if problem is None:
        assert found is None
    else:
        assert found is not None and found.startswith(problem)
