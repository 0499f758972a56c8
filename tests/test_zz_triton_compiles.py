"""Last in the session (by name): every Triton kernel the other tests ran under the interpreter is
compiled for the H200 (sm_90a) on this CPU, with the argument types and constexprs it ran with. The
interpreter executes Python, so a kernel it runs may still be one the GPU compiler rejects (it ran
one whose if / else bound a name to tensors of two shapes); this catches that here instead of on the
device. The compiler runs in a fresh process: under the interpreter, kernels are not JIT functions."""
import json
import os
import subprocess
import sys

import pytest

from conftest import TRITON_LAUNCHES

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


def test_every_kernel_run_under_the_interpreter_compiles_for_sm90():
    if not TRITON_LAUNCHES:
        pytest.skip("no Triton kernel ran under the interpreter in this session")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", COMPILE], input=json.dumps(list(TRITON_LAUNCHES.values())),
                         capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    failures = json.loads(out.stdout.strip().splitlines()[-1])
    assert not failures, f"{len(failures)} of {len(TRITON_LAUNCHES)} launches fail to compile:\n" + "\n".join(failures)
