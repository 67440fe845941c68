"""tools/bench_tms.py without a GPU: the staged source is found or its absence explained, the
rounds rotate, the tensors add up, and the table and RESULT line come out right from fake
per-process results (the child processes are replaced here; they need a device)."""
import os
import subprocess
import types

import pytest

from _harness import load_tool
from torch_budget.units import GiB, KiB, MiB

tool = load_tool("bench_tms")

FAKE_SOURCE = {
    "setup.py": "print('setup')\n",
    "LICENSE": "license\n",
    "csrc/core.cpp": "// core\n",
    "csrc/entrypoint.cpp": "// entry\n",
    "torch_memory_saver/__init__.py": "",
    "torch_memory_saver/utils.py": "",
    "test/test_examples.py": "",  # not part of what is staged
}


def write_tree(root, files):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_missing_or_partial_source_folder_is_explained(tmp_path):
    missing = tool.staged_problem(str(tmp_path / ".tms_src"))
    assert "is missing" in missing and "--stage" in missing
    write_tree(tmp_path / "partial", {"setup.py": ""})
    partial = tool.staged_problem(str(tmp_path / "partial"))
    assert "csrc/core.cpp" in partial and "torch_memory_saver/__init__.py" in partial
    write_tree(tmp_path / "whole", FAKE_SOURCE)
    assert tool.staged_problem(str(tmp_path / "whole")) is None


def test_building_without_a_staged_source_says_so_and_builds_nothing(tmp_path):
    ok, said = tool.build(str(tmp_path / ".tms_src"), "2.11.0", 13)
    assert not ok and "is missing" in said
    assert not (tmp_path / ".tms_src").exists()


def test_staging_takes_the_package_source_from_a_checkout_or_a_git_directory(tmp_path):
    checkout = tmp_path / "checkout"
    write_tree(checkout, FAKE_SOURCE)
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(checkout)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "source"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    for source in (checkout, checkout / ".git"):
        src = tmp_path / "staged"
        where = tool.stage(str(source), str(src))
        assert commit in where and (src / "STAGED_FROM").read_text().strip() == where
        assert tool.staged_problem(str(src)) is None
        assert (src / "LICENSE").read_text() == "license\n"
        assert not (src / "test").exists() and not (src / ".git").exists()


def test_the_toolkit_stubs_need_no_link_of_their_own(tmp_path):
    write_tree(tmp_path / "cuda", {"lib64/stubs/libcuda.so": ""})
    assert tool.libcuda_folder(str(tmp_path / "cuda"), str(tmp_path / "link")) == (None, None)
    assert not (tmp_path / "link").exists()


def test_rounds_rotate_every_configuration_into_every_place():
    keys = [[c.key for c in tool.round_order(tool.CONFIGS, r)] for r in range(4)]
    assert keys[0] == ["tb", "tms", "tms_retain"]
    assert keys[1] == ["tms", "tms_retain", "tb"]
    assert keys[2] == ["tms_retain", "tb", "tms"]
    assert keys[3] == keys[0]


@pytest.mark.parametrize("gib", [8, 1, 0.01, 40])
def test_the_tensors_are_mixed_sizes_that_add_up(gib):
    total = int(gib * GiB) // (4 * KiB) * (4 * KiB)
    plan = tool.tensor_plan(total, seed=3)
    sizes = [s for s, _ in plan]
    assert sum(sizes) == total
    assert all(2 * MiB <= s <= 512 * MiB and s % (4 * KiB) == 0 for s in sizes)
    assert plan == tool.tensor_plan(total, seed=3)
    if gib == 8:
        assert plan != tool.tensor_plan(total, seed=4)
        assert 60 <= len(plan) <= 72
        assert {d for _, d in plan} == {"uint8", "bfloat16"}
        assert max(sizes) > 16 * min(sizes)


def fake_process(total, first, later):
    """A child's result: the first cycle's (pause_s, resume_s), then the later cycles'."""
    cycles = [{"pause_s": p, "resume_s": r, "freed_bytes": total} for p, r in [first, *later]]
    return {"stage": "done", "bytes": total, "cycles": cycles}


