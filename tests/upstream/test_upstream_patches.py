"""The upstream diffs under patches/: they apply cleanly, they follow the runtime fixes, and pyvene and
pyreft patched with them pass the CPU parity suite without pyvene_dist's runtime fixes.

The suite runs in a subprocess with the patched copies first on PYTHONPATH and
PYVENE_DIST_TEST_UPSTREAM naming them: ``helpers.patch()``, in this process and in every spawned rank,
then checks that the copies are what is imported, that their ``FIXES`` carry every concern with a
diff, and applies only the runtime-only fixes for torch's DDP and FSDP setup (see
``helpers.patch_upstream``). Against unpatched copies the same selection fails (docs/upstreaming.md).
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import wrapt

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "upstream_patches.py"

#: One process, DDP, FSDP2, ZeRO-2/3, gradient checkpointing, checkpoints, device_map offload, and
#: DataParallel's replicas in threads (the GPU cases of these files skip on CPU).
SUITE = [
    "tests/fixes/test_parameters.py",
    "tests/fixes/test_data_parallel.py",
    "tests/fixes/test_train_mode.py",
    "tests/fixes/test_hooks.py",
    "tests/fixes/test_devices.py",
    "tests/fixes/test_reft_compute_loss.py",
    "tests/fixes/test_reft_train_loader.py",
    "tests/fixes/test_reft_classifier_evaluate.py",
    "tests/fixes/test_reft_tokenizer_keyword.py",
    "tests/fixes/test_hf_trainer.py",
    "tests/fixes/test_weight_decay.py",
    "tests/test_user_errors.py::test_an_architecture_pyvene_does_not_map_is_named_with_the_way_to_map_it",
    "tests/test_user_errors.py::test_unit_locations_that_do_not_fit_the_batch_are_refused",
    "tests/upstream/test_pyreft_flows.py::test_readme_quickstart_passes_tokenizer_to_the_trainer",
    "tests/upstream/test_pyreft_flows.py::test_alpaca_multigpu_example_saves_checkpoints_and_loads_on_every_rank[world2]",
    "tests/upstream/test_pyreft_flows.py::test_zero3_refuses_a_model_partitioned_in_another_precision[world1]",
    "tests/fixes/test_loreft_state_dict.py",
    "tests/fixes/test_loreft_load.py",
    "tests/fixes/test_intervention_files.py",
    "tests/fixes/test_trainer_saves.py",
    "tests/fixes/test_hf_resume.py",
    "tests/fixes/test_saved_dtypes.py::test_reloaded_interventions_answer_exactly_as_trained[float32]",
    "tests/fixes/test_zero_grad.py::test_zero_grad_clears_the_base_model_and_the_interventions",
    "tests/fixes/test_pair_indexing.py::test_the_examples_loop_switches_every_intervention_to_evaluation",
    "tests/fixes/test_device_map.py",
    "tests/fixes/test_representations.py",
    "tests/fixes/test_gradient_checkpointing.py::test_checkpointed_training_equals_plain_training[mlp_output-reentrant]",
    "tests/fixes/test_gradient_checkpointing.py::test_checkpointed_training_equals_plain_training[attention_output-non-reentrant]",
    "tests/fixes/test_gradient_checkpointing.py::test_checkpointed_training_equals_plain_training[block_input-reentrant]",
    "tests/fixes/test_gradient_checkpointing.py::test_hooks_are_gone_after_backward_and_after_no_grad",
    "tests/fixes/test_gradient_checkpointing.py::test_interchange_intervention_with_sources_under_checkpointing",
    "tests/fixes/test_gradient_checkpointing.py::test_checkpointing_under_strategies_matches_plain_single[world2-ddp-reentrant]",
    "tests/fixes/test_gradient_checkpointing.py::test_checkpointing_under_strategies_matches_plain_single[world2-zero3-non-reentrant]",
    "tests/strategies/test_ddp.py::test_ddp_matches_one_process[world2-llama-fp32]",
    "tests/fixes/test_fsdp.py::test_fsdp2_matches_one_process[world2-llama-fp32]",
    "tests/fixes/test_deepspeed.py::test_zero_matches_one_process[world2-zero2]",
    "tests/fixes/test_deepspeed.py::test_zero_matches_one_process[world2-zero3]",
    "tests/fixes/test_deepspeed.py::test_zero3_partitions_the_base_model_and_the_interventions[world2]",
    "tests/fixes/test_deepspeed.py::test_zero3_saves_whole_weights_once_and_loads_them[world2]",
    "tests/fixes/test_deepspeed.py::test_interventions_on_a_model_partitioned_by_zero_init_take_its_bf16[world2]",
]


def script():
    """scripts/upstream_patches.py as a module."""
    spec = importlib.util.spec_from_file_location("upstream_patches", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(dest: Path) -> Path:
    result = subprocess.run([sys.executable, str(SCRIPT), "apply", str(dest)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    return dest


@pytest.fixture(scope="module")
def copies(tmp_path_factory) -> Path:
    """pyvene and pyreft as installed, with both series applied."""
    return build(tmp_path_factory.mktemp("upstream") / "site")


def upstream_env(copies: Path) -> dict:
    path = os.pathsep.join(filter(None, [str(copies), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "PYVENE_DIST_TEST_UPSTREAM": str(copies)}


def test_every_fix_has_a_diff_or_a_reason():
    from pyvene_dist.fixes import fixes

    upstream_patches = script()
    note = (ROOT / "docs" / "upstreaming.md").read_text()
    unexplained = [fix.name for fix in fixes() if not fix.upstream and f"| `{fix.name}` |" not in note]
    assert not unexplained, (
        f"{unexplained}: add patches/<package>/<fix>.diff (and name the package in the fix's upstream=), or give "
        "the reason it stays runtime-only in docs/upstreaming.md's table"
    )
    in_series = {}
    for package in upstream_patches.PACKAGES:
        for diff in upstream_patches.series(package):
            in_series.setdefault(diff.stem, []).append(package)
    assert in_series == {fix.name: list(fix.upstream) for fix in fixes() if fix.upstream}


def test_each_diff_mirrors_its_runtime_concern_as_it_is_now():
    result = subprocess.run([sys.executable, str(SCRIPT), "check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_patched_copies_are_imported_and_pass_the_version_guard(copies):
    code = (
        "import pyvene, pyreft; from pyvene_dist import fixes, versions;"
        "print(pyvene.__file__); print(pyreft.__file__); print(versions.mismatches(fixes.select()));"
        "print(sorted(fixes.upstreamed()) == sorted(fix.name for fix in fixes.fixes() if fix.upstream))"
    )
    result = subprocess.run([sys.executable, "-c", code], env=upstream_env(copies), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    pyvene_file, pyreft_file, mismatches, skipped = result.stdout.splitlines()[-4:]  # pyvene prints about nnsight
    assert Path(pyvene_file).is_relative_to(copies) and Path(pyreft_file).is_relative_to(copies)
    assert mismatches == "[]" and skipped == "True"


def test_patch_skips_a_concern_upstream_carries(monkeypatch):
    import pyreft
    import pyvene
    from pyvene.models.intervenable_base import BaseModel, IntervenableModel

    import pyvene_dist

    monkeypatch.setattr(pyvene, "FIXES", frozenset({"train_mode", "deepspeed", "hooks"}), raising=False)
    monkeypatch.setattr(pyreft, "FIXES", frozenset(), raising=False)
    train = vars(IntervenableModel)["train"]
    pyvene_dist.patch()
    try:
        assert pyvene_dist.is_patched()
        assert vars(IntervenableModel)["train"] is train  # pyvene carries it: left alone
        assert isinstance(vars(BaseModel)["named_parameters"], wrapt.FunctionWrapper)  # pyvene does not
        assert isinstance(vars(BaseModel)["count_parameters"], wrapt.FunctionWrapper)  # pyreft lacks its half
        # hooks is upstream, but the runtime checkpointing fix is built on the runtime hooks fix
        assert isinstance(vars(IntervenableModel)["_remove_forward_hooks"], wrapt.FunctionWrapper)
    finally:
        pyvene_dist.unpatch()
    assert not pyvene_dist.is_patched()
    assert not isinstance(vars(BaseModel)["named_parameters"], wrapt.FunctionWrapper)
    assert vars(IntervenableModel)["train"] is train


def test_upstreamed_needs_every_package_and_counts_a_missing_optional_one(monkeypatch):
    from pyvene_dist import fixes

    carried = {"pyvene": frozenset({"deepspeed", "hooks", "gradient_checkpointing"}), "pyreft": frozenset()}
    monkeypatch.setattr(fixes, "carried_fixes", lambda package: carried[package])
    assert fixes.upstreamed() == {"hooks", "gradient_checkpointing"}
    carried["pyreft"] = None  # not installed: nothing of pyreft to fix
    assert fixes.upstreamed() == {"hooks", "gradient_checkpointing", "deepspeed", *fixes.groups()["pyreft_trainer"], "hf_trainer",
                                   "weight_decay", *fixes.groups()["checkpoints"]} - {"intervention_files", "saved_dtypes",
                                                                                     # runtime-only: HF Trainer's saves
                                                                                     "fsdp_base_unsaved",
                                                                                     "zero3_base_unsaved"}


def test_fixes_are_read_without_importing_the_package(tmp_path, monkeypatch):
    from pyvene_dist import fixes

    package = tmp_path / "fixed_package_for_pyvene_dist"
    package.mkdir()
    (package / "__init__.py").write_text('raise ImportError("imported")\nFIXES = frozenset({\n    "hooks",\n})\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    assert fixes.carried_fixes(package.name) == {"hooks"}
    assert fixes.carried_fixes("no_such_package_for_pyvene_dist") is None


def test_patched_sources_pass_the_cpu_suite(copies):
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUITE]
    result = subprocess.run(command, cwd=ROOT, env=upstream_env(copies), capture_output=True, text=True, timeout=1500)
    print(result.stdout[-3000:])
    assert result.returncode == 0, f"against {copies}:\n{result.stdout[-8000:]}\n{result.stderr[-3000:]}"
    assert " passed" in result.stdout.splitlines()[-1] and " failed" not in result.stdout.splitlines()[-1]


@pytest.fixture(scope="module")
def carried(copies) -> dict:
    """package -> what the patched copy printed of its sorted ``FIXES`` (None: nothing), and the stderr: both
    packages imported in one fresh interpreter with the copies first on its path (pyreft imports pyvene anyway)."""
    code = "".join(f"import {package}; print('FIXES of {package}:'); print(sorted({package}.FIXES))\n"
                   for package in ("pyvene", "pyreft"))  # docs/upstreaming.md's line, after a line naming it
    found = subprocess.run([sys.executable, "-c", code], env=upstream_env(copies), capture_output=True, text=True)
    lines = found.stdout.splitlines()
    after = {line[len("FIXES of "):-1]: lines[number + 1] if number + 1 < len(lines) else None
             for number, line in enumerate(lines) if line.startswith("FIXES of ")}
    return {package: (after.get(package), found.stderr) for package in ("pyvene", "pyreft")}


@pytest.mark.parametrize("package", ["pyvene", "pyreft"])
def test_series_applies_with_no_fuzz_offset_or_reject(carried, package):
    from pyvene_dist import fixes

    line, stderr = carried[package]
    expected = sorted(fix.name for fix in fixes.fixes() if package in fix.upstream)
    assert line == str(expected), stderr


def test_the_note_lists_each_diff_with_its_size():
    upstream_patches = script()
    note = (ROOT / "docs" / "upstreaming.md").read_text()
    for package in upstream_patches.PACKAGES:
        for diff in upstream_patches.series(package):
            text = diff.read_text()
            row = f"| {package} | `{diff.name}` | {len(text.splitlines())} | {len(text.encode())} |"
            assert row in note, f"docs/upstreaming.md lacks the row {row!r} (lines, bytes of the diff as it is now)"
