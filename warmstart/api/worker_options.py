"""The options of `warmstart worker`: the contract between the worker and whoever starts it.

`WorkerOptions` declares each option once: its type and default, its flag's group, parser and help, which
engines take it as a keyword option, and whether the engine process gets it. From it come the worker's
parser, the engine's keyword options, the engine process's command line and the flags a restore pod must
share with its capture (`warmstart.api.restore_facts`). The operator checks an endpoint's `engine.args`
against the parser, without importing the worker or the engines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn, get_args, get_origin

from warmstart.api.control_dir import CONTROL_DIR_ENV
from warmstart.host.env import checked_seconds

DEFAULT_RESTORE_TIMEOUT = 600.0
RESTORE_TIMEOUT_ENV = "WARMSTART_RESTORE_TIMEOUT"
# The supervisor's probe endpoints on --probe-port (`warmstart.worker.probe`): `GET /ready?wait=S` answers
# 200 once the engine's /ready does, held up to S seconds (at most PROBE_WAIT_MAX_SECONDS); `GET /live`.
PROBE_READY_PATH = "/ready"
PROBE_LIVE_PATH = "/live"
PROBE_WAIT_MAX_SECONDS = 5.0
DEFAULT_START_TIMEOUT = 1800.0  # cold starts of large models take minutes; restores are much shorter

# The groups of `--help`.
ENGINE, VLLM, WORKER = "engine", "vllm engine (--engine vllm)", "worker"
HTTP = "HTTP limits (what one client may hold)"


def probe_port(engine_port: int) -> int:
    """The port the operator gives the supervisor's probe endpoints: the one after the engine's."""
    return engine_port + 1 if engine_port < 65535 else engine_port - 1


# --- parsers of one flag's text ------------------------------------------------------------------------


def seconds(text: str) -> float:
    """An argparse type: a duration (`host.env.checked_seconds`: finite, more than 0, at most ten years)."""
    try:
        return checked_seconds(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, got {text!r}") from None


def _restore_seconds(text: str) -> float:
    try:
        return seconds(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (--restore-timeout / {RESTORE_TIMEOUT_ENV})") from None


def share(text: str) -> float:
    """An argparse type: a share of a whole, more than 0 and at most 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0 < value <= 1:  # also false for nan
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most 1, got {text!r}")
    return value


