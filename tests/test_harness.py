"""The fresh-process harness itself, without CUDA: bodies run in a child that imports their
module by path, get their arguments and environment, send back stdout and a return value,
and fail the test with a traceback into this file."""
import faulthandler
import inspect
import os
import subprocess
import sys
import time

import pytest

from _harness import run_fresh, run_ranks


def test_a_body_returns_its_stdout_and_its_value(fresh):
    out = fresh(prints_and_returns, 3, {"k": (1, 2)})
    assert out == "line 1\nline 2\nline 3\n"
    assert out.splitlines()[-1] == "line 3"
    assert out.value == {"n": 3, "got": {"k": (1, 2)}}


def prints_and_returns(n, obj):
    for i in range(n):
        print("line", i + 1)
    return {"n": n, "got": obj}


def test_a_body_that_reports_failure_by_its_value_still_shows_its_stderr(fresh):
    out = fresh(warns_and_returns_one)
    assert out.value == 1 and out == "step 1\n"
    assert out.stderr == "error: the pool is too small\n"
    assert "--- stderr\nerror: the pool is too small" in out.both()


def warns_and_returns_one():
    print("step 1")
    print("error: the pool is too small", file=sys.stderr)
    return 1


def test_the_child_imports_the_module_without_torch_and_runs_under_faulthandler(fresh):
    seen = fresh(what_the_child_sees).value
    assert seen["torch imported"] is False, "importing the body's module pulled in torch"
    assert seen["faulthandler"] is True
    assert seen["argv"] == ["-c"]
    assert seen["module"] == __name__ and seen["file"] == __file__
    assert os.path.dirname(__file__) in seen["path"]


def what_the_child_sees():
    return {"torch imported": "torch" in sys.modules, "faulthandler": faulthandler.is_enabled(),
            "argv": sys.argv, "module": __name__, "file": __file__, "path": sys.path}


def fails_an_assertion(limit):
    value = limit + 1
    assert value <= limit, f"{value} is over {limit}"


def test_a_failing_body_fails_the_test_with_the_childs_traceback_into_this_file():
    with pytest.raises(pytest.fail.Exception) as failed:
        run_fresh(fails_an_assertion, 7)
    message = str(failed.value)
    line = inspect.getsourcelines(fails_an_assertion)[1] + 2
    assert f'File "{__file__}", line {line}, in fails_an_assertion' in message, message
    assert "AssertionError: 8 is over 7" in message, message
    assert message.splitlines()[0] == \
        "child process failed (rc=1): test_harness.fails_an_assertion: AssertionError: 8 is over 7", message
    assert "/_harness.py" not in message.split("Traceback")[1], "the harness's own frames are shown"


def test_env_reaches_the_child(fresh):
    assert fresh(environment, "TB_HARNESS_CHECK", env={"TB_HARNESS_CHECK": "on"}).value == "on"


def environment(name):
    return os.environ.get(name)


def test_a_body_that_exits_zero_passes_with_no_value(fresh):
    out = fresh(exits, 0)
    assert out == "leaving\n" and out.value is None


def test_a_body_that_exits_nonzero_fails_the_test():
    with pytest.raises(pytest.fail.Exception, match=r"rc=3"):
        run_fresh(exits, 3)


def exits(code):
    print("leaving")
    sys.exit(code)


def test_a_body_past_its_timeout_is_killed_and_fails_the_test_with_its_output():
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failed:
        run_fresh(sleeps, 60, timeout=2)
    assert time.monotonic() - start < 30
    assert "timed out after 2 s" in str(failed.value) and "sleeping" in str(failed.value), str(failed.value)


def sleeps(seconds):
    print("sleeping", flush=True)
    time.sleep(seconds)


def test_a_nested_function_is_refused_before_any_child_starts():
    def nested():
        pass

    with pytest.raises(TypeError, match="module-level function"):
        run_fresh(nested)
    with pytest.raises(TypeError, match="module-level function"):
        run_fresh(lambda: None)


def test_a_value_that_does_not_pickle_fails_the_test():
    with pytest.raises(pytest.fail.Exception, match="returned a generator, which does not pickle"):
        run_fresh(returns_a_generator)


def returns_a_generator():
    return (i for i in range(3))


def test_a_process_spawned_by_a_body_finds_the_test_modules_functions_by_name(fresh):
    assert fresh(spawns_a_process, 3).value == "pong 3"


def spawns_a_process(n):
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")
    answers = ctx.Queue()
    p = ctx.Process(target=answer, args=(answers, n))
    p.start()
    got = answers.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0, p.exitcode
    return got


def answer(answers, n):
    answers.put(f"pong {n}")


