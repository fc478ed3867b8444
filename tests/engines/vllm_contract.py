"""The private vLLM surface that warmstart's vLLM adapter (`warmstart/engines/vllm/`) and its benchmarks
use, checked against an installed vLLM.

Run in a process of its own with the pinned vLLM importable (`tests/engines/test_vllm_contract.py` does):

    python tests/engines/vllm_contract.py --out report.json     # exit 1 when a check fails

Every check names what the adapter relies on and how it is checked:
- import: the module is imported and the object inspected (`inspect.signature`, dataclass fields);
- run: the adapter's own code runs against vLLM (vLLM's argument parser, `EngineArgs`, `SamplingParams`);
- source: the source of an imported vLLM object, parsed, for what only its code says (who calls the method
  the adapter patches, what a method returns on every path);
- ast: the installed file parsed without importing it, for a module that does not import on this machine
  (the import error is recorded with the check).

A call check says how the adapter calls: the positional arguments by the parameter names it means (their
order is checked), the keyword arguments by name; the call must bind to vLLM's signature.
"""

from __future__ import annotations

import argparse
import ast
import atexit
import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import shutil
import sys
import tempfile
import textwrap
import time
import traceback
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Import errors that mean "no NVIDIA driver on this machine": such a module is checked from its source.
NO_DRIVER = ("libcuda.so", "libnvidia-ml.so")


class ContractError(Exception):
    """What the adapter relies on is not what this vLLM has."""


@dataclass
class Check:
    name: str  # what the adapter relies on
    how: str  # import | run | source | ast
    user: str  # where warmstart relies on it
    run: Callable[[], str]  # returns a detail; raises when the contract does not hold


@dataclass
class Result:
    key: str  # the check's function
    name: str
    how: str
    user: str
    ok: bool
    detail: str


CHECKS: list[Check] = []


def check(name: str, how: str, user: str) -> Callable[[Callable[[], str]], Callable[[], str]]:
    def register(function: Callable[[], str]) -> Callable[[], str]:
        CHECKS.append(Check(name, how, user, function))
        return function

    return register


# --- primitives ---------------------------------------------------------------------------------------------


def resolve(path: str) -> Any:
    """`module:Qual.name` -> the object (AttributeError names the first missing part)."""
    module_name, _, qualname = path.partition(":")
    found: Any = importlib.import_module(module_name)
    for part in qualname.split(".") if qualname else ():
        found = getattr(found, part)
    return found


def caller_signature(path: str) -> inspect.Signature:
    """The signature a caller binds to: a class's constructor, or a method without `self`."""
    target = resolve(path)
    signature = inspect.signature(target)
    module_name, _, qualname = path.partition(":")
    owner_name, _, name = qualname.rpartition(".")
    if inspect.isclass(target) or not owner_name:
        return signature
    owner = resolve(f"{module_name}:{owner_name}")
    if inspect.isclass(owner) and not isinstance(
        inspect.getattr_static(owner, name), staticmethod | classmethod
    ):
        signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    return signature


def bind_call(
    signature: inspect.Signature,
    positional: tuple[str, ...] = (),
    keywords: tuple[str, ...] = (),
    names: bool = True,
) -> None:
    """A call with these positional arguments and keywords must bind; with `names`, the positional ones are
    the parameters the caller means, in their order."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    named = [p.name for p in signature.parameters.values() if p.kind in kinds][: len(positional)]
    if names and len(named) == len(positional) and tuple(named) != positional:
        raise ContractError(f"positional parameters {named}, the adapter passes {list(positional)}")
    try:
        signature.bind(*positional, **dict.fromkeys(keywords))
    except TypeError as exc:
        raise ContractError(
            f"a call with {list(positional)} and {list(keywords)} does not bind: {exc}"
        ) from exc


def check_call(path: str, positional: tuple[str, ...] = (), keywords: tuple[str, ...] = ()) -> str:
    signature = caller_signature(path)
    bind_call(signature, positional, keywords)
    return f"{path}{signature}"


def assigned_attributes(tree: ast.AST) -> set[str]:
    """Names assigned as `self.NAME = ...` (or annotated) anywhere in a class's code, and class attributes."""
    names: set[str] = set()
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for target in targets:
            for leaf in ast.walk(target):
                if (
                    isinstance(leaf, ast.Attribute)
                    and isinstance(leaf.value, ast.Name)
                    and leaf.value.id == "self"
                ):
                    names.add(leaf.attr)
        if isinstance(node, ast.ClassDef):
            names |= class_level_names(node)
    return names


def class_level_names(node: ast.ClassDef) -> set[str]:
    """Names a class body assigns (`instance = None`, `instance: T | None = None`)."""
    names = set()
    for statement in node.body:
        targets = statement.targets if isinstance(statement, ast.Assign) else []
        if isinstance(statement, ast.AnnAssign):
            targets = [statement.target]
        names |= {target.id for target in targets if isinstance(target, ast.Name)}
    return names


