"""tools/tms_examples.py: torch_memory_saver's examples find torch_budget's adapter under their own
import name, and each case's outcome is read right (run here on fake examples, without a GPU)."""
import textwrap

from _harness import load_tool

tool = load_tool("tms_examples")

FAKES = {
    # imports what the real examples import; passes when the shim is what they expect
    "simple.py": """
        from torch_memory_saver import torch_memory_saver
        from torch_memory_saver.testing_utils import empty_cache, get_and_print_gpu_memory, get_device
        from torch_memory_saver.utils import change_env
        import os

        def run(hook_mode):
            torch_memory_saver.hook_mode = hook_mode
            assert type(torch_memory_saver).__name__ == "TorchMemorySaver" and get_device() == "cuda"
            with change_env("TMS_SOMETHING", "1"):
                assert os.environ["TMS_SOMETHING"] == "1"
            assert "TMS_SOMETHING" not in os.environ
    """,
    # reading memory_margin_bytes is what the adapter refuses, before it needs a device
    "nested_region.py": """
        from torch_memory_saver import torch_memory_saver

        def run(hook_mode):
            print(torch_memory_saver.memory_margin_bytes)
    """,
    "cuda_graph.py": """
        def run(hook_mode):
            print("memory: 42 GiB free")
            raise AssertionError("the graph replayed to a different result")
    """,
}


def test_cases_pass_fail_or_say_why_torch_budget_cannot(tmp_path, capsys):
    for name, text in FAKES.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    rc = tool.main([str(tmp_path), "--cases", "simple,nested_region,cuda_graph,multi_device", "--devices", "1"])
    out, err = capsys.readouterr()
    lines = {line.split()[0]: line for line in out.splitlines() if line and not line.startswith("RESULT")}
    assert rc == 1
    assert "passed" in lines["simple.run[preload]"] and "passed" in lines["simple.run[torch]"]
    assert "unsupported" in lines["nested_region.run[preload]"]
    assert "memory_margin_bytes" in lines["nested_region.run[preload]"]
    assert "failed" in lines["cuda_graph.run[torch]"] and "different result" in lines["cuda_graph.run[torch]"]
    assert 'at cuda_graph.py:4: raise AssertionError("the graph' in lines["cuda_graph.run[torch]"], "where it failed"
    assert "    | memory: 42 GiB free" in err, "a failed case's last output goes to the log"
    assert "skipped" in lines["multi_device.run[preload]"]
    assert out.strip().splitlines()[-1] == "RESULT tms_examples passed=2 unsupported=1 failed=2 skipped=2"


def test_a_folder_that_is_not_the_examples_is_refused(tmp_path, capsys):
    assert tool.main([str(tmp_path)]) == 2
    assert "not torch_memory_saver's test/examples" in capsys.readouterr().err
