"""Launch the backward kernels once at each rung's shape on CUDA, with 1 to MAX_TERMS gradient
terms and with or without the residual's gradient; print one JSON line per launch: the error if
it failed, else the compiled kernel's shared memory, registers and spills, a hash of its PTX
(which holds source line numbers, so it differs between checkouts), and whether dx is the bits
of a launch given the summed gradient.

Run from a checkout's root on a CUDA machine: ``python PATH/compile_check.py MAX_TERMS``."""
import hashlib
import json
import sys

import torch

from torch_rmsnorm_op import _triton_compat, dispatch, launch, reference

dev = torch.device("cuda")
max_terms = int(sys.argv[1])
shapes = {torch.bfloat16: ((4096, 256), (4096, 1024), (4096, 2048), (4096, 4096), (4096, 5120), (4096, 8192),
                           (2048, 16384), (64, 65536)),
          torch.float32: ((4096, 256), (4096, 1024), (4096, 4096), (4096, 8192), (2048, 16384), (64, 65536))}
for dtype, sizes in shapes.items():
    for m, n in sizes:
        x = torch.randn(m, n, device=dev, dtype=dtype)
        w = torch.randn(n, device=dev, dtype=dtype)
        _, rstd = reference.rms_norm_forward(x, w, 1e-6)
        plan = dispatch.backward_plan(x, w, dtype)
        for terms in range(1, max_terms + 1):
            for dres in (None, torch.randn_like(x)):
                dy = torch.randn_like(x)
                more = tuple(torch.randn_like(x) for _ in range(terms - 1))
                dx, dw = torch.empty_like(x), torch.empty_like(w)
                _triton_compat._COMPILED.clear()
                row = dict(dtype=str(dtype)[6:], m=m, n=n, terms=terms, dres=dres is not None)
                try:
                    launch.backward(plan, dy, x, w, rstd, dx, dw, dres, dy_terms=more)
                    torch.cuda.synchronize()
                    if terms > 1:
                        total = sum(t.float() for t in (dy, *more)).to(dtype)
                        dx2, dw2 = torch.empty_like(x), torch.empty_like(w)
                        launch.backward(plan, total, x, w, rstd, dx2, dw2, dres)
                        row["dx_equal"] = bool(torch.equal(dx, dx2))
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
                for launcher in list(_triton_compat._COMPILED.values()):
                    c = launcher.compiled
                    if "bwd" in c.metadata.name:
                        row.update(name=c.metadata.name, shared=c.metadata.shared, regs=c.n_regs, spills=c.n_spills,
                                   ptx=hashlib.sha1(c.asm["ptx"].encode()).hexdigest()[:12])
                        break
                print(json.dumps(row), flush=True)