def class_constant(node: ast.ClassDef, name: str) -> Any:
    """The literal a class body assigns to `name` (None when it assigns none)."""
    for statement in node.body:
        targets = statement.targets if isinstance(statement, ast.Assign) else []
        if isinstance(statement, ast.AnnAssign) and statement.value is not None:
            targets = [statement.target]
        if any(isinstance(target, ast.Name) and target.id == name for target in targets):
            return ast.literal_eval(statement.value)  # type: ignore[union-attr]
    return None


def source_tree(obj: Any) -> ast.AST:
    return ast.parse(textwrap.dedent(inspect.getsource(obj)))


def attributes_of(cls: type) -> set[str]:
    """What instances of `cls` have: fields (dataclass, pydantic, msgspec), class attributes, and what
    the code of its classes assigns to `self`."""
    names = set(dir(cls))
    for klass in cls.__mro__:
        if klass is object:
            continue
        if dataclasses.is_dataclass(klass):
            names |= {field.name for field in dataclasses.fields(klass)}
        for declared in (vars(klass).get("model_fields"), vars(klass).get("__struct_fields__")):
            if isinstance(declared, dict | tuple):  # pydantic's and msgspec's field declarations
                names |= set(declared)
        try:
            names |= assigned_attributes(source_tree(klass))
        except (OSError, TypeError):
            continue  # a class without Python source adds nothing more
    return names


def check_attributes(path: str, names: tuple[str, ...]) -> str:
    missing = [name for name in names if name not in attributes_of(resolve(path))]
    if missing:
        raise ContractError(f"{path} has no {', '.join(missing)}")
    return f"{path} has {', '.join(names)}"


def calls_in(tree: ast.AST, dotted: str) -> Iterator[ast.Call]:
    """Calls whose callee is written `dotted` (e.g. `self._distributed_args`)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == dotted:
            yield node


def function_def(tree: ast.AST, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return node
    raise ContractError(f"no function {name}")


def class_def(tree: ast.AST, name: str) -> ast.ClassDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise ContractError(f"no class {name}")


def import_or_source(module_name: str) -> tuple[Any, ast.AST, str]:
    """The module and its parsed source; where it cannot be imported for want of a GPU driver, None and
    the installed file's source, with the import error as the reason."""
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if not any(library in str(exc) for library in NO_DRIVER):
            raise
        spec = importlib.util.find_spec(module_name)
        if spec is None or spec.origin is None:
            raise ContractError(f"{module_name} is not installed") from exc
        reason = f"not importable here ({exc}): parsed {Path(spec.origin).name} from the installed wheel"
        return None, ast.parse(Path(spec.origin).read_text()), reason
    return module, ast.parse(inspect.getsource(module)), "imported"


# --- quiesce.py: the single-process executor's rendezvous ---------------------------------------------------

EXECUTOR = "vllm.v1.executor.uniproc_executor:UniProcExecutor"


@check("UniProcExecutor._distributed_args() returns (init method, rank, local rank)", "import", "quiesce.py")
def distributed_args() -> str:
    detail = check_call(f"{EXECUTOR}._distributed_args")
    returns = caller_signature(f"{EXECUTOR}._distributed_args").return_annotation
    if returns not in (tuple[str, int, int], "tuple[str, int, int]"):
        raise ContractError(f"returns {returns}, the file rendezvous replaces the first of (str, int, int)")
    return detail


@check(
    "UniProcExecutor._init_executor passes _distributed_args()[0] on as distributed_init_method",
    "source",
    "quiesce.py",
)
def distributed_args_used() -> str:
    tree = source_tree(resolve(f"{EXECUTOR}._init_executor"))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and ast.unparse(node.value.func) == "self._distributed_args"
        ):
            target = node.targets[0]
            if not isinstance(target, ast.Tuple) or len(target.elts) != 3:
                raise ContractError(f"unpacked as {ast.unparse(target)}")
            first = ast.unparse(target.elts[0])
            passed = [
                k for k in ast.walk(tree) if isinstance(k, ast.keyword) and k.arg == "distributed_init_method"
            ]
            if not any(ast.unparse(k.value) == first for k in passed):
                raise ContractError(f"{first} is not passed on as distributed_init_method")
            return f"{ast.unparse(node)}; {first} -> distributed_init_method"
    raise ContractError("_init_executor does not call self._distributed_args()")


@check("vLLM reads VLLM_ENABLE_V1_MULTIPROCESSING and VLLM_NO_USAGE_STATS", "import", "quiesce.py")
def environment_variables() -> str:
    known = resolve("vllm.envs:environment_variables")
    missing = [
        name for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_NO_USAGE_STATS") if name not in known
    ]
    if missing:
        raise ContractError(f"vllm.envs does not know {missing}")
    return "both in vllm.envs.environment_variables"


