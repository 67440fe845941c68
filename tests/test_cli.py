"""The `torch-budget` command line and the demo's CPU-testable parts (no GPU needed).

The demo's serving run needs a CUDA device, but its pieces that decide correctness do not: the
prefill that puts attention scratch in the eager workspace, and the scheduler (row holes, bucket
padding, KV deferral). Those run here on CPU through `GraphRunner.run_eager`, which replays the
same computation through the same static buffers and padding as a captured graph.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _harness import repo_env
import torch_budget
from torch_budget import cli, demo
from torch_budget.demo.requests import make_requests, run_requests
from torch_budget.demo.serve import decode_runner
from torch_budget.graphs import GraphPoolManager
from torch_budget.demo.model import DemoModel, PagedKVCache, decode, prefill, prefill_workspace_bytes
from torch_budget.planner.shape import ModelShape
from torch_budget.eager_workspace import WorkspaceMetadata, workspace as workspace_scope

TINY = ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=256, vocab=97, head_dim=16, max_seq_len=32,
                  dtype="float32")


def test_doctor_runs_and_names_torchs_version(capsys):
    assert cli.main(["doctor"]) == 0
    assert torch.__version__ in capsys.readouterr().out


def test_demo_without_a_gpu_prints_the_plan_and_why_it_stops(tmp_path):
    # CUDA_VISIBLE_DEVICES="" hides any device, so this runs the no-GPU path on every machine.
    env = repo_env({"CUDA_VISIBLE_DEVICES": ""})
    proc = subprocess.run([sys.executable, "-m", "torch_budget", "demo", "--quick"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "ASSUMPTION" in out and "H200" in out, out
    assert "KV cache:" in out and "weights" in out, out
    assert "Plan.apply() gives each tag its lines, weights " in out and "(here planned, not applied)" in out, out
    assert out.rstrip().splitlines()[-1].startswith("torch-budget demo stops here: no CUDA device visible"), out
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == [], "the plan-only run must not write a ledger picture"


@pytest.mark.parametrize("argv,message", [
    (["--layers", "x"], "not a whole number"),
    (["--gpu-mem-gib", "80", "--layers", "2", "--hidden", "96", "--heads", "6", "--kv-heads", "4", "--intermediate",
      "256", "--vocab", "100"], "multiple of kv_heads"),
    # the estimate passed 2**63 and the profile refused it as "torch_peak", a name no option has
    (["--gpu-mem-gib", "80", "--max-num-tokens", "99999999999999"], "estimated from shapes for 99999999999999 tokens"),
    # past 2**63 the planner named its own parameter ("ways", "user_cap"), not the flag
    (["--kv-shards", "99999999999999999999999"], "argument --kv-shards: '99999999999999999999999' must be a positive"),
    (["--attended-token-cap", "99999999999999999999999"], "argument --attended-token-cap: '9999"),
])
def test_plan_with_bad_input_exits_2_with_a_message(capsys, argv, message):
    assert cli.main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_an_alloc_conf_that_stops_torch_on_import_is_named_not_died_of(monkeypatch, capsys):
    # torch 2.14 aborts its own import (SIGABRT, an internal assertion) on this value.
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:maybe,foo")
    if subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode >= 0:
        pytest.skip("this build of torch imports under that value")
    assert cli.main(["doctor"]) == 2
    err = capsys.readouterr().err
    assert "PYTORCH_CUDA_ALLOC_CONF='expandable_segments:maybe,foo' stops torch as it is imported" in err
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert cli.main(["doctor"]) == 0


def test_unknown_command_exits_2_and_suggests_the_closest(capsys):
    assert cli.main(["plna"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'plna'" in err and "did you mean 'plan'" in err


def test_no_command_exits_2_with_the_usage(capsys):
    assert cli.main([]) == 2
    assert "usage: torch-budget" in capsys.readouterr().err


def test_demo_rejects_bad_options_with_exit_2(capsys):
    assert cli.main(["demo", "--requests", "0"]) == 2
    assert "--requests" in capsys.readouterr().err


def test_bench_without_the_script_says_where_benchmarks_live(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(cli.bench, "bench_script", lambda: tmp_path / "tools" / "bench_alloc.py")
    assert cli.main(["bench"]) == 1
    assert "tools/bench_alloc.py" in capsys.readouterr().err


@pytest.fixture(scope="module")
def model():
    return DemoModel(TINY, seed=3)


def _warm_meta(floor_tokens):
    meta = WorkspaceMetadata("cpu", reclaimable=True)
    meta.warm_up(prefill_workspace_bytes(TINY, 1, floor_tokens))
    return meta


def test_workspace_prefill_matches_model_prefill_and_holds_one_layers_need(model):
    ids = torch.randint(0, TINY.vocab, (2, 13), generator=torch.Generator().manual_seed(0))
    reference = prefill(model, ids, PagedKVCache(TINY, num_blocks=16, max_batch=2, block_size=4))
    cache = PagedKVCache(TINY, num_blocks=16, max_batch=2, block_size=4)
    meta = _warm_meta(2)
    with workspace_scope(meta):
        last = prefill(model, ids, cache, [0, 1], scratch=meta, last_only=True)
    torch.testing.assert_close(last, reference[:, -1], rtol=1e-5, atol=1e-5)
    # Every layer needs the same scratch; the workspace holds one layer's need, not the sum.
    assert meta.capacity == prefill_workspace_bytes(TINY, 2, 13)


def test_scheduler_gives_every_request_the_tokens_of_a_lone_greedy_run(model):
    settings = demo.Settings(requests=6, seed=5, out=Path("unused.png"), native=True, min_prompt=3, max_prompt=24,
                             min_new=2, max_new=6, buckets=(1, 2, 4), kv_cap_bytes=0)
    requests = make_requests(settings, TINY.vocab)
    # 9 usable blocks of 4 tokens: too few for four long requests at once, so some must wait.
    cache = PagedKVCache(TINY, num_blocks=10, max_batch=4, block_size=4)
    manager = GraphPoolManager("cpu")
    runner = decode_runner(manager, "decode", model, cache, settings.buckets)

    class EagerRunner:  # the captured graph's computation, through the same buffers and padding
        step = staticmethod(runner.run_eager)
        bucket_for = staticmethod(runner.bucket_for)
        buckets = runner.buckets
        name = runner.name

    class NoWatch:
        def sample(self):
            pass

    stats = run_requests(torch, settings, model, cache, EagerRunner(), _warm_meta(3), requests, NoWatch(),
                               torch.device("cpu"), torch_budget.region)
    assert stats["generated"] == sum(r.new_tokens for r in requests)
    assert stats["deferred"] and stats["waits"]["kv"], "the small cache should have made a request wait for KV blocks"
    assert cache.free_blocks == cache.num_blocks - 1, "every block comes back when its request finishes"
    for req in requests:
        alone = PagedKVCache(TINY, num_blocks=16, max_batch=1, block_size=4)
        out = [int(prefill(model, req.prompt[None], alone)[0, -1].argmax())]
        pos = req.prompt_len
        while len(out) < req.new_tokens:
            alone.reserve(0, pos + 1)
            out.append(int(decode(model, torch.tensor([out[-1]]), torch.tensor([pos]), alone)[0].argmax()))
            pos += 1
        assert req.out == out, f"request {req.index}"


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_flag_of_every_command_has_help(command):
    parser = cli.PARSERS[command]()
    for action in parser._actions:
        if action.dest != "help":
            assert action.help, f"{command} {action.option_strings or action.dest} has no help"


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_command_prints_its_help(command, capsys):
    # argparse expands % in help texts: a bare one (the configuration tb-vmm-pack10%) made
    # `torch-budget replay --help` raise ValueError instead of printing.
    with pytest.raises(SystemExit) as exit_:
        cli.PARSERS[command]().parse_args(["--help"])
    assert exit_.value.code == 0
    assert "usage: torch-budget" in capsys.readouterr().out


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_option_of_every_command_says_its_default(command):
    parser = cli.PARSERS[command]()
    for action in parser._actions:
        if not action.option_strings or action.nargs == 0:  # positionals, --help and on/off switches
            continue
        text = action.help
        if text.startswith("--") and " in GiB when no unit is given" in text:  # the older spelling of a size flag
            continue
        assert "default" in text, f"{command} {action.option_strings} does not say its default: {text!r}"


def test_a_plan_whose_kv_pool_cannot_hold_one_request_of_the_longest_length_exits_1(capsys):
    # 12 tokens of KV for requests of up to 2048 tokens: a plan no engine could serve with
    assert cli.main(["plan", "--gpu-mem", "248.2MiB"]) == 1
    out, err = capsys.readouterr()
    assert "KV pool" in out
    assert "the KV pool holds 12 tokens, fewer than one request of the longest length (2048 tokens)" in err
    assert "give more memory" in err
    # a cap the user gave is named, not more memory: most of the card was left unplanned
    assert cli.main(["plan", "--gpu-mem", "80GiB", "--max-kv-tokens", "1000"]) == 1
    assert "raise --max-kv-tokens (the cap you gave)" in capsys.readouterr().err


def test_plan_without_arguments_or_a_device_plans_an_assumed_card_and_says_so():
    proc = subprocess.run([sys.executable, "-m", "torch_budget", "plan"], capture_output=True, text=True,
                          env=repo_env({"CUDA_VISIBLE_DEVICES": ""}), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "assumed NVIDIA H200" in proc.stdout and "KV pool" in proc.stdout


def test_bench_without_a_gpu_exits_1_saying_nothing_was_measured(capsys, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "--rounds", "1"]) == 1  # it had exited 0, having measured nothing
    assert "no CUDA device is visible; nothing was measured" in capsys.readouterr().err


def test_bench_help_describes_the_benchmark_instead_of_running_it(capsys):
    assert cli.main(["bench", "--help"]) == 0
    assert "round trips" in capsys.readouterr().out


def test_doctor_prints_the_parsed_settings_and_the_defaults_of_the_rest(capsys, monkeypatch):
    monkeypatch.setenv("TORCH_BUDGET_CONF", "budget:40GiB,route:vmm")
    assert cli.main(["doctor"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert lines["budget"].split(None, 1)[1] == f"40.00 GiB ({40 << 30} bytes)"
    assert lines["route"].split(None, 1)[1] == "vmm"
    assert lines["map_run"].split(None, 1)[1] == "16.0 MiB (default)"
    assert lines["packing_time"].split(None, 1)[1] == "0.03 (default)"
    assert lines["host_pool"].split(None, 1)[1] == "none (default)"
    monkeypatch.setenv("TORCH_BUDGET_CONF", "budget:0.85")
    assert cli.main(["doctor"]) == 0
    assert "0.85 of the card" in capsys.readouterr().out


@pytest.mark.parametrize("conf,message", [
    ("budget:12 parsecs", "unknown unit 'parsecs' in TORCH_BUDGET_CONF budget '12 parsecs'"),
    ("budget:1", "TORCH_BUDGET_CONF budget '1' has no unit, and a bare number is bytes only from 1 MiB up"),
    ("budget:0", "TORCH_BUDGET_CONF budget must be more than 0 bytes or a fraction of the card in (0, 1]"),
    ("budget:1.5", "TORCH_BUDGET_CONF budget 1.5 is read as a fraction of the card, which must be in (0, 1]"),
    ("route:fastest", "TORCH_BUDGET_CONF route: unknown route 'fastest'"),
    ("budget:1GiB,budget:2GiB", "TORCH_BUDGET_CONF: budget is given twice"),
])
def test_doctor_exits_2_on_an_invalid_setting_naming_the_variable_once(capsys, monkeypatch, conf, message):
    monkeypatch.setenv("TORCH_BUDGET_CONF", conf)
    assert cli.main(["doctor"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"torch-budget doctor: {message}"), err
    assert err.count("TORCH_BUDGET_CONF") == 1 and len(err.splitlines()) == 1, err
    assert out == ""


def test_demo_refuses_an_invalid_setting_before_it_plans(capsys, monkeypatch):
    monkeypatch.setenv("TORCH_BUDGET_CONF", "budget:1")
    monkeypatch.setattr(demo, "run", lambda settings: pytest.fail("the demo ran with an invalid setting"))
    assert cli.main(["demo", "--quick"]) == 2
    assert capsys.readouterr().err.startswith("torch-budget demo: TORCH_BUDGET_CONF budget '1' has no unit")


@pytest.mark.parametrize("argv", [["demo", "--quick", "--out"], ["replay", "mix:1MiB", "--json"]])
def test_outputs_of_every_command_are_checked_before_any_work(capsys, tmp_path, argv):
    assert cli.main([*argv, str(tmp_path / "missing" / "out.json")]) == 2
    err = capsys.readouterr().err
    assert "does not exist; create it first (no folder is created)" in err, err
    assert cli.main([*argv, str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is a folder; give a file path" in err and "Errno" not in err, err


# --- demo --sleep -------------------------------------------------------------------------------


def test_demo_sleep_flag_has_help_and_reaches_the_settings(capsys, monkeypatch):
    assert cli.main(["demo", "--help"]) == 0
    assert "--sleep" in capsys.readouterr().out
    seen = {}
    monkeypatch.setattr(demo, "run", lambda settings: seen.setdefault("settings", settings) and 0)
    assert cli.main(["demo", "--quick", "--sleep"]) == 0
    assert seen["settings"].sleep is True
    assert demo.make_settings().sleep is False


def test_demo_sleep_without_a_gpu_says_the_step_is_skipped(tmp_path):
    env = repo_env({"CUDA_VISIBLE_DEVICES": ""})
    proc = subprocess.run([sys.executable, "-m", "torch_budget", "demo", "--quick", "--sleep"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "sleep/wake step is skipped" in proc.stdout, proc.stdout
    assert proc.stdout.rstrip().splitlines()[-1].startswith("torch-budget demo stops here"), proc.stdout


def test_sleep_step_without_torch_budget_says_why_it_is_skipped(capsys):
    from torch_budget.demo.sleep_wake import sleep_wake

    sleep_wake(torch, None, "native", model=None, cache=None, runner=None, meta=None, device=None, region=None)
    assert "skipped: torch_budget is not installed" in capsys.readouterr().out


def test_sleep_step_fails_with_the_first_token_that_changed():
    from torch_budget.demo.sleep_wake import check_same_tokens

    assert "identical" in check_same_tokens([[1, 2], [3]], [[1, 2], [3]])
    with pytest.raises(demo.DemoError, match=r"1 of 2 requests differ \(request 0 first at token 1: 2 before, 5 after"):
        check_same_tokens([[1, 2], [3]], [[1, 5], [3]])


def _tiny_serving(model, *, native):
    """Settings, a KV pool and an eager stand-in for the captured decode runner (its buckets
    count as captured), for the sleep step's CPU tests."""
    settings = demo.Settings(requests=6, seed=5, out=Path("unused.png"), native=native, min_prompt=3, max_prompt=24,
                             min_new=2, max_new=6, buckets=(1, 2, 4), kv_cap_bytes=0, sleep=True)
    cache = PagedKVCache(TINY, num_blocks=10, max_batch=4, block_size=4)
    runner = decode_runner(GraphPoolManager("cpu"), "decode", model, cache, settings.buckets)

    class EagerRunner:
        step = staticmethod(runner.run_eager)
        bucket_for = staticmethod(runner.bucket_for)
        captured = buckets = settings.buckets
        name = runner.name

    return settings, cache, EagerRunner