def test_ranks_see_their_rank_the_world_size_a_rendezvous_their_args_and_env(ranks):
    outs = ranks(rank_report, 3, env={"TB_HARNESS_CHECK": "all"}, args=("shared",),
                 rank_args=[[0, "a"], [1, "b"], [2, "c"]])
    assert [out.value for out in outs] == [
        {"rank": str(r), "world": "3", "args": ("shared", r, "abc"[r]), "env": "all", "file init": True}
        for r in range(3)]
    assert [out.splitlines() for out in outs] == [["rank 0"], ["rank 1"], ["rank 2"]]
    assert len({out.value["rank"] for out in outs}) == 3


def rank_report(*args):
    print("rank", os.environ["RANK"])
    return {"rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"], "args": args,
            "env": os.environ.get("TB_HARNESS_CHECK"), "file init": os.environ["TB_INIT_METHOD"].startswith("file://")}


def test_a_failing_rank_fails_the_test_and_shows_every_ranks_output(ranks):
    with pytest.raises(pytest.fail.Exception) as failed:
        run_ranks(fails_on_rank_one, 2)
    message = str(failed.value)
    assert "rank(s) [1] failed" in message and "rank 0 says hello" in message, message
    assert "RuntimeError: rank 1 gives up" in message, message


def fails_on_rank_one():
    print("rank", os.environ["RANK"], "says hello")
    if os.environ["RANK"] == "1":
        raise RuntimeError("rank 1 gives up")


def test_code_strings_still_run_as_scripts(fresh, ranks):
    assert fresh("""
        import sys
        print(sys.argv[1:])
    """) == "[]\n"
    outs = ranks("import os, sys; print(os.environ['RANK'], sys.argv[1:])", 2, rank_args=[[5], [6]])
    assert outs == ["0 ['5']\n", "1 ['6']\n"]
    assert outs[0].value is None


def collected(*args):
    """The test ids pytest collects from this repository's tests with `args`, and its exit code."""

    here = os.path.dirname(os.path.abspath(__file__))
    # As the GPU suite runs pytest (pytest-benchmark, where installed, warns under xdist and
    # warnings are errors), and without the xdist worker's variables of the pytest running this.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT_TEST"))}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:benchmark",
                        "--collect-only", *args], cwd=os.path.dirname(here), capture_output=True, text=True,
                       timeout=120, env=env)
    return [ln for ln in r.stdout.splitlines() if "::" in ln], r.returncode, r.stdout + r.stderr


def test_shards_split_the_tests_so_that_their_runs_together_run_each_test_once():
    # A run too long for one call (compute-sanitizer over the suite) is split with --shard K/N.
    files = ["tests/test_config.py", "tests/test_harness.py"]
    whole, rc, out = collected(*files)
    assert rc == 0 and len(whole) > 30, out[-3000:]
    shards = [collected(*files, "--shard", f"{k}/3")[0] for k in (1, 2, 3)]
    assert all(shards), "each of three shards should hold some of these tests"
    assert sorted(sum(shards, [])) == sorted(whole)  # every test in exactly one shard
    assert collected(*files, "--shard", "2/3")[0] == shards[1]  # the same split every time
    for bad in ("4/3", "two/3"):
        ids, rc, out = collected(*files, "--shard", bad)
        assert rc != 0 and not ids and "--shard" in out, out


def test_graph_tree_tests_are_skipped_under_the_sanitizer_and_only_there(tmp_path):
    # Under compute-sanitizer torch's CUDA graph trees refuse their own pool natively too.
    (tmp_path / "test_trees.py").write_text(
        "import pytest\n\n@pytest.mark.graph_trees\ndef test_tree():\n    pass\n\ndef test_plain():\n    pass\n")
    here = os.path.dirname(os.path.abspath(__file__))

    def outcomes(**extra):
        env = {k: v for k, v in os.environ.items() if k != "TORCH_BUDGET_UNDER_SANITIZER"}
        env.update(extra, PYTHONPATH=os.pathsep.join([here, os.path.dirname(here)]))
        # no:benchmark: where pytest-benchmark is installed its warning under xdist is an error here
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:benchmark",
                            "-p", "conftest", "-c", os.path.join(os.path.dirname(here), "pyproject.toml"), str(tmp_path)],
                           capture_output=True, text=True, timeout=120, env=env)
        return r.stdout.splitlines()[-1], r.stdout

    summary, out = outcomes()
    assert summary.startswith("2 passed"), out
    summary, out = outcomes(TORCH_BUDGET_UNDER_SANITIZER="1")
    assert summary.startswith("1 passed, 1 skipped") and "graph trees refuse their own pool" in out, out