# --- options.py, engine.py, driver.py: vllm.LLM (--api warmstart) -------------------------------------------


@functools.cache
def model_dir() -> str:
    """A local model directory (empty: nothing here loads a model), so that no name is looked up on a hub."""
    directory = tempfile.mkdtemp(prefix="vllm-contract-model-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


def all_options() -> Any:
    from warmstart.engines.vllm.options import VllmOptions

    return VllmOptions(
        model=model_dir(),
        dtype="bfloat16",
        tensor_parallel_size=1,
        max_model_len=1024,
        max_num_seqs=8,
        gpu_memory_utilization=0.5,
        enforce_eager=False,
        seed=0,
        cuda_graph_sizes=(1, 2, 4),
        extra={"enable_prefix_caching": True},
        server_args=("--enable-auto-tool-choice", "--tool-call-parser=hermes"),
    )


@check(
    "every vllm.LLM keyword the options give is an EngineArgs field, and EngineArgs takes them",
    "run",
    "options.py",
)
def llm_kwargs_are_engine_args() -> str:
    engine_args = resolve("vllm.engine.arg_utils:EngineArgs")
    kwargs = all_options().llm_kwargs()
    fields = {field.name for field in dataclasses.fields(engine_args)}
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        raise ContractError(f"not EngineArgs fields: {unknown}")
    built = engine_args(**kwargs)
    compilation = built.compilation_config
    sizes = getattr(compilation, "cudagraph_capture_sizes", None) or compilation["cudagraph_capture_sizes"]
    if list(sizes) != [1, 2, 4] or built.enable_sleep_mode is not True:
        raise ContractError(
            f"EngineArgs kept cudagraph_capture_sizes {sizes}, sleep {built.enable_sleep_mode}"
        )
    return f"EngineArgs({', '.join(sorted(kwargs))}) built"


@check("vllm.LLM passes its **kwargs on to EngineArgs", "source", "options.py")
def llm_forwards_kwargs() -> str:
    if resolve("vllm:LLM") is not resolve("vllm.entrypoints.llm:LLM"):
        raise ContractError("vllm.LLM is not vllm.entrypoints.llm.LLM")
    check_call("vllm.entrypoints.llm:LLM", ("model",), ("enable_sleep_mode", "max_num_seqs"))
    tree = source_tree(resolve("vllm.entrypoints.llm:LLM.__init__"))
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("EngineArgs")):
            continue
        if any(keyword.arg is None and ast.unparse(keyword.value) == "kwargs" for keyword in node.keywords):
            return f"LLM.__init__ calls {ast.unparse(node.func)}(..., **kwargs)"
    raise ContractError("LLM.__init__ builds no EngineArgs with **kwargs")


LLM = "vllm.entrypoints.llm:LLM"


@check(
    "vllm.LLM: llm_engine, get_tokenizer, sleep, wake_up, collective_rpc, reset_prefix_cache, generate",
    "import",
    "engine.py, benchmarks/vllm_live.py",
)
def llm_methods() -> str:
    check_attributes(LLM, ("llm_engine",))
    check_call(f"{LLM}.get_tokenizer")
    check_call(f"{LLM}.sleep", (), ("level",))
    check_call(f"{LLM}.wake_up", (), ("tags",))
    check_call(f"{LLM}.reset_prefix_cache")
    check_call(f"{LLM}.generate", ("prompts", "sampling_params"), ("use_tqdm",))
    return check_call(f"{LLM}.collective_rpc", ("method",))


@check(
    "LLMEngine: model_config, add_request(request_id, prompt, params), step(), abort_request(ids)",
    "import",
    "driver.py, engine.py",
)
def llm_engine() -> str:
    engine = "vllm.v1.engine.llm_engine:LLMEngine"
    check_attributes(engine, ("model_config",))
    check_call(f"{engine}.add_request", ("request_id", "prompt", "params"))
    check_call(f"{engine}.abort_request", ("request_ids",))
    return check_call(f"{engine}.step")


@check(
    "RequestOutput (request_id, outputs, finished) of CompletionOutputs (text, token_ids, finish_reason)",
    "import",
    "driver.py, engine.py",
)
def request_output() -> str:
    check_attributes("vllm.outputs:RequestOutput", ("request_id", "outputs", "finished"))
    return check_attributes("vllm.outputs:CompletionOutput", ("text", "token_ids", "finish_reason"))


@check("ModelConfig has max_model_len, dtype and max_logprobs", "import", "engine.py, frontend.py")
def model_config() -> str:
    return check_attributes("vllm.config:ModelConfig", ("max_model_len", "dtype", "max_logprobs"))