def integer(minimum: int, maximum: int) -> Callable[[str], int]:
    """An argparse type: an integer from `minimum` to `maximum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"must be from {minimum} to {maximum}, got {text!r}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its messages
    return parse


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port must be an integer, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be between 0 and 65535, got {value}")
    return value


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_engine_arg(text: str) -> tuple[str, Any]:
    """`KEY=VALUE` -> (key, value); VALUE is JSON where it parses (numbers, booleans, objects), else text."""
    key, sep, raw = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key.isidentifier():
        raise ValueError(f"expected KEY=VALUE with KEY an engine argument name, got {text!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def _engine_arg(text: str) -> tuple[str, Any]:
    try:
        return parse_engine_arg(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# --- the options ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Flag:
    """How an option is read from the command line and where it goes."""

    group: str
    help: str
    parse: Callable[[str], Any] | None = None
    engines: tuple[str, ...] = ()  # the engine kinds given it as a keyword option (EVERY: all)
    keyword: str | None = None  # the engines' name for it, where it differs
    supervisor_only: bool = False  # else also on the engine process's command line
    repeated: bool = False  # the flag repeats, one value each time
    env: str | None = None  # the variable that gives its default, where one does
    text: Callable[[Any], str] = str  # a value back to a flag's text


EVERY, BOTH, BUILTIN, VLLM_ONLY = ("*",), ("builtin", "vllm"), ("builtin",), ("vllm",)


def option(
    default: Any, group: str, help: str, parse: Callable[[str], Any] | None = None, **flag: Any
) -> Any:
    """A field of `WorkerOptions`: its default and its flag."""
    metadata = {"flag": Flag(group, help, parse, **flag)}
    if isinstance(default, list):
        return field(default_factory=list, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class WorkerOptions:
    """Every option of `warmstart worker`, in the order `--help` shows them. Built from what the worker's
    parser checked (`of`); a plain dataclass, so that a restore pod's supervisor starts without pydantic."""

    engine: str = option("builtin", ENGINE, "engine kind")
    model: str = option(
        "tiny", ENGINE, "preset (tiny, demo, qwen3-0.6b, qwen3-8b) or a model dir", engines=EVERY
    )
    model_dir: str | None = option(
        None, ENGINE, "model directory (default: $WARMSTART_CACHE/models/<preset>-<seed>)", engines=EVERY
    )
    served_model_name: str | None = option(
        None, ENGINE, "the model name clients ask for (default: the preset)", engines=EVERY
    )
    device: str = option("cpu", ENGINE, "cpu, cuda or cuda:N", engines=EVERY)
    seed: int = option(
        0, ENGINE, "seed of generated or trained weights", integer(0, (1 << 32) - 1), engines=BOTH
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = option(
        None, ENGINE, "weights dtype (auto: as stored)", engines=EVERY
    )
    revision: str | None = option(None, ENGINE, "model revision of a Hugging Face model id (vllm engine)")
    max_model_len: int | None = option(
        None, ENGINE, "context length (default min(model's, 4096))", integer(1, 1 << 24), engines=EVERY
    )
    max_num_seqs: int | None = option(
        None, ENGINE, "sequences batched together (default 8 CPU, 16 GPU)", integer(1, 1 << 16), engines=EVERY
    )
    cuda_graph_sizes: list[int] | None = option(
        None, ENGINE, "decode batch sizes to capture, e.g. 1,2,4,8", _int_list, engines=EVERY,
        text=lambda sizes: ",".join(map(str, sizes)),
    )  # fmt: skip
    compile: bool = option(False, ENGINE, "torch.compile the decode step (CUDA)", engines=BUILTIN)
    release_weights: bool | None = option(
        None, ENGINE, "drop the weights before a checkpoint and reload them after resume (default: on CUDA "
        "with the cuda-vmm arena, where they come back at the same addresses; off elsewhere)",
        engines=BUILTIN,
    )  # fmt: skip
    arena: Literal["auto", "torch", "cuda-vmm"] = option(
        "auto", ENGINE, "weight/KV memory backend (auto: cuda-vmm on CUDA, which keeps addresses; torch on "
        "CPU)", engines=BUILTIN,
    )  # fmt: skip
    tensor_parallel_size: int = option(
        1, ENGINE, "processes (one per GPU) the model is split over (the builtin engine: gloo on CPU, NCCL "
        "on CUDA)", integer(1, 1024), engines=BOTH,
    )  # fmt: skip

    gpu_memory_utilization: float = option(
        0.9, VLLM, "share of GPU memory to take, more than 0 and at most 1", share, engines=BOTH
    )
    enforce_eager: bool = option(False, VLLM, "no CUDA graphs", engines=VLLM_ONLY)
    sleep_level: Literal[1, 2] = option(
        2, VLLM, "before a checkpoint: 2 drops the weights and reloads them from the model files after "
        "resume, 1 keeps them in CPU memory, inside the snapshot", int, engines=VLLM_ONLY,
    )  # fmt: skip
    engine_arg: list[tuple[str, Any]] = option(
        [], VLLM, "any other vLLM engine argument (repeatable; VALUE is JSON where it parses)", _engine_arg,
        engines=VLLM_ONLY, keyword="engine_args", repeated=True,
        text=lambda pair: f"{pair[0]}={json.dumps(pair[1])}",
    )  # fmt: skip
    api: Literal["vllm", "warmstart"] = option(
        "vllm", VLLM, "the HTTP server after resume: vllm (vLLM's own OpenAI-compatible server and its "
        "vllm:* metrics, in the worker's process) or warmstart (the worker's)", engines=VLLM_ONLY,
    )  # fmt: skip
    vllm_server_arg: list[str] = option(
        [], VLLM, "one argument for vLLM's server, as `vllm serve` takes it (repeatable, in the = form: "
        "--vllm-server-arg=--enable-auto-tool-choice --vllm-server-arg=--tool-call-parser=hermes)",
        engines=VLLM_ONLY, keyword="server_args", repeated=True,
    )  # fmt: skip

    mode: Literal["cold", "capture", "restore"] = option("cold", WORKER, "cold, capture or restore")
    host: str = option("127.0.0.1", WORKER, "HTTP listen address")
    port: int = option(8000, WORKER, "HTTP port", port_number)
    probe_port: int | None = option(
        None, WORKER, "serve the kubelet's probes on this port from the start: /ready?wait=S (held until the "
        "engine's /ready is 200) and /live (default: not served)", port_number, supervisor_only=True,
    )  # fmt: skip
    start_timeout: float = option(
        DEFAULT_START_TIMEOUT, WORKER, "seconds the engine may take to be ready before /live fails and the "
        "kubelet restarts it", seconds, supervisor_only=True,
    )  # fmt: skip

    http_keep_alive_seconds: float = option(
        5.0, HTTP, "idle connections, request heads not in and bodies stalled are cut off after this", seconds
    )
    http_max_connections: int = option(
        1024,
        HTTP,
        "open connections; past it the one waiting longest for its client goes",
        integer(1, 1 << 20),
    )
    http_max_connections_per_client: int = option(
        256, HTTP, "open connections from one address; past it that address's longest waiting goes, else a "
        "503", integer(1, 1 << 20),
    )  # fmt: skip
    http_body_timeout_seconds: float = option(
        30.0, HTTP, "a request body must arrive whole within this, else 408", seconds
    )
    max_request_bytes: int = option(
        4 << 20, HTTP, "largest request body in bytes, else 413", integer(1, 1 << 40)
    )
    max_n: int = option(16, HTTP, "largest `n` of one request", integer(1, 4096))
    max_output_tokens: int | None = option(
        None, HTTP, "largest max_tokens (default: what the context leaves)", integer(1, 1 << 24)
    )

    control_dir: str | None = option(
        None,
        WORKER,
        f"control directory shared with the agent (default ${CONTROL_DIR_ENV})",
        env=CONTROL_DIR_ENV,
    )
    log_dir: str | None = option(
        None, WORKER, "where the engine's stdout/stderr go (default <control-dir>/logs, else "
        "$WARMSTART_CACHE/logs)", supervisor_only=True,
    )  # fmt: skip
    restore_timeout: float | None = option(
        None, WORKER, "restore mode: seconds to wait for the agent before a cold start "
        f"(default ${RESTORE_TIMEOUT_ENV} or {DEFAULT_RESTORE_TIMEOUT:g})", _restore_seconds,
        supervisor_only=True,
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.dtype == "auto":  # as stored: the same options as none given
            object.__setattr__(self, "dtype", None)

    @classmethod
    def of(cls, args: argparse.Namespace) -> WorkerOptions:
        """The options in a namespace the worker's parser filled (its other attributes left out)."""
        return cls(**{name: getattr(args, name) for name in FLAGS})

    def engine_options(self) -> dict[str, Any]:
        """Keyword options for `create_engine(self.engine, ...)`; one not given is left to the engine."""
        options = {
            flag.keyword or name: getattr(self, name)
            for name, flag in FLAGS.items()
            if flag.engines and self._for_engine(flag) and getattr(self, name) is not None
        }
        if self.engine == "vllm":
            options["engine_args"] = dict(self.engine_arg) | (
                {"revision": self.revision} if self.revision else {}
            )
        return options

    def engine_argv(self, mode: str) -> list[str]:
        """The engine process's command line, in `mode` (cold or capture)."""
        return dataclasses.replace(self, mode=mode).argv()

    def argv(self, leave_out: tuple[str, ...] = ()) -> list[str]:
        """The engine process's options that its engine takes and that differ from their defaults, as flags
        in the `--flag=value` form (a value may begin with a dash): the same options give the same flags."""
        argv: list[str] = []
        for name, flag in FLAGS.items():
            value = getattr(self, name)
            default = DEFAULTS[name]
            if flag.supervisor_only or name in leave_out or value == default or not self._for_engine(flag):
                continue
            option = _option(name)
            if isinstance(value, bool):
                argv.append(option if value else "--no-" + option[2:])
            elif flag.repeated:
                argv += [f"{option}={flag.text(item)}" for item in value]
            else:
                argv.append(f"{option}={flag.text(value)}")
        return argv

    def _for_engine(self, flag: Flag) -> bool:
        """Every engine takes an option, unless the option names the engines that do."""
        return flag.engines in ((), EVERY) or self.engine in flag.engines


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


FLAGS: dict[str, Flag] = {item.name: item.metadata["flag"] for item in dataclasses.fields(WorkerOptions)}
DEFAULTS: dict[str, Any] = {name: getattr(WorkerOptions(), name) for name in FLAGS}
TYPES: dict[str, Any] = typing.get_type_hints(WorkerOptions)


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The worker's flags, one per option, in their groups; each help names the option's default."""
    groups: dict[str, Any] = {}
    for name, flag in FLAGS.items():
        default, annotation = DEFAULTS[name], TYPES[name]
        if flag.group not in groups:
            groups[flag.group] = parser.add_argument_group(flag.group)
        kwargs: dict[str, Any] = {"help": flag.help + _default_text(default)}
        if annotation is bool and default is False:
            kwargs["action"] = "store_true"
        elif annotation in (bool, bool | None):  # --x and --no-x: a default to turn off, or none at all
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs.update(type=flag.parse, choices=_choices(annotation))
        if flag.repeated:
            kwargs.update(action="append", metavar="KEY=VALUE" if flag.parse else "ARG")
        kwargs["default"] = os.environ.get(flag.env, default) if flag.env else default
        groups[flag.group].add_argument(_option(name), **kwargs)


def _default_text(default: Any) -> str:
    if default is None or isinstance(default, bool | list):
        return ""
    return f" (default {default:g})" if isinstance(default, float) else f" (default {default})"


def _choices(annotation: Any) -> tuple[Any, ...] | None:
    for candidate in (annotation, *get_args(annotation)):
        if get_origin(candidate) is Literal:
            return get_args(candidate)
    return None


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def worker_flags_problem(argv: list[str]) -> str | None:
    """Why `warmstart worker` would reject these flags (argparse's own words), or None."""
    parser = _RaisingParser(prog="warmstart worker", add_help=False, allow_abbrev=False)
    add_worker_arguments(parser)
    try:
        _, unknown = parser.parse_known_args(argv)
    except ValueError as exc:
        return str(exc)
    return f"unrecognized arguments: {' '.join(unknown)}" if unknown else None
