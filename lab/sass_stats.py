import os, sys, tempfile, subprocess, collections, re, site
site.addsitedir(".venv/lib/python3.11/site-packages"); sys.path.insert(0, ".")
sys.path.insert(0, "tools")
import compile_sm90 as c
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction
class D:
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_active_torch_device(self): return torch.device("cpu")
    def is_active(self): return True
driver.set_active(D())
run = JITFunction.run
JITFunction.run = lambda self, *a, grid, warmup, **kw: run(self, *a, grid=grid, warmup=True, **kw)
from dgemma_sampler.kernels import row_stats as rs
ptxas = sys.argv[1]
compiled = c.recording_compiles()
rs._tma_walk = lambda logits, cfg, block, aligned: bool(cfg.get("tma")) and aligned
rs.interpreting = lambda: False
n, v = 256, 262144
rows = torch.zeros(n, dtype=torch.int32)
rs.row_stats_rows(torch.empty(n, v, dtype=torch.bfloat16), rows, rows, torch.ones(1), torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), softcap=30.0, config=dict(part_blocks=8, part_group=1, **eval(sys.argv[2] if len(sys.argv) > 2 else "{}")))
k = compiled[-1]
d = tempfile.mkdtemp()
rep, lines = c.assemble(ptxas, k.asm["ptx"], os.path.join(d, "k.cubin"))
print(lines)
sass = subprocess.run([os.path.join(os.path.dirname(ptxas), "nvdisasm"), "-c", "-g", os.path.join(d, "k.cubin")], capture_output=True, text=True).stdout
open("/tmp/stats.sass", "w").write(sass)
print(len(sass.splitlines()))