@check(
    "vllm.SamplingParams takes what sampling_kwargs() gives and what the benchmarks ask",
    "run",
    "options.py, benchmarks/vllm_live.py",
)
def sampling_params() -> str:
    from warmstart.engines.base import SamplingParams
    from warmstart.engines.vllm.options import sampling_kwargs

    vllm_params = resolve("vllm:SamplingParams")
    kwargs = sampling_kwargs(SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, seed=3, stop=("x",)))
    made = vllm_params(**kwargs)
    differ = {key: getattr(made, key) for key, value in kwargs.items() if getattr(made, key) != value}
    if differ:
        raise ContractError(f"SamplingParams changed {differ}")
    vllm_params(temperature=0, max_tokens=16, detokenize=True, ignore_eos=True, logprobs=1)
    return f"SamplingParams({', '.join(sorted(kwargs))}) and the benchmark's detokenize, logprobs"


@check("the worker vLLM runs has model_runner.get_model() and reload_weights()", "import", "engine.py")
def worker_model() -> str:
    check_attributes("vllm.v1.worker.gpu_worker:Worker", ("model_runner",))
    check_call("vllm.v1.worker.gpu_worker:Worker.reload_weights")
    check_call("vllm.v1.worker.gpu_model_runner:GPUModelRunner.get_model")
    check_call("vllm.v1.worker.gpu.model_runner:GPUModelRunner.get_model")
    if "__getattr__" not in vars(resolve("vllm.v1.worker.worker_base:WorkerWrapperBase")):
        raise ContractError("WorkerWrapperBase (what collective_rpc's callable receives) forwards nothing")
    return "Worker.model_runner (either GPUModelRunner).get_model(); WorkerWrapperBase forwards to Worker"


@check(
    "Qwen3's model names the parts of its fused parameters (packed_modules_mapping)",
    "ast",
    "weights_files.py",
)
def packed_modules() -> str:
    module, tree, how = import_or_source("vllm.model_executor.models.qwen3")
    if module is not None:
        mapping = vars(module.Qwen3ForCausalLM).get("packed_modules_mapping")
    else:
        mapping = class_constant(class_def(tree, "Qwen3ForCausalLM"), "packed_modules_mapping")
    wanted = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    if mapping != wanted:
        raise ContractError(f"Qwen3ForCausalLM.packed_modules_mapping is {mapping!r}, not {wanted!r}")
    return f"q/k/v -> qkv_proj, gate/up -> gate_up_proj ({how})"


@check("collective_rpc runs a callable on the worker in process", "import", "engine.py (_worker_model)")
def collective_rpc_callable() -> str:
    for path in (
        "vllm.v1.engine.core:EngineCore.collective_rpc",
        f"{EXECUTOR}.collective_rpc",
        "vllm.v1.serial_utils:run_method",
    ):
        annotation = str(inspect.signature(resolve(path)).parameters["method"].annotation)
        if "Callable" not in annotation:
            raise ContractError(f"{path} takes method: {annotation}")
    return "method: str | Callable through EngineCore, UniProcExecutor and run_method"


@check(
    "vLLM's tokenizer: encode(text, add_special_tokens=), apply_chat_template(messages, ...), len()",
    "import",
    "engine.py",
)
def tokenizer() -> str:
    protocol = "vllm.tokenizers.protocol:TokenizerLike"
    check_call(f"{protocol}.encode", ("text",), ("add_special_tokens",))
    check_call(f"{protocol}.apply_chat_template", ("messages",), ("tokenize", "add_generation_prompt"))
    if "__len__" not in vars(resolve(protocol)):
        raise ContractError("TokenizerLike has no __len__")
    return "TokenizerLike.encode, apply_chat_template, __len__ (bos_token, chat_template read with a default)"


@check("vllm.__version__ is the pinned version", "import", "identity.py")
def version() -> str:
    import vllm

    installed = importlib.metadata.version("vllm")
    if vllm.__version__ != installed:
        raise ContractError(
            f"vllm.__version__ {vllm.__version__} but the installed distribution is {installed}"
        )
    return vllm.__version__


# --- frontend.py: vLLM's own server on AsyncLLM -------------------------------------------------------------

ASYNC_LLM = "vllm.v1.engine.async_llm:AsyncLLM"


@check(
    "vllm serve's parser knows every engine arg warmstart sets; server_namespace() builds its namespace",
    "run",
    "frontend.py",
)
def server_arguments() -> str:
    from warmstart.engines.vllm.frontend import engine_overrides, server_namespace

    options = all_options()
    parser = resolve("vllm.entrypoints.openai.cli_args:make_arg_parser")(
        resolve("vllm.utils.argparse_utils:FlexibleArgumentParser")(prog="contract")
    )
    defaults = parser.parse_args(["--model", model_dir()])
    unknown = [key for key in engine_overrides(options) if not hasattr(defaults, key)]
    if unknown:
        raise ContractError(f"vllm serve's namespace has no {unknown}: setting them would change nothing")
    args = server_namespace(options, "served", options.server_args)
    built = resolve("vllm.engine.arg_utils:AsyncEngineArgs").from_cli_args(args)
    wrong = {
        key: getattr(built, key)
        for key in ("enable_sleep_mode", "max_num_seqs", "max_model_len", "dtype")
        if getattr(built, key) != options.llm_kwargs()[key]
    }
    if wrong:
        raise ContractError(f"AsyncEngineArgs.from_cli_args lost {wrong}")
    check_call("vllm.entrypoints.openai.cli_args:validate_parsed_serve_args", ("args",))
    return f"AsyncEngineArgs from {len(engine_overrides(options))} overrides over vllm serve's defaults"