def test_figures_are_the_first_cycle_and_the_median_of_the_later_ones():
    f = tool.figures(fake_process(8 * 10 ** 9, (2.0, 1.0), [(0.2, 0.1), (0.4, 0.2), (0.1, 0.8)]))
    assert f["first_pause_ms"] == pytest.approx(2000) and f["first_resume_ms"] == pytest.approx(1000)
    assert f["pause_gbps"] == pytest.approx(40)   # 8 GB over 0.2 s, the median of 0.1, 0.2, 0.4 s
    assert f["resume_gbps"] == pytest.approx(40)  # 8 GB over 0.2 s
    assert f["freed_gib"] == pytest.approx(8e9 / GiB)


def test_medians_and_paired_ratios_over_rounds():
    def fig(first_ms, gbps):
        return {"first_pause_ms": first_ms, "first_resume_ms": first_ms / 2, "pause_gbps": gbps, "resume_gbps": gbps,
                "freed_gib": 8}

    tb = [fig(100, g) for g in (40, 50, 60)]
    tms = [fig(400, g) for g in (10, 25, 20)]
    rounds = [{"tb": tb[0], "tms": tms[0]}, {"tb": tb[1], "tms": tms[1]}, {"tb": tb[2]}]  # tms failed in round 3
    medians, ratios = tool.summarize(rounds)
    assert medians["tb"]["pause_gbps"] == 50 and medians["tms"]["pause_gbps"] == 17.5
    assert ratios["tms"]["pause_gbps"] == pytest.approx((4 + 2) / 2)  # 40/10 and 50/25; round 3 has no pair
    assert ratios["tms"]["first_pause_ms"] == pytest.approx(0.25)
    assert "tb" not in ratios
    line = tool.result_line(medians, ratios, "ran", None, {"gib": "8.00"})
    assert line.startswith("RESULT bench_tms gib=8.00 ")
    fields = dict(part.split("=", 1) for part in line.split()[2:])
    assert fields["tb_pause_gbps"] == "50.00" and fields["tms_first_pause_ms"] == "400.00"
    assert fields["tb_over_tms_pause_gbps"] == "3.00" and fields["tms"] == "ran" and "why" not in fields


def test_children_find_the_package_they_measure(monkeypatch):
    monkeypatch.setenv("TMS_RETAIN_CPU_BACKUP", "1")
    monkeypatch.setenv("LD_PRELOAD", "/x/libfoo.so:/y/torch_memory_saver_hook_mode_preload_cu13.abi3.so")
    real = tool.child_env(tool.CONFIGS[1], "/shim")
    adapter = tool.child_env(tool.CONFIGS[0], "/shim")
    assert real["PYTHONPATH"].split(os.pathsep)[0] == tool.SRC
    assert adapter["PYTHONPATH"].split(os.pathsep)[:2] == ["/shim", tool.REPO]
    assert "TMS_RETAIN_CPU_BACKUP" not in real and real["LD_PRELOAD"] == "/x/libfoo.so"


# ---------------------------------------------------------------- the whole run, children faked

FAKE_TORCH = types.SimpleNamespace(__version__="2.11.0", version=types.SimpleNamespace(cuda="13.0"))


def run_main(monkeypatch, capsys, tmp_path, children, built=(True, "built"), argv=()):
    import _bench

    calls = []

    def run_child(config, shim, total, cycles, seed, timeout):
        calls.append(config.key)
        assert os.path.isfile(os.path.join(shim, "torch_memory_saver", "__init__.py"))
        return children(config, total, len([c for c in calls if c == config.key]))

    monkeypatch.setattr(_bench, "cuda_torch", lambda *a, **k: FAKE_TORCH)
    monkeypatch.setattr(_bench, "pin_near_gpu", lambda: None)
    monkeypatch.setattr(tool, "SRC", str(tmp_path / ".tms_src"))
    monkeypatch.setattr(tool, "build", lambda src, *a: built if built[0] or tool.staged_problem(src) is None
                        else (False, tool.staged_problem(src)))
    monkeypatch.setattr(tool, "run_child", run_child)
    rc = tool.main(["--gib", "1", "--rounds", "3", *argv])
    out = capsys.readouterr().out
    fields = dict(part.split("=", 1) for part in out.strip().splitlines()[-1].split()[2:])
    return rc, out, fields, calls


def speeds(config, total, n):
    pause = {"tb": 0.02, "tms": 0.08, "tms_retain": 0.04}[config.key]
    return fake_process(total, (1.0, 0.5), [(pause, pause), (pause, pause), (pause, pause)])