def test_a_kv_pool_restored_without_backup_serves_the_same_tokens_once_reset(model):
    # What a restore with backup "none" may leave: NaN in every slot and garbage block tables.
    from torch_budget.demo.sleep_wake import PROMPTS, serve_prompts

    settings, cache, EagerRunner = _tiny_serving(model, native=True)

    class NoWatch:
        def sample(self):
            pass

    def serve():
        return serve_prompts(torch, settings, model, cache, EagerRunner(), _warm_meta(3), torch.device("cpu"),
                             torch_budget.region)

    before = serve()
    assert len(before) == min(PROMPTS, settings.requests)
    for t in (cache.k, cache.v):
        t.fill_(float("nan"))
    cache.block_tables.fill_(10 ** 6)
    assert serve() == before
    # Without the reset the NaN would reach the served tokens: decode reads masked slots too.
    cache.v.fill_(float("nan"))
    requests = make_requests(settings, TINY.vocab)[:len(before)]
    run_requests(torch, settings, model, cache, EagerRunner(), _warm_meta(3), requests, NoWatch(), torch.device("cpu"),
                 torch_budget.region)
    assert [r.out for r in requests] != before


class FakeSleep:
    """torch_budget.sleep's contract, played on CPU: "none" leaves NaN behind, "pinned" keeps the contents."""

    def __init__(self, tensors, lose_backup=False):
        self.tensors, self.lose_backup, self.calls = tensors, lose_backup, []

    def tag_states(self, device=None):
        return {tag: {"state": "live", "resident": sum(t.nbytes for t in ts), "released": 0, "backup": None,
                      "backup_bytes": 0} for tag, ts in self.tensors.items()}

    def release(self, tag, backup="none", device=None):
        self.calls.append(("release", tag, backup))
        nbytes = sum(t.nbytes for t in self.tensors[tag])
        if backup == "none" or self.lose_backup:
            for t in self.tensors[tag]:
                t.fill_(float("nan") if t.is_floating_point() else 10 ** 6)
        return {"tags": [tag], "bytes": nbytes, "backup_bytes": nbytes if backup == "pinned" else 0, "seconds": 1e-3}

    def restore(self, tags, device=None):
        self.calls.append(("restore", tags))
        return {"tags": [tags], "bytes": 0, "backup_bytes": 0, "seconds": 1e-3}

    def reserve_host_pool(self, nbytes):
        return nbytes

    def host_pool_stats(self):
        return {"pinned_at_release": 0}

    def free_host_pool(self):
        return 0