@check(
    "AsyncEngineArgs.from_cli_args(args), create_engine_config(usage_context=), log flags; "
    "UsageContext.OPENAI_API_SERVER",
    "import",
    "frontend.py",
)
def engine_args() -> str:
    check_call("vllm.engine.arg_utils:AsyncEngineArgs.from_cli_args", ("args",))
    check_call("vllm.engine.arg_utils:AsyncEngineArgs.create_engine_config", (), ("usage_context",))
    check_attributes("vllm.engine.arg_utils:AsyncEngineArgs", ("enable_log_requests", "disable_log_stats"))
    resolve("vllm.usage.usage_lib:UsageContext.OPENAI_API_SERVER")
    return "AsyncEngineArgs and UsageContext as frontend.load() uses them"


@check(
    "AsyncLLM.from_vllm_config and the AsyncLLM methods and attributes the frontend uses",
    "import",
    "frontend.py, engine.py",
)
def async_llm() -> str:
    check_call(
        f"{ASYNC_LLM}.from_vllm_config",
        (),
        ("vllm_config", "usage_context", "enable_log_requests", "disable_log_stats"),
    )
    check_attributes(ASYNC_LLM, ("engine_core", "model_config", "output_handler"))
    calls = {
        "sleep": ("level",),
        "wake_up": ("tags",),
        "collective_rpc": ("method",),
        "reset_prefix_cache": (),
        "get_supported_tasks": (),
        "generate": ("prompt", "sampling_params", "request_id"),
    }
    for name, positional in calls.items():
        check_call(f"{ASYNC_LLM}.{name}", positional)
        method = resolve(f"{ASYNC_LLM}.{name}")
        if not (inspect.iscoroutinefunction(method) or inspect.isasyncgenfunction(method)):
            raise ContractError(f"AsyncLLM.{name} is not async: the frontend awaits it")
    check_call(f"{ASYNC_LLM}.get_tokenizer")
    return check_call(f"{ASYNC_LLM}.shutdown")


@check("AsyncLLM starts a new output handler when output_handler is None", "source", "frontend.py (run)")
def output_handler_restarts() -> str:
    tree = source_tree(resolve(f"{ASYNC_LLM}._run_output_handler"))
    guards = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Compare)]
    if "self.output_handler is not None" not in guards:
        raise ContractError(f"_run_output_handler's guards are {guards}")
    return "_run_output_handler returns early only while self.output_handler is not None"


@check(
    "build_app(args, supported_tasks, model_config) and async init_app_state(engine_client, state, args, "
    "supported_tasks)",
    "import",
    "frontend.py",
)
def server_app() -> str:
    server = "vllm.entrypoints.openai.api_server"
    check_call(f"{server}:build_app", ("args", "supported_tasks", "model_config"))
    detail = check_call(f"{server}:init_app_state", ("engine_client", "state", "args", "supported_tasks"))
    if not inspect.iscoroutinefunction(resolve(f"{server}:init_app_state")):
        raise ContractError("init_app_state is not a coroutine function: the frontend awaits it")
    return detail


@check("get_prometheus_registry() and the vllm:num_requests_waiting/running series", "import", "frontend.py")
def metrics() -> str:
    check_call("vllm.v1.metrics.prometheus:get_prometheus_registry")
    from warmstart.engines.vllm.frontend import VLLM_RUNNING, VLLM_WAITING

    text = inspect.getsource(importlib.import_module("vllm.v1.metrics.loggers"))
    missing = [name for name in (VLLM_WAITING, VLLM_RUNNING) if f'"{name}"' not in text]
    if missing:
        raise ContractError(f"vllm.v1.metrics.loggers defines no {missing}")
    return f"{VLLM_WAITING} and {VLLM_RUNNING} defined in vllm.v1.metrics.loggers"


# --- inproc_client.py: the engine core in this process ------------------------------------------------------

CORE = "vllm.v1.engine.core:EngineCore"
# What AsyncLLM may ask of its engine-core client that an in-process core of a world of one has no use for.
NOT_IN_PROCESS = {"scale_elastic_ep": "elastic expert parallelism rescales a data-parallel engine"}


