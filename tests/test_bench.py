"""The benchmark's machinery at tiny sizes (CPU smoke; real numbers come from the GPU)."""

import json
import subprocess
import sys


def test_bench_smoke_writes_the_declared_schema(tmp_path):
    out = subprocess.run([sys.executable, "-m", "torch_rmsnorm_op", "bench", "--smoke", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (path,) = tmp_path.glob("*.json")
    result = json.loads(path.read_text())
    assert {"gpu", "torch", "triton", "date", "copy_GBs", "rows"} <= set(result)
    impls = {(r["impl"], r["pass"]) for r in result["rows"]}
    assert impls == {(i, p) for i in ("ours", "inductor", "eager") for p in ("fwd", "fwd+bwd")}
    for row in result["rows"]:
        assert {"M", "N", "dtype", "impl", "pass", "us", "GBs", "pct_of_copy"} <= set(row), row
        assert row["us"] > 0
    assert path.with_suffix(".md").exists() and path.with_suffix(".png").exists()
    if result["gpu"] == "cpu-interpreter":
        assert "not GPU timings" in path.with_suffix(".md").read_text()