@pytest.mark.parametrize("lose_backup", [False, True])
def test_sleep_step_serves_the_same_tokens_or_fails_naming_the_difference(model, monkeypatch, capsys, lose_backup):
    import copy

    import torch_budget.sleep
    from torch_budget.demo import sleep_wake as step

    own = copy.deepcopy(model)  # the fake release scribbles on the weights it loses
    settings, cache, EagerRunner = _tiny_serving(own, native=False)

    fake = FakeSleep({"weights": list(own.parameters()), "kv": [cache.k, cache.v, cache.block_tables],
                      "graphs": []}, lose_backup=lose_backup)
    for name in ("tag_states", "release", "restore", "reserve_host_pool", "host_pool_stats", "free_host_pool"):
        monkeypatch.setattr(torch_budget.sleep, name, getattr(fake, name))
    monkeypatch.setattr(step, "skip_reason", lambda mode, device: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 8 << 30))

    def run():
        step.sleep_wake(torch, settings, "torch_budget", model=own, cache=cache, runner=EagerRunner(),
                        meta=_warm_meta(3), device=torch.device("cpu"), region=torch_budget.region)

    if lose_backup:
        with pytest.raises(demo.DemoError, match="sleep/wake changed the served tokens"):
            run()
        return
    run()
    out = capsys.readouterr().out
    assert [c[:3] for c in fake.calls if c[0] == "release"] == [("release", "weights", "pinned"), ("release", "kv", "none"),
                                                                ("release", "graphs", "none")]
    assert "released weights" in out and "backup pinned" in out and "device free" in out
    assert "restored kv" in out and "served tokens identical before and after" in out