@check(
    "EngineCoreClient.make_async_mp_client is a staticmethod taking (vllm_config, executor_class, log_stats)",
    "import",
    "inproc_client.py",
)
def make_async_mp_client() -> str:
    client = resolve("vllm.v1.engine.core_client:EngineCoreClient")
    if not isinstance(vars(client).get("make_async_mp_client"), staticmethod):
        raise ContractError("EngineCoreClient.make_async_mp_client is not a staticmethod of the class itself")
    return check_call(
        "vllm.v1.engine.core_client:EngineCoreClient.make_async_mp_client",
        ("vllm_config", "executor_class", "log_stats"),
    )


@check(
    "AsyncLLM builds its client with EngineCoreClient.make_async_mp_client, by a call that binds to the "
    "adapter's replacement (set and put back by inproc_engine_core())",
    "source",
    "inproc_client.py",
)
def async_llm_builds_client_there() -> str:
    from warmstart.engines.vllm.inproc_client import inproc_engine_core

    client = resolve("vllm.v1.engine.core_client:EngineCoreClient")
    original = vars(client)["make_async_mp_client"]
    with inproc_engine_core():
        replacement = inspect.signature(client.make_async_mp_client)
    if vars(client)["make_async_mp_client"] is not original:
        raise ContractError("inproc_engine_core() did not put vLLM's make_async_mp_client back")
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    first = tuple(p.name for p in replacement.parameters.values() if p.kind in kinds)[:3]
    bind_call(inspect.signature(original.__func__), first)  # the replacement's order is vLLM's
    built = list(
        calls_in(source_tree(resolve(f"{ASYNC_LLM}.__init__")), "EngineCoreClient.make_async_mp_client")
    )
    if not built:
        raise ContractError("AsyncLLM.__init__ does not call EngineCoreClient.make_async_mp_client")
    for call in built:
        keywords = tuple(keyword.arg for keyword in call.keywords if keyword.arg)
        bind_call(replacement, tuple(f"arg{i}" for i in range(len(call.args))), keywords, names=False)
    return f"AsyncLLM.__init__: {ast.unparse(built[0])[:160]}"


@check(
    "EngineCore(vllm_config, executor_class, log_stats) and the core methods the client calls",
    "import",
    "inproc_client.py",
)
def engine_core() -> str:
    check_call(CORE, ("vllm_config", "executor_class", "log_stats"))
    check_attributes(CORE, ("step_fn", "scheduler"))
    check_call(f"{CORE}.post_step", (), ("model_executed",))
    check_call(f"{CORE}.preprocess_add_request", ("request",))
    check_call(f"{CORE}.add_request", ("request", "request_wave"))
    check_call(f"{CORE}.abort_requests", ("request_ids",))
    check_call(f"{CORE}.sleep", ("level", "mode"))
    check_call(f"{CORE}.collective_rpc", ("method", "timeout", "args", "kwargs"))
    check_call(f"{CORE}.shutdown")
    check_call("vllm.v1.core.sched.interface:SchedulerInterface.has_requests")
    adds = str(caller_signature(f"{CORE}.preprocess_add_request").return_annotation)
    steps = str(caller_signature(f"{CORE}.step").return_annotation)
    if "tuple" not in adds or "dict[int" not in steps:
        raise ContractError(f"preprocess_add_request -> {adds}; step -> {steps}")
    return f"step -> {steps}; preprocess_add_request -> {adds}"


@check("EngineCoreOutputs carry outputs and scheduler_stats", "import", "inproc_client.py")
def core_outputs() -> str:
    return check_attributes("vllm.v1.engine:EngineCoreOutputs", ("outputs", "scheduler_stats"))


@check(
    "the in-process core sleeps synchronously: EngineCore.pause_scheduler returns None on every path",
    "source",
    "inproc_client.py (sleep_async)",
)
def sleep_is_synchronous() -> str:
    function = function_def(source_tree(resolve(f"{CORE}.pause_scheduler")), "pause_scheduler")
    returns = [node for node in ast.walk(function) if isinstance(node, ast.Return)]
    if not returns or any(node.value is not None and ast.unparse(node.value) != "None" for node in returns):
        raise ContractError(
            f"returns {[ast.unparse(node) for node in returns]}: a future the client never awaits"
        )
    return "EngineCore.pause_scheduler: return None (EngineCore.sleep then returns None)"


def client_uses(tree: ast.AST) -> dict[str, list[ast.Call | None]]:
    """What code reads of `self.engine_core` (or a local `engine_core`): name -> its calls (None: a read)."""

    def is_client(node: ast.expr) -> bool:
        return ast.unparse(node) in ("self.engine_core", "engine_core")

    uses: dict[str, list[ast.Call | None]] = {}
    called: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_client(node.func.value):
            uses.setdefault(node.func.attr, []).append(node)
            called.add(id(node.func))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_client(node.value) and id(node) not in called:
            uses.setdefault(node.attr, []).append(None)
    return uses