def test_a_run_of_every_configuration_reports_each_and_the_ratios(monkeypatch, capsys, tmp_path):
    rc, out, fields, calls = run_main(monkeypatch, capsys, tmp_path, speeds)
    assert rc == 0 and calls.count("tb") == calls.count("tms") == calls.count("tms_retain") == 3
    assert calls[:3] == ["tb", "tms", "tms_retain"] and calls[3:6] == ["tms", "tms_retain", "tb"]
    assert fields["tms"] == "ran" and fields["tb_over_tms_pause_gbps"] == "4.00"
    assert fields["tb_over_tms_retain_resume_gbps"] == "2.00"
    assert "torch_budget / torch_memory_saver, retain_cpu_backup" in out


def test_without_a_staged_source_torch_budget_runs_alone(monkeypatch, capsys, tmp_path):
    rc, out, fields, calls = run_main(monkeypatch, capsys, tmp_path, speeds, built=(False, ""))
    assert rc == 0 and set(calls) == {"tb"} and len(calls) == 3
    assert "is missing" in out and fields["tms"] == "unavailable" and fields["why"] == "not_staged"
    assert "tb_pause_gbps" in fields and not any(k.startswith("tms_") for k in fields)


def test_a_package_that_does_not_import_is_dropped_after_its_first_try(monkeypatch, capsys, tmp_path):
    def children(config, total, n):
        if config.real:
            return {"stage": "import", "error": "OSError: libcuda.so.1: cannot open shared object file", "cycles": []}
        return speeds(config, total, n)

    rc, out, fields, calls = run_main(monkeypatch, capsys, tmp_path, children)
    assert rc == 0 and calls == ["tb", "tms", "tb", "tb"]
    assert fields["tms"] == "unavailable" and fields["why"] == "import_failed" and "libcuda.so.1" in out


def test_changed_contents_under_torch_budget_fail_the_run(monkeypatch, capsys, tmp_path):
    def children(config, total, n):
        if config.key == "tb" and n == 2:
            return {"stage": "contents", "error": "after resume 1, tensors [3] of 8 differ", "cycles": []}
        return speeds(config, total, n)

    rc, out, fields, calls = run_main(monkeypatch, capsys, tmp_path, children)
    assert rc == 1 and fields["tb"] == "failed" and "tensors [3] of 8 differ" in out


def test_block_sums_see_moved_blocks_and_a_changed_tail():
    import torch

    t = torch.randint(0, 256, (3 * 2 * MiB + 8 * KiB,), dtype=torch.uint8)
    reference = tool.block_sums(torch, t)
    assert reference.numel() == 4  # three 2 MiB blocks and the tail
    swapped = t.clone()
    swapped[:2 * MiB], swapped[2 * MiB:4 * MiB] = t[2 * MiB:4 * MiB].clone(), t[:2 * MiB].clone()
    assert not torch.equal(tool.block_sums(torch, swapped), reference)
    tail = t.clone()
    tail[-1] ^= 1
    assert not torch.equal(tool.block_sums(torch, tail), reference)
    assert torch.equal(tool.block_sums(torch, t.view(torch.bfloat16)), reference)


def _cuda():
    import torch

    return torch.cuda.is_available()


def child_with_the_shim(tmp_path, total):
    shim = tool.write_shim(str(tmp_path))
    return shim, tool.run_child(tool.CONFIGS[0], shim, total, 2, 0, 300)


@pytest.mark.skipif(_cuda(), reason="checks the refusal without a device")
def test_the_child_reports_through_its_line_which_package_it_imported(tmp_path):
    shim, result = child_with_the_shim(tmp_path, 8 * MiB)
    assert result["module"] == os.path.join(shim, "torch_memory_saver", "__init__.py")
    assert result["stage"] == "import" and "InstallError" in result["error"] and "CUDA device" in result["error"]


@pytest.mark.gpu
@pytest.mark.built("_C")
def test_the_workload_pauses_and_resumes_under_the_adapter(tmp_path):
    _, result = child_with_the_shim(tmp_path, 64 * MiB)
    assert result["stage"] == "done", result
    assert result["bytes"] == 64 * MiB and len(result["cycles"]) == 2 and result["retain_cpu_backup"] is False
