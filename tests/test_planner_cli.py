"""`torch-budget plan`: a plan only from what it was told or can derive, sizes with units, one rule
for every bad value, outputs checked before any work.

Expected figures are computed here from the model's own arithmetic (parameters x dtype bytes;
KV per token = 2 x layers x kv_heads x head_dim x dtype bytes / shards), or are published
parameter counts, never read back from the planner."""
import json
import math

import pytest

from conftest import GiB, MiB
from torch_budget import cli
from torch_budget.planner import Plan

# Llama-3-70B: 70,553,706,496 parameters (published), 8 KV heads of 128.
LLAMA_70B = ["--layers", "80", "--hidden", "8192", "--heads", "64", "--kv-heads", "8", "--intermediate", "28672",
             "--vocab", "128256"]
LLAMA_70B_PARAMS = 70_553_706_496
# Llama-3-8B: 8,030,261,248 parameters (published).
LLAMA_8B = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--kv-heads", "8", "--intermediate", "14336",
            "--vocab", "128256"]
LLAMA_8B_PARAMS = 8_030_261_248
TINY = ["--layers", "2", "--hidden", "128", "--heads", "4", "--kv-heads", "4", "--intermediate", "512",
        "--vocab", "1000"]


def cli_plan(args):
    return cli.main(["plan", *args])