def client_member(name: str) -> inspect.Signature | None:
    """How InprocAsyncClient answers `name`: a method's signature, None for an attribute; raises if not."""
    from warmstart.engines.vllm.inproc_client import InprocAsyncClient

    client = InprocAsyncClient(core=None)
    if name in vars(InprocAsyncClient):
        return caller_signature(f"warmstart.engines.vllm.inproc_client:InprocAsyncClient.{name}")
    if name in vars(client):
        return None
    if name.endswith("_async") and hasattr(resolve(CORE), name.removesuffix("_async")):
        return caller_signature(f"{CORE}.{name.removesuffix('_async')}")  # __getattr__ -> the core's method
    raise ContractError(f"InprocAsyncClient has no {name}")


@check(
    "everything AsyncLLM asks of its engine-core client, InprocAsyncClient answers with a binding call",
    "source",
    "inproc_client.py",
)
def client_surface() -> str:
    from warmstart.engines.vllm.inproc_client import _Resources

    tree = ast.parse(inspect.getsource(importlib.import_module(ASYNC_LLM.split(":")[0])))
    uses = client_uses(tree)
    problems = []
    for name, calls in sorted(uses.items()):
        if name in NOT_IN_PROCESS:
            continue
        try:
            signature = client_member(name)
            for call in calls:
                if call is not None and signature is not None:
                    bind_call(
                        signature,
                        tuple(f"arg{i}" for i in range(len(call.args))),
                        tuple(k.arg for k in call.keywords if k.arg),
                        names=False,
                    )
        except ContractError as exc:
            problems.append(f"{name}: {exc}")
    read = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and ast.unparse(node.value).endswith("engine_core.resources")
    }
    problems += [f"resources.{name}" for name in read - {f.name for f in dataclasses.fields(_Resources)}]
    if problems:
        raise ContractError("; ".join(problems))
    left = ", ".join(f"{name} ({why})" for name, why in NOT_IN_PROCESS.items())
    return f"{len(uses)} names ({', '.join(sorted(uses))}); not in process: {left}"


# --- memory.py: the sleep allocator -------------------------------------------------------------------------


@check(
    "CuMemAllocator.instance, pointer_to_data of AllocationData(handle, tag, is_asleep), allocator_and_pools "
    "of (MemPool, allocator)",
    "ast",
    "memory.py",
)
def cumem_allocator() -> str:
    module, tree, how = import_or_source("vllm.device_allocator.cumem")
    allocator = class_def(tree, "CuMemAllocator")
    missing = {"instance", "pointer_to_data", "allocator_and_pools"} - assigned_attributes(allocator)
    if missing:
        raise ContractError(f"CuMemAllocator has no {sorted(missing)}")
    if module is not None and not hasattr(module.CuMemAllocator, "instance"):
        raise ContractError("CuMemAllocator.instance is not a class attribute")
    helper = function_def(tree, "use_memory_pool_with_allocator")
    pools = {
        ast.unparse(node.targets[0])
        for node in ast.walk(helper)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and ast.unparse(node.value.func).endswith("MemPool")
    }
    yields = [node.value for node in ast.walk(helper) if isinstance(node, ast.Yield)]
    if not yields or not isinstance(yields[0], ast.Tuple) or ast.unparse(yields[0].elts[0]) not in pools:
        raise ContractError("use_memory_pool_with_allocator does not yield (MemPool, allocator)")
    stored = [
        ast.unparse(node)
        for node in ast.walk(function_def(allocator, "use_memory_pool"))
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "self.allocator_and_pools[tag]"
    ]
    if not stored:
        raise ContractError("use_memory_pool does not store its pool in allocator_and_pools[tag]")
    check_attributes("vllm.device_allocator:AllocationData", ("handle", "tag", "is_asleep"))
    if len(typing.get_args(resolve("vllm.device_allocator:HandleType"))) != 4:
        raise ContractError("HandleType is not (device, size, pointer, handle)")
    return f"{how}; allocator_and_pools[tag] = (MemPool, allocator); AllocationData.handle[1] is the size"


# --- kv_cache.py: the KV cache woken on the stager's memory ------------------------------------------------


@check(
    "CuMemAllocator.wake_up calls the module's create_and_map(data.handle) for each allocation, which hands "
    "the handle to python_create_and_map(device, size, address, handle slot)",
    "ast",
    "kv_cache.py",
)
def wake_up_creates_through_the_module() -> str:
    _module, tree, how = import_or_source("vllm.device_allocator.cumem")
    wake_up = function_def(class_def(tree, "CuMemAllocator"), "wake_up")
    handle_names = {
        ast.unparse(node.targets[0])
        for node in ast.walk(wake_up)
        if isinstance(node, ast.Assign) and ast.unparse(node.value) == "data.handle"
    }
    calls = [ast.unparse(call.args[0]) for call in calls_in(wake_up, "create_and_map") if len(call.args) == 1]
    if not calls or not set(calls) <= handle_names | {"data.handle"}:
        raise ContractError(f"wake_up does not call create_and_map(data.handle): {calls}")
    helper = function_def(tree, "create_and_map")
    forwarded = [ast.unparse(call) for call in calls_in(helper, "python_create_and_map")]
    if forwarded != [f"python_create_and_map(*{helper.args.args[0].arg})"]:
        raise ContractError(f"create_and_map does not forward its handle whole: {forwarded}")
    return f"{how}; wake_up -> create_and_map(handle) -> python_create_and_map(*handle)"


