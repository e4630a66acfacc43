import re
import site
import sys

site.addsitedir(".venv/lib/python3.11/site-packages")
sys.path.insert(0, ".")
sys.path.insert(0, "tools")
import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import compile_sm90 as c  # noqa: E402


class D:
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_active_torch_device(self): return torch.device("cpu")
    def is_active(self): return True


driver.set_active(D())
run = JITFunction.run
JITFunction.run = lambda self, *a, grid, warmup, **kw: run(self, *a, grid=grid, warmup=True, **kw)
sys.path.insert(0, "tests")
import test_logit_row as t  # noqa: E402

compiled = c.recording_compiles()
x = torch.empty(4096)
outs = {}
for below in (False, True):
    t._softcap(x, 30.0, below)
    ptx = compiled[-1].asm["ptx"]
    body = [ln.strip() for ln in ptx.splitlines() if re.match(r"\s*(fma|mul|add|sub|ex2|rcp|and|or|setp|selp)", ln)]
    outs[below] = body
    print(below, len(body))
    print("\n".join(body[:40]))
    print("....")
import collections
for below, body in outs.items():
    ops = collections.Counter(ln.split()[0] for ln in body)
    print(below, dict(ops))