def saved_plan(capsys, tmp_path, args) -> Plan:
    out = tmp_path / "plan.json"
    assert cli_plan([*args, "--json", str(out)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    return Plan.from_json(out.read_text())


def test_plan_without_model_flags_plans_the_built_in_model_and_writes_json(capsys, tmp_path):
    saved = saved_plan(capsys, tmp_path, ["--gpu-mem-gib", "80"])
    assert saved.total == 80 * GiB and saved.kv_bytes > 0
    assert "built-in demo model" in saved.title
    # The built-in model: 8 layers, 2 KV heads of 64, bfloat16.
    assert saved.kv_cost.slope == 2 * 8 * 2 * 64 * 2


def test_plan_derives_head_dim_from_hidden_and_heads(capsys, tmp_path):
    # The 70B shape on 8 KV shards: head_dim 8192 / 64 = 128, not the built-in model's 64.
    card = 141 * 10**9
    weights = 18 * GiB  # one rank's share, given
    saved = saved_plan(capsys, tmp_path, [*LLAMA_70B, "--kv-shards", "8", "--gpu-mem", "141GB",
                                          "--weights", "18GiB", "--activations", "2GiB"])
    per_token = 2 * 80 * 8 * 128 * 2 // 8
    assert per_token == 40960
    assert saved.kv_cost.slope == per_token
    kv = math.floor((card - weights - 2 * GiB) * 0.9)
    # 160 tensors (K and V of 80 layers) of 256 B a token each: an odd token count rounds each up
    # by 256 B, one token's worth in all, so the pool holds one token fewer than its bytes alone
    assert saved.kv_bytes == kv and kv // per_token % 2 == 1 and saved.kv_tokens == kv // per_token - 1


def test_plan_weights_are_parameters_times_dtype_bytes(capsys, tmp_path):
    saved = saved_plan(capsys, tmp_path, [*LLAMA_8B, "--gpu-mem", "1TiB", "--max-kv-tokens", "100000"])
    assert saved.line("weights").bytes == LLAMA_8B_PARAMS * 2
    assert saved.kv_cost.slope == 2 * 32 * 8 * 128 * 2 == 131072
    assert saved.kv_bytes == 100000 * 131072
    saved = saved_plan(capsys, tmp_path, [*LLAMA_70B, "--dtype", "float32", "--gpu-mem", "1TiB"])
    assert saved.line("weights").bytes == LLAMA_70B_PARAMS * 4


def test_plan_prints_the_kv_cost_it_planned_with(capsys):
    assert cli_plan([*LLAMA_8B, "--gpu-mem-gib", "80", "--activation-gib", "2", "--max-kv-tokens", "100000"]) == 0
    text = capsys.readouterr().out
    assert f"{LLAMA_8B_PARAMS * 2 / GiB:.2f} GiB" in text
    assert "100000 tokens at 131072 B/token" in text
    assert "32 layers, hidden 4096, 32/8 heads of 128" in text


@pytest.mark.parametrize("args,missing", [
    (["--hidden", "8192", "--heads", "64"], "--layers, --kv-heads, --intermediate, --vocab missing"),
    (["--head-dim", "128"], "--layers, --hidden, --heads, --kv-heads, --intermediate, --vocab missing"),
    (LLAMA_70B[:-2], "--vocab missing"),
])
def test_a_partial_model_shape_is_an_error_naming_what_is_missing(capsys, args, missing):
    assert cli_plan(["--gpu-mem", "80GiB", *args]) == 2
    out, err = capsys.readouterr()
    assert missing in err and "give none of them to plan the built-in demo model" in err, err
    assert out == ""


def test_a_partial_shape_in_a_config_file_is_an_error_too(capsys, tmp_path):
    cfg = tmp_path / "model.json"
    cfg.write_text(json.dumps({"layers": 2, "hidden": 128}))
    assert cli_plan(["--config", str(cfg), "--gpu-mem", "8GiB"]) == 2
    assert "--heads, --kv-heads, --intermediate, --vocab missing" in capsys.readouterr().err


def test_plan_reads_the_model_from_a_config_file_and_flags_override_it(capsys, tmp_path):
    cfg = tmp_path / "model.json"
    cfg.write_text(json.dumps({"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 4, "intermediate": 512,
                               "vocab": 1000, "max_seq_len": 256, "dtype": "float32"}))
    saved = saved_plan(capsys, tmp_path, ["--config", str(cfg), "--gpu-mem-gib", "1", "--layers", "3"])
    assert "3 layers, hidden 128" in saved.title
    assert saved.kv_cost.slope == 2 * 3 * 4 * 32 * 4 and saved.kv_cost.max_tokens_per_request == 256


def test_settings_apply_to_the_built_in_model(capsys, tmp_path):
    saved = saved_plan(capsys, tmp_path, ["--gpu-mem", "80GiB", "--dtype", "float32", "--max-seq-len", "4096"])
    assert saved.kv_cost.slope == 2 * 8 * 2 * 64 * 4 and saved.kv_cost.max_tokens_per_request == 4096


def test_plan_rejects_unknown_config_keys(capsys, tmp_path):
    cfg = tmp_path / "model.json"
    cfg.write_text(json.dumps({"layerz": 2}))
    assert cli_plan(["--config", str(cfg), "--gpu-mem-gib", "8"]) == 2
    assert "unknown key(s) ['layerz']" in capsys.readouterr().err


@pytest.mark.parametrize("args", [
    ["--gpu-mem-gib", "80"], ["--gpu-mem-gib", "80GiB"], ["--gpu-mem", "80GiB"], ["--gpu-mem", str(80 * GiB)],
    ["--gpu-mem", "81920 MiB"],
])
def test_the_card_size_takes_units_and_the_older_flag_takes_gib(capsys, tmp_path, args):
    assert saved_plan(capsys, tmp_path, args).total == 80 * GiB


def test_decimal_units_mean_what_they_say(capsys, tmp_path):
    assert saved_plan(capsys, tmp_path, ["--gpu-mem", "141GB"]).total == 141 * 10**9


@pytest.mark.parametrize("flag", ["--gpu-mem", "--gpu-mem-gib", "--weights", "--weights-gib", "--activations",
                                  "--activation-gib", "--max-kv", "--max-kv-gib"])
@pytest.mark.parametrize("value", ["-5", "0", "0GiB", "-5GiB"])
def test_a_size_that_is_not_positive_gets_one_message(capsys, flag, value):
    assert cli_plan(["--gpu-mem", "80GiB", f"{flag}={value}"]) == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: must be more than 0, got '{value}'" in err, err


@pytest.mark.parametrize("flag", ["--non-torch", "--non-torch-gib"])
def test_memory_outside_torch_may_be_zero_but_not_negative(capsys, flag):
    assert cli_plan(["--gpu-mem", "80GiB", f"{flag}=0"]) == 0
    capsys.readouterr()
    assert cli_plan(["--gpu-mem", "80GiB", f"{flag}=-5"]) == 2
    assert f"argument {flag}: must be 0 or more, got '-5'" in capsys.readouterr().err


@pytest.mark.parametrize("value,message", [
    ("80", "'80' has no unit, and a bare number is bytes only from 1 MiB up: write a size with a unit"),
    ("80.5", "'80.5' has no unit: write one, e.g. \"80.5GiB\""),
    ("80 parsecs", "unknown unit 'parsecs'"),
    ("lots", "cannot read 'lots'"),
])
def test_a_size_without_a_unit_below_one_mib_is_refused(capsys, value, message):
    assert cli_plan(["--gpu-mem", value]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [("--gpu-mem", "9" * 400 + "GiB"), ("--gpu-mem", "9" * 300 + "TiB"),
                                        ("--gpu-mem-gib", "9" * 300), ("--weights-gib", "9" * 400)])
def test_a_size_past_what_a_float_holds_gets_one_message(capsys, flag, value):
    # int(inf) raised OverflowError: a traceback and exit 1
    assert cli_plan(["--gpu-mem", "80GiB", f"{flag}={value}"]) == 2
    assert "is far past any size (at most 2**63 - 1 bytes)" in capsys.readouterr().err


def test_the_old_and_new_flag_of_one_size_cannot_both_be_given(capsys):
    assert cli_plan(["--gpu-mem", "80GiB", "--gpu-mem-gib", "80"]) == 2
    assert "not allowed with argument --gpu-mem" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--dtype", "int3"], "int3"),
    (["--layers", "0", *TINY[2:]], "--layers: '0' must be a positive whole number"),
    (["--config", "/does/not/exist.json"], "does not exist"),
    ([*TINY, "--hidden", "96", "--heads", "6", "--kv-heads", "4"], "must be a multiple of kv_heads"),
    ([*TINY, "--hidden", "100", "--heads", "3", "--kv-heads", "3"],
     "head_dim cannot be derived: hidden (100) is not a multiple of heads (3); give head_dim too"),
    (["--fraction", "2"], "(0, 1]"),
    (["--workspace-bytes-per-token", "4096", *TINY], "--workspace-bytes-per-token needs --max-seq-len"),
    (["--attended-token-cap", "4096"], "--attended-token-cap caps the per-token workspace, so it needs "
                                       "--workspace-bytes-per-token"),
])
def test_plan_bad_input_exits_2_with_a_message_not_a_traceback(capsys, args, message):
    assert cli_plan(["--gpu-mem-gib", "8", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_a_config_path_that_is_a_folder_says_so(capsys, tmp_path):
    assert cli_plan(["--config", str(tmp_path), "--gpu-mem", "8GiB"]) == 2
    err = capsys.readouterr().err
    assert "is a folder" in err and "Errno" not in err


def test_plan_json_into_a_missing_folder_fails_before_planning(capsys, tmp_path):
    target = tmp_path / "missing" / "plan.json"
    assert cli_plan(["--gpu-mem", "80GiB", "--json", str(target)]) == 2
    out, err = capsys.readouterr()
    assert f"the folder '{tmp_path / 'missing'}' does not exist; create it first (no folder is created)" in err
    assert "KV pool" not in out and not (tmp_path / "missing").exists()


def test_plan_json_that_is_a_folder_says_so_without_an_errno(capsys, tmp_path):
    assert cli_plan(["--gpu-mem", "80GiB", "--json", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert f"'{tmp_path}' is a folder; give a file path" in err and "Errno" not in err
    assert "KV pool" not in out


def test_kv_shards_make_the_plan_one_ranks_and_say_so(capsys, tmp_path):
    saved = saved_plan(capsys, tmp_path, [*LLAMA_70B, "--kv-shards", "8", "--gpu-mem", "141GB", "--weights", "18GiB"])
    assert saved.kv_shards == 8
    ranks = saved.steps[-1].note
    assert "single rank" not in ranks and "one of 8 ranks sharing each token's KV" in ranks
    assert "split 8 ways (--kv-shards)" in saved.line("KV pool").reason
    assert "tensor parallelism" not in saved.line("KV pool").reason  # 8 KV heads over 8 ranks: one each


def test_kv_shards_beyond_the_kv_heads_say_what_tensor_parallelism_needs(capsys, tmp_path):
    saved = saved_plan(capsys, tmp_path, [*LLAMA_70B, "--kv-shards", "16", "--gpu-mem", "141GB", "--weights", "9GiB"])
    assert "plan that with --kv-shards 8" in saved.line("KV pool").reason


def test_kv_shards_with_computed_weights_say_the_weights_are_the_whole_models(capsys, tmp_path):
    saved = saved_plan(capsys, tmp_path, [*TINY, "--kv-shards", "2", "--gpu-mem", "8GiB"])
    assert "give one rank's share with --weights" in saved.line("weights").reason


def test_a_per_token_workspace_is_reserved_with_the_shared_split(capsys, tmp_path):
    # k = 2 x 2 x 4 x 32 x 2 = 1024 B/token, w = 1024: the budget is split in half, capped at L tokens.
    saved = saved_plan(capsys, tmp_path, [*TINY, "--max-seq-len", "1024", "--workspace-bytes-per-token", "1024",
                                          "--max-batch", "4", "--gpu-mem", "8GiB"])
    cap = 4 * 1024
    assert saved.line("per-token workspace").bytes == 1024 * cap and saved.workspace_tokens == cap


def test_an_over_committed_plan_exits_1_and_says_by_how_much(capsys):
    assert cli_plan(["--gpu-mem-gib", "0.2"]) == 1
    out, err = capsys.readouterr()
    assert "OVER-COMMITTED" in out and "over-committed by" in err


def test_the_plan_help_shows_every_default(capsys):
    assert cli.main(["plan", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("(default: --hidden / --heads)", "(default bfloat16)", "(default 0.9)", "(default 256)",
                  "(default 8192)", "(default 1)", "(default 0, i.e. unknown)", "(no default: part of the shape)",
                  "2048 for the built-in one", "an assumed NVIDIA H200 of 139.8 GiB"):
        assert shown in text, shown


def test_one_mib_is_where_a_bare_number_starts_to_be_bytes(capsys, tmp_path):
    # (requests of up to 256 tokens: a 1 MiB KV pool holds one)
    args = ["--gpu-mem", "80GiB", "--max-seq-len", "256", "--max-kv"]
    assert saved_plan(capsys, tmp_path, [*args, str(MiB)]).kv_bytes == MiB
    assert cli_plan(["--gpu-mem", "80GiB", "--max-kv", str(MiB - 1)]) == 2
