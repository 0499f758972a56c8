"""Every Triton kernel the tests ran under the interpreter is compiled for the H200 (sm_90a) on this
CPU, with the argument types and constexprs it ran with. The interpreter executes Python, so a kernel
it runs may still be one the GPU compiler rejects (it ran one whose if / else bound a name to tensors
of two shapes); this catches that on the CPU instead of on the device.

`record_launches` (called by tests/conftest.py before any kernel is imported) notes each interpreted
launch by signature; conftest's `pytest_runtestloop` compiles what the session's tests ran, whichever
tests were selected, and reports the result as one more test. The compiler runs in a fresh process:
under the interpreter, kernels are not JIT functions."""
import functools
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

NODEID = "tests/triton_compiles.py::every_kernel_run_under_the_interpreter_compiles_for_sm90"
LAUNCHES: dict = {}   # key -> launch: module, name, signature, constexprs, options (plain values)
_TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
                 torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
                 torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv"}


@functools.cache
def _jit(fn):
    import triton
    return triton.JITFunction(fn)   # parsed once a kernel, not once a launch


def _launch(kernel, args, kwargs):
    """(key, launch): the kernel's module and name, its argument types, constexprs and options, as
    plain values (compiled in a fresh process)."""
    jit = _jit(kernel.fn)
    bound = dict(zip(jit.arg_names, args)) | {k: v for k, v in kwargs.items() if k in jit.arg_names}
    signature, constexprs = {}, {}
    for i, (name, param) in enumerate(zip(jit.arg_names, jit.params)):
        value = bound.get(name, param.default)
        if i in jit.constexprs or value is None:
            signature[name] = "constexpr"
            constexprs[name] = value if isinstance(value, (int, float, str, type(None))) else repr(value)
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TRITON_TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
        else:
            signature[name] = "fp32"
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    launch = dict(module=kernel.fn.__module__, name=kernel.fn.__qualname__, signature=signature,
                  constexprs=constexprs, options=options)
    return repr(sorted(launch.items())), launch


def record_launches():
    """Note every launch the interpreter runs in LAUNCHES; nothing where Triton is not installed."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        key, launch = _launch(self, args, kwargs)
        LAUNCHES.setdefault(key, launch)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run


COMPILE = r"""
import importlib, json, sys
from triton import compile as triton_compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
failures = []
for launch in json.load(sys.stdin):
    kernel = getattr(importlib.import_module(launch["module"]), launch["name"])
    names = kernel.arg_names
    constexprs = {(names.index(k),): v for k, v in launch["constexprs"].items()}
    try:
        triton_compile(ASTSource(kernel, launch["signature"], constexprs=constexprs),
                       target=GPUTarget("cuda", 90, 32), options=launch["options"])
    except Exception as e:
        lines = str(e).strip().splitlines() or [type(e).__name__]
        failures.append(f"{launch['module']}.{launch['name']} {launch['constexprs']}: " + " | ".join(lines[-3:]))
print(json.dumps(failures))
"""


def compile_failures() -> str | None:
    """None when every recorded launch compiles for sm_90, else what failed. One compiler process a
    CPU core: with a cold Triton cache, compiling the quick suite's launches took 150 s in one process
    on a 2-core machine, half the suite."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"CUDA_VISIBLE_DEVICES": ""}
    launches = list(LAUNCHES.values())
    # each process imports torch and the kernels' modules (about 0.5 GB): a few, not one a core of a big host
    workers = min(len(launches), len(os.sched_getaffinity(0)), 8)

    def compile_share(i):
        return subprocess.run([sys.executable, "-c", COMPILE], input=json.dumps(launches[i::workers]),
                              capture_output=True, text=True, env=env, timeout=900)
    with ThreadPoolExecutor(workers) as pool:
        outs = list(pool.map(compile_share, range(workers)))
    failures = []
    for out in outs:
        if out.returncode != 0:
            return "a compiler process failed:\n" + out.stderr[-3000:]
        failures += json.loads(out.stdout.strip().splitlines()[-1])
    if failures:
        return f"{len(failures)} of {len(launches)} launches fail to compile:\n" + "\n".join(failures)
    return None
