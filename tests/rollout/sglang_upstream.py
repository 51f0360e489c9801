"""SGLang's own code, for the contract tests (test_sglang_contract*.py): the pinned release's
request classes, SamplingParams, HTTP JSON contract (sglang.api.v1), server-argument parser and
MultiprocessingSerializer.

sglang is installed --no-deps into a folder of its own (scripts/install_sglang.sh), so only
modules whose import chain stays pure Python are imported for real: sampling_params, server_args,
utils (MultiprocessingSerializer), weight_sync.tensor_bucket, api.v1.api_types and
entrypoints.api_contract. io_struct is not importable without a GPU build: it imports
schedule_batch, which pulls the model executor, CUDA kernels (tvm_ffi, sgl_kernel) and every model
config (transformers 5). Its request classes are therefore built from io_struct.py's own source in
the installed package: the class statements are executed unchanged, with postponed annotations so
that the types they name (multimodal items, kernels' enums) need not exist.
"""

from __future__ import annotations
import __future__

import ast
import dataclasses
import importlib.metadata
import importlib.util
import logging
import os
import sys
import typing
from functools import cache
from pathlib import Path

import pytest

PINNED = "0.5.23"
INSTALL = "bash scripts/install_sglang.sh"
# io_struct's request classes that megarl's embedded server answers (see docs/rollout.md)
REQUEST_CLASSES = (
    "GenerateReqInput",
    "FlushCacheReqInput",
    "AbortReq",
    "PauseGenerationReqInput",
    "ContinueGenerationReqInput",
    "UpdateWeightFromDiskReqInput",
    "UpdateWeightsFromDistributedReqInput",
    "UpdateWeightsFromTensorReqInput",
    "InitWeightsUpdateGroupReqInput",
    "DestroyWeightsUpdateGroupReqInput",
    "UpdateWeightVersionReqInput",
    "ReleaseMemoryOccupationReqInput",
    "ResumeMemoryOccupationReqInput",
)


# where scripts/install_sglang.sh puts sglang: a folder of the virtual environment that only these
# tests put on sys.path (an importable sglang would change sglang-router and transformers for
# everything else; the script says how)
TARGET = Path(sys.prefix) / "sglang-contract"


@cache
def sglang_version() -> str:
    if not (TARGET / ".pins").is_file():
        pytest.fail(f"sglang is not installed in {TARGET}; the contract tests need it: {INSTALL}", pytrace=False)
    if str(TARGET) not in sys.path:
        sys.path.append(str(TARGET))  # after site-packages: the environment's own packages win
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"sglang is not installed in {TARGET}; the contract tests need it: {INSTALL}", pytrace=False)
    if version != PINNED:
        pytest.fail(f"sglang {version} is installed, the contract tests pin {PINNED}: {INSTALL}", pytrace=False)
    _keep_transformers_unpatched()
    return version


def _keep_transformers_unpatched() -> None:
    # sglang/__init__.py monkey-patches transformers for its 5.x releases (sglang.srt.utils.
    # hf_transformers_patches.apply_all); megarl runs transformers 4.57, where those patches fail
    # part-way, and they would change transformers for every other test in the process. Loading
    # that module first, marked as applied, keeps transformers as it is; nothing the contract tests
    # import relies on the patches. Done as soon as sglang is on sys.path, so that any later
    # `import sglang` in this process (e.g. sglang_launch's availability probe) finds it so.
    name = "sglang.srt.utils.hf_transformers_patches"
    if name not in sys.modules:
        path = importlib.metadata.distribution("sglang").locate_file("sglang/srt/utils/hf_transformers_patches.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module._applied = True
        sys.modules[name] = module


@cache
def _import_sglang():
    sglang_version()
    # `import sglang` points third-party JIT caches (TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR, ...)
    # at its own directory through os.environ; the rest of the session keeps its environment.
    before = dict(os.environ)
    import sglang

    os.environ.clear()
    os.environ.update(before)
    return sglang


def sampling_params_class():
    _import_sglang()
    from sglang.srt.sampling.sampling_params import SamplingParams

    return SamplingParams


def server_args_module():
    _import_sglang()
    import sglang.srt.server_args as server_args

    return server_args


def parse_server_args(argv: list[str]):
    """SGLang's own `sglang.launch_server` argument handling (prepare_server_args: add_cli_args,
    the --config YAML merge, argparse, ServerArgs.from_cli_args). It reconfigures the root logger
    (logging.basicConfig(force=True)); the session's logging is put back."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        return server_args_module().prepare_server_args(argv)
    finally:
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
        for handler in handlers:
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(level)


def serializer():
    _import_sglang()
    from sglang.srt.utils import MultiprocessingSerializer

    return MultiprocessingSerializer


def flattened_tensor_bucket():
    _import_sglang()
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    return FlattenedTensorBucket


@cache
def io_struct() -> dict[str, type]:
    """REQUEST_CLASSES (and their base) built from the installed io_struct.py's class statements."""
    _import_sglang()
    import msgspec

    path = importlib.metadata.distribution("sglang").locate_file("sglang/srt/managers/io_struct.py")
    tree = ast.parse(open(path).read(), str(path))
    wanted = {"BaseReq", *REQUEST_CLASSES}
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in wanted]
    missing = wanted - {c.name for c in classes}
    assert not missing, f"sglang {PINNED}'s io_struct.py has no {sorted(missing)}"
    namespace = {
        **vars(typing),
        "dataclass": dataclasses.dataclass,
        "field": dataclasses.field,
        "msgspec": msgspec,
        "__name__": "sglang_io_struct_source",
    }
    code = compile(ast.Module(body=classes, type_ignores=[]), str(path), "exec", __future__.annotations.compiler_flag)
    # @dataclass looks the class's module up in sys.modules while it reads string annotations
    sys.modules.setdefault("sglang_io_struct_source", type(sys)("sglang_io_struct_source"))
    exec(code, namespace)
    return {name: namespace[name] for name in REQUEST_CLASSES}


def fields_and_defaults(cls) -> dict[str, object]:
    """{field: default} of a dataclass or msgspec.Struct; a required field maps to REQUIRED."""
    import msgspec

    if dataclasses.is_dataclass(cls):
        out = {}
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = f.default_factory()
            else:
                out[f.name] = REQUIRED
        return out
    # __struct_fields__ / __struct_defaults__ rather than msgspec.structs.fields, which would
    # evaluate the annotations (io_struct's types are not importable here; see the module's doc)
    names, defaults = cls.__struct_fields__, cls.__struct_defaults__
    padded = (REQUIRED,) * (len(names) - len(defaults)) + tuple(defaults)
    padded = tuple(REQUIRED if d is msgspec.NODEFAULT else d for d in padded)
    return {n: d.factory() if isinstance(d, msgspec._core.Factory) else d for n, d in zip(names, padded)}


REQUIRED = object()


def api_types():
    """SGLang's generated JSON contract of its HTTP API (sglang.api.v1), which its server applies
    to /generate bodies and which describes its answers."""
    _import_sglang()
    from sglang.api.v1 import api_types

    return api_types


def generate_contract_error():
    """SGLang's /generate gate: the contract violation in a parsed body, or None."""
    _import_sglang()
    from sglang.srt.entrypoints.api_contract import generate_contract_error

    return generate_contract_error


def struct_asdict(obj) -> dict:
    """{field: value} of a msgspec.Struct (SGLang's request classes and SamplingParams)."""
    sglang_version()
    import msgspec

    return msgspec.structs.asdict(obj)