# --- benchmarks/vllm_bench.py: what it asks of vLLM's server ------------------------------------------------


@check(
    "completions take return_token_ids, logprobs, return_tokens_as_token_ids, skip_special_tokens and "
    "answer token_ids and per-token logprobs, tokens named token_id:N",
    "run",
    "benchmarks/vllm_bench.py",
)
def completion_fields() -> str:
    protocol = "vllm.entrypoints.openai.completion.protocol"
    check_attributes(
        f"{protocol}:CompletionRequest",
        (
            "prompt",
            "max_tokens",
            "temperature",
            "ignore_eos",
            "logprobs",
            "return_token_ids",
            "return_tokens_as_token_ids",
            "skip_special_tokens",
        ),
    )
    check_attributes(f"{protocol}:CompletionResponseChoice", ("text", "token_ids", "logprobs"))
    check_attributes(f"{protocol}:CompletionLogProbs", ("tokens", "token_logprobs", "top_logprobs"))
    named = resolve("vllm.entrypoints.generate.base.serving:format_token_id_placeholder")(7)
    if named != "token_id:7":
        raise ContractError(f"a token named by its id reads {named!r}, the benchmark parses 'token_id:N'")
    return f"CompletionRequest, CompletionResponseChoice, CompletionLogProbs; tokens named {named!r}"


@check(
    "python -m vllm.entrypoints.openai.api_server takes the benchmark's flags",
    "run",
    "benchmarks/vllm_bench.py (vllm_serve)",
)
def api_server_main() -> str:
    module = importlib.import_module("vllm.entrypoints.openai.api_server")
    mains = [
        node
        for node in ast.parse(inspect.getsource(module)).body
        if isinstance(node, ast.If)
        and ast.unparse(node.test) in ('__name__ == "__main__"', "__name__ == '__main__'")
    ]
    if not mains:
        raise ContractError("vllm.entrypoints.openai.api_server has no __main__ block")
    parser = resolve("vllm.entrypoints.openai.cli_args:make_arg_parser")(
        resolve("vllm.utils.argparse_utils:FlexibleArgumentParser")(prog="contract")
    )
    args = parser.parse_args(
        [
            "--model",
            model_dir(),
            "--served-model-name",
            "m",
            "--host",
            "127.0.0.1",
            "--port",
            "8130",
            "--dtype",
            "bfloat16",
            "--gpu-memory-utilization",
            "0.85",
            "--max-model-len",
            "1024",
            "--max-num-seqs",
            "256",
        ]
    )
    return f"parsed: port {args.port}, dtype {args.dtype}, max_num_seqs {args.max_num_seqs}"


# --- running ------------------------------------------------------------------------------------------------


def select_platform() -> str:
    """vLLM's detected platform; where none is detected (no GPU), vLLM's CPU platform, so that its
    configuration code (argument defaults) runs. Must come before any vLLM module reads the platform."""
    import vllm.platforms as platforms

    detected = platforms.current_platform
    if detected.device_type:
        return f"{type(detected).__name__} (detected)"
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()
    return "CpuPlatform (no GPU detected here; vllm.platforms.cuda links libcuda.so.1)"


def run_checks(checks: list[Check]) -> list[Result]:
    results = []
    for item in checks:
        try:
            results.append(Result(item.run.__name__, item.name, item.how, item.user, True, item.run()))
        except Exception as exc:  # noqa: BLE001 (every failure is a finding, reported with its check)
            where = traceback.extract_tb(exc.__traceback__)[-1]
            detail = f"{type(exc).__name__}: {exc} (at {Path(where.filename).name}:{where.lineno})"
            results.append(Result(item.run.__name__, item.name, item.how, item.user, False, detail))
    return results


def environment() -> dict[str, str]:
    import torch

    return {
        "vllm": importlib.metadata.version("vllm"),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "vllm_from": str(Path(importlib.util.find_spec("vllm").origin).parent),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="where the JSON report goes")
    args = parser.parse_args()
    started = time.monotonic()
    platform = select_platform()
    results = run_checks(CHECKS)
    report = {
        **environment(),
        "platform": platform,
        "seconds": round(time.monotonic() - started, 1),
        "checks": [dataclasses.asdict(result) for result in results],
    }
    args.out.write_text(json.dumps(report, indent=1))
    return 0 if all(result.ok for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
