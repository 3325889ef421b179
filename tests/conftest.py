"""Test setup: where the kernels run, how Inductor's CPU kernels compile, the ``cuda`` marker,
the order tests start in, a clean policy per test, and the reasons of skips other than the
``cuda`` marker's at the end of the run.

Without CUDA the kernels run on CPU tensors through the Triton interpreter,
which must be chosen before any kernel is defined, hence before the package
is imported anywhere.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Inductor's CPU kernels as scalar C++ loops, in this process and in the ones tests start:
    # a tiny Qwen3-Next graph's 39 kernels compile in 17 s less than vectorized, and the shapes
    # here are a few rows of a few dozen columns.
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import torch_rmsnorm_op  # noqa: E402
from torch_rmsnorm_op import fallback  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


# The tests that take longest on CPU (their fixtures' runs included), longest first. They start
# first, and with several workers (``-n``) each worker takes the next test when it is free, so
# that no worker is left running a long test alone at the end.
LONGEST_ON_CPU = [
    "test_training.py::test_resume_after_sigterm_is_bit_exact",
    "test_model_compile.py::test_cpu_aoti_package_computes_the_norms_without_python",
    "test_rule.py::test_decoders_compile_as_the_rule_decides_and_match_the_unpatched_model",
    "test_model_benchmark.py::test_smoke_run_writes_the_declared_schema",
    "test_model_benchmark.py::test_float8_smoke_run_converts_every_linear_but_the_head",
    "test_families.py::test_family_under_inductor[qwen3_next]",
    "test_families.py::test_family_under_inductor[gemma3n]",
    "test_demo.py::test_demo_writes_runs_summary_and_says_how_to_view",
    "test_bench.py::test_bench_smoke_writes_the_declared_schema",
    "test_ops.py::test_opcheck_every_mode[split]",
    "test_compile.py::test_cpu_graphs_with_and_without_the_interpreter_are_cached_apart",
    "test_model_compile.py::test_compiled_training_step_matches_eager_stock",
    "test_ops.py::test_opcheck_every_mode[table]",
    "test_compile.py::test_cpu_graph_without_the_interpreter_compiles_the_reference",
    "test_training.py::test_integration_run",
    "test_model_compile.py::test_compiled_patched_model_matches_stock[True-inductor]",
    "test_families.py::test_family_under_inductor[gemma2]",
    "test_ops.py::test_opcheck_add_ops_and_keywords[split]",
    "test_model_compile.py::test_mark_dynamic_no_recompiles_across_batch_sizes",
    "test_cli.py::test_check_prints_table_progress_and_passes",
    "test_families.py::test_family_under_inductor",
    "test_bench.py::test_tune_dry_run_checks_every_candidate_and_writes_its_json",
    "test_bench.py::test_table_fits_in_registers",
    "test_distributed.py::",
    "test_model_compile.py::",
    "test_ops.py::test_opcheck",
    "test_ops.py::test_deterministic_bitwise",
    "test_peft.py::",
    "test_rule.py::test_importing_and_calling_the_ops_change_no_inductor_option_and_no_environment",
    "test_rule.py::test_each_direction_runs_where_the_rule_puts_it",
    "test_compile.py::",
]


def _rank(item) -> int:
    """Where ``item`` stands in ``LONGEST_ON_CPU`` (the first entry its id starts with), else after all."""
    name = item.nodeid.rpartition("/")[2]
    return next((i for i, prefix in enumerate(LONGEST_ON_CPU) if name.startswith(prefix)), len(LONGEST_ON_CPU))


def pytest_configure(config):
    # Hand the workers one test at a time, in the collection's order, rather than chunks of it.
    if getattr(config.option, "maxschedchunk", False) is None:
        config.option.maxschedchunk = 1


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)
    if not HAS_CUDA:
        items.sort(key=lambda item: (bool(item.get_closest_marker("cuda")), _rank(item)))  # stable: ties keep order
        if len(items) > 3:
            # Two workers each start with two tests: the longest and the third, the second and the fourth.
            items[1], items[2] = items[2], items[1]


def pytest_terminal_summary(terminalreporter):
    """List the tests skipped for a reason other than the ``cuda`` marker, with that reason, where
    ``-rs`` does not already: under ``-q`` a skip is otherwise one letter in a count."""
    if "s" in terminalreporter.reportchars:
        return
    rows = []
    for report in terminalreporter.stats.get("skipped", []):
        if "cuda" in report.keywords:
            continue
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        rows.append(f"{report.nodeid}: {reason.removeprefix('Skipped: ')}")
    if rows:
        terminalreporter.section("skipped here, not for want of a GPU")
        for row in sorted(rows):
            terminalreporter.line(row)


@pytest.fixture
def device() -> torch.device:
    """Where the kernels run here: CUDA, else CPU through the interpreter."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(autouse=True)
def _clean_policy(monkeypatch):
    monkeypatch.delenv(fallback.ENV_VAR, raising=False)
    torch_rmsnorm_op.set_fallback_policy(None)
    torch_rmsnorm_op.reset_dispatch_stats()
    yield
    torch_rmsnorm_op.set_fallback_policy(None)
