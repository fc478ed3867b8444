"""`warmstart serve` from the command's start to the first token, and what comes before the restore's clock.

    sudo .venv/bin/python benchmarks/serve_start.py [--rounds 5] [--engine builtin --model demo --device cpu]

A first start captures a snapshot into a store of the run's own. Then each round starts `warmstart serve` as
a user does, polls its port with one-token greedy completions, and stops it once the report is printed. Two
copies of the `warmstart` package take turns, round by round: one with its modules' bytecode, as an installed
package has it (pip compiles at install), and one without, writes off, so that every start compiles each
module it imports from source (a source tree without bytecode: a read-only mount, PYTHONDONTWRITEBYTECODE).
The standard library keeps its bytecode in both.

Per round: to the first token from the command's start; `command_start` (serve's report: the command's start
to the restore's own clock: the interpreter, imports, the keys, CRIU's check, the identity lookup); `time to
ready` (the report's restore clock); and what is left (the first request, the polls). Baselines from the same
run: the interpreter's start alone (`python -c pass`) and the import of serve's restore path alone.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "warmstart"
SERVE_IMPORTS = "import warmstart.serve.cli, warmstart.serve.local_node, warmstart.checkpoint.restore"
VARIANTS = ("bytecode", "no bytecode")
COLUMNS = ("first_token", "command_start", "ready", "rest")
Rounds = dict[str, list[dict[str, float]]]  # variant -> each round's figures, by column


def package_copies(work: Path) -> dict[str, dict[str, str]]:
    """The environment of each variant: PYTHONPATH at its own copy of the package (times kept, so serve's
    identity records match), bytecode compiled into one, none in the other and none written there."""
    envs = {}
    for variant in VARIANTS:
        root = work / variant.replace(" ", "-")
        shutil.copytree(PACKAGE, root / "warmstart", ignore=shutil.ignore_patterns("__pycache__"))
        env = {key: value for key, value in os.environ.items() if key != "PYTHONPYCACHEPREFIX"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH", "")]))
        if variant == "bytecode":
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            subprocess.run([sys.executable, "-m", "compileall", "-q", str(root / "warmstart")], check=True)
        else:
            env["PYTHONDONTWRITEBYTECODE"] = "1"
        which = [sys.executable, "-c", "import warmstart; print(warmstart.__file__)"]
        found = subprocess.run(which, env=env, cwd=work, capture_output=True, text=True, check=True).stdout
        if not found.startswith(str(root)):
            raise SystemExit(f"{variant}: warmstart is imported from {found}, not from the copy {root}")
        envs[variant] = env
    return envs


def completion(port: int, model: str) -> None:
    body = {"model": model, "prompt": "The quick brown fox", "max_tokens": 1, "temperature": 0}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()


def serve_argv(args: argparse.Namespace, work: Path) -> list[str]:
    argv = [sys.executable, "-m", "warmstart", "serve", "--engine", args.engine, "--model", args.model,
            "--device", args.device, "--store", str(work / "store"), "--port", str(args.port),
            "--criu", args.criu, "--work-dir", str(work / "pods")]  # fmt: skip
    return argv + [f"--worker-arg={each}" for each in args.worker_arg]


def timed_start(args: argparse.Namespace, work: Path, env: dict[str, str]) -> dict[str, float]:
    """One `warmstart serve` to its first token; the report's figures once it printed them."""
    log = work / "serve.log"
    started = time.time()
    with log.open("w") as out:
        serve = subprocess.Popen(serve_argv(args, work), stdout=out, stderr=subprocess.STDOUT, env=env,
                                 cwd=work, start_new_session=True)  # fmt: skip
    try:
        while True:
            if serve.poll() is not None:
                raise SystemExit(f"warmstart serve exited:\n{log.read_text()[-3000:]}")
            try:
                completion(args.port, Path(args.model).name)
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.01)
        first_token = time.time() - started
        deadline = time.monotonic() + 60
        while "serving on" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        serve.wait(timeout=120)
    text = log.read_text()
    ready = re.search(r"│ restore\s+│ (\d+\.\d+) s", text)
    before = re.search(r"command_start (\d+\.\d+)s", text)
    if ready is None or before is None:
        raise SystemExit(f"not a restore, or no report:\n{text[-3000:]}")
    command_start, restore = float(before.group(1)), float(ready.group(1))
    rest = first_token - command_start - restore
    return {"first_token": first_token, "command_start": command_start, "ready": restore, "rest": rest}


def seconds_of(argv: list[str], env: dict[str, str], work: Path) -> float:
    started = time.perf_counter()
    subprocess.run(argv, env=env, cwd=work, check=True)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=5, help="starts of each variant (default 5)")
    parser.add_argument("--engine", default="builtin")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--worker-arg", action="append", default=[], help="passed on to serve (repeatable)")
    parser.add_argument("--criu", default=os.environ.get("WARMSTART_CRIU", str(REPO / "hack" / "criu")))
    parser.add_argument("--port", type=int, default=8031)
    parser.add_argument("--json", help="also write every round's figures here")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("restores need root (CRIU and the sandboxes)")
    with tempfile.TemporaryDirectory(prefix="serve-start-") as scratch:
        rounds, floors = measure(args, Path(scratch))
    print_tables(args, rounds, floors)
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rounds, "floors": floors}, indent=1))
    return 0


def measure(args: argparse.Namespace, work: Path) -> tuple[Rounds, dict[str, list[float]]]:
    """The capture, then the rounds: each variant's start and its imports alone, the interpreter's start."""
    envs = package_copies(work)
    capture = subprocess.run([*serve_argv(args, work), "--once"], env=envs["bytecode"], cwd=work,
                             capture_output=True, text=True, timeout=1800)  # fmt: skip
    if "cold+capture" not in capture.stdout:
        raise SystemExit(f"no capture at the first start:\n{capture.stdout[-3000:]}{capture.stderr[-2000:]}")
    rounds: Rounds = {variant: [] for variant in VARIANTS}
    floors: dict[str, list[float]] = {"interpreter": [], **{f"imports, {v}": [] for v in VARIANTS}}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            rounds[variant].append(timed_start(args, work, envs[variant]))
            imports = [sys.executable, "-c", SERVE_IMPORTS]
            floors[f"imports, {variant}"].append(seconds_of(imports, envs[variant], work))
        floors["interpreter"].append(seconds_of([sys.executable, "-c", "pass"], envs["bytecode"], work))
    return rounds, floors


def print_tables(args: argparse.Namespace, rounds: Rounds, floors: dict[str, list[float]]) -> None:
    print(f"warmstart serve, {args.engine}/{args.model} on {args.device}, {args.rounds} rounds, "
          f"{os.cpu_count()} CPUs, python {sys.version.split()[0]}; medians (min-max)")  # fmt: skip
    print("| warmstart's modules | to first token | command_start | time to ready (restore) | rest |")
    print("|---|---|---|---|---|")
    for variant, rows in rounds.items():
        cells = [spread([row[key] for row in rows]) for key in COLUMNS]
        print(f"| {variant} | " + " | ".join(cells) + " |")
    print()
    print("| baseline | seconds |")
    print("|---|---|")
    print(f"| the interpreter's start (`python -c pass`) | {spread(floors['interpreter'])} |")
    for variant in VARIANTS:
        print(f"| serve's restore path imported, {variant} | {spread(floors[f'imports, {variant}'])} |")


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


if __name__ == "__main__":
    sys.exit(main())
