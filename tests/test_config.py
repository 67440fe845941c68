"""Settings: budgets in bytes or fractions, units, TORCH_BUDGET_CONF and its errors."""
import pytest

from torch_budget import config
from torch_budget.units import GiB, MiB, format_bytes, parse_bytes


@pytest.mark.parametrize("value,expected", [
    (4 * MiB, ("bytes", 4 * MiB)),
    (MiB, ("bytes", MiB)),
    (str(2 * MiB), ("bytes", 2 * MiB)),
    ("4096B", ("bytes", 4096)),
    ("1B", ("bytes", 1)),
    ("4KiB", ("bytes", 4096)),
    ("40GiB", ("bytes", 40 * GiB)),
    ("512 MiB", ("bytes", 512 * MiB)),
    ("60GB", ("bytes", 60 * 10**9)),
    ("1.5GiB", ("bytes", 3 * GiB // 2)),
    (0.9, ("fraction", 0.9)),
    (1.0, ("fraction", 1.0)),
    ("0.85", ("fraction", 0.85)),
    ("1.0", ("fraction", 1.0)),
    (None, None),
])
def test_a_budget_is_bytes_or_a_fraction_of_the_card(value, expected):
    assert config.parse_budget(value) == expected


@pytest.mark.parametrize("value", [4 * MiB, "40GiB", "4096B", 0.5, "0.5"])
def test_a_parsed_budget_parses_to_itself(value):
    parsed = config.parse_budget(value)
    assert config.parse_budget(parsed) == parsed


BARE = ("has no unit, and a bare number is bytes only from 1 MiB up: write a size with a unit "
        '("40GiB", "512MiB"; "1B" is one byte) or a fraction of the card in (0, 1] ("1.0" is the whole card)')
NOT_POSITIVE = ("must be more than 0 bytes or a fraction of the card in (0, 1], got {} "
                "(leave it unset for the whole card)")
FRACTION = ("is read as a fraction of the card, which must be in (0, 1]; for bytes give an int or a size with a unit, "
            'e.g. "40GiB"')


@pytest.mark.parametrize("value,message", [
    (1, f"budget 1 {BARE}"),  # one byte, where 1.0 is the whole card
    (4096, f"budget 4096 {BARE}"),
    (MiB - 1, f"budget {MiB - 1} {BARE}"),
    ("1", f"budget '1' {BARE}"),
    ("4096", f"budget '4096' {BARE}"),
    (0, "budget " + NOT_POSITIVE.format(0)),
    (-1, "budget " + NOT_POSITIVE.format(-1)),
    ("0", "budget " + NOT_POSITIVE.format("'0'")),
    ("0B", "budget " + NOT_POSITIVE.format("'0B'")),
    ("0GiB", "budget " + NOT_POSITIVE.format("'0GiB'")),
    ("-5GiB", "budget " + NOT_POSITIVE.format("'-5GiB'")),
    (1.5, f"budget 1.5 {FRACTION}"),
    (0.0, f"budget 0.0 {FRACTION}"),
    (-0.5, f"budget -0.5 {FRACTION}"),
    ("1.5", f"budget 1.5 {FRACTION}"),
    ("0.0", f"budget 0.0 {FRACTION}"),
    (float("nan"), f"budget nan {FRACTION}"),
    ("12 parsecs", "unknown unit 'parsecs' in budget '12 parsecs' "
                   "(binary: B, KiB, MiB, GiB, TiB; decimal: KB, MB, GB, TB)"),
    ("lots", "cannot read budget 'lots': write a number with a unit, e.g. 40GiB"),
])
def test_a_bad_budget_raises_a_value_error_saying_how_to_write_it(value, message):
    with pytest.raises(ValueError) as e:
        config.parse_budget(value)
    assert str(e.value) == message


@pytest.mark.parametrize("value,message", [(True, "bytes or a fraction"), ([1], "int, float or str"),
                                           (("bytes", 1.5), r"budgets\['kv'\] \('bytes', 1.5\): the bytes must be a whole"),
                                           (("fraction", "abc"), r"budgets\['kv'\] .*the fraction must be a number"),
                                           (("fraction", None), r"budgets\['kv'\] .*the fraction must be a number")])
def test_a_budget_of_the_wrong_type_raises_a_type_error(value, message):
    with pytest.raises(TypeError, match=message):
        config.parse_budget(value, "budgets['kv']")


@pytest.mark.parametrize("text,message", [
    ("budget:1", f"TORCH_BUDGET_CONF budget '1' {BARE}"),
    ("budget:0", "TORCH_BUDGET_CONF budget " + NOT_POSITIVE.format("'0'")),
    ("budget:1.5", f"TORCH_BUDGET_CONF budget 1.5 {FRACTION}"),
])
def test_the_environment_variable_follows_the_same_budget_rules(text, message):
    with pytest.raises(ValueError) as e:
        config.parse_conf(text)
    assert str(e.value) == message


def test_errors_from_the_environment_variable_say_they_came_from_it():
    with pytest.raises(ValueError, match="TORCH_BUDGET_CONF budget"):
        config.parse_conf("budget:40 parsecs")
    with pytest.raises(ValueError, match="TORCH_BUDGET_CONF route"):
        config.parse_conf("route:fastest")
    with pytest.raises(ValueError, match="TORCH_BUDGET_CONF: unknown key 'budgte'"):
        config.parse_conf("budgte:40GiB")
    with pytest.raises(ValueError, match="TORCH_BUDGET_CONF: reuse_before_grow must be true or false"):
        config.parse_conf("reuse_before_grow:maybe")
    with pytest.raises(ValueError, match="TORCH_BUDGET_CONF host_pool"):
        config.parse_conf("host_pool:lots")
    # a bare number below 1 MiB: it had been read as bytes, and doctor showed "0.0 MiB"
    with pytest.raises(ValueError, match="TORCH_BUDGET_CONF host_pool '10' has no unit, and a bare number is bytes"):
        config.parse_conf("host_pool:10")
    assert config.parse_conf("host_pool:0")["host_pool"] == 0
    with pytest.raises(ValueError, match="TORCH_BUDGET_CONF map_run must be at least 2MiB"):
        config.parse_conf("map_run:1MiB")
    with pytest.raises(ValueError, match="TORCH_BUDGET_CONF: route is given twice"):
        config.parse_conf("route:vmm,route:pool")


def test_the_environment_variable_gives_install_its_arguments(monkeypatch):
    monkeypatch.setenv(config.ENV_VAR, "budget:0.8, route:pool ,reuse_before_grow:off, host_pool:8GiB, map_run:16MiB")
    assert config.from_environment() == {"budget": ("fraction", 0.8), "route": "pool", "reuse_before_grow": False,
                                         "host_pool": 8 << 30, "map_run": 16 << 20}


def test_described_settings_say_which_values_are_defaults():
    assert config.describe(config.parse_conf("budget:0.8,host_pool:8GiB")) == [
        ("budget", "0.8 of the card"),
        ("route", "auto: VMM, else pool, else sync, by what each device supports (default)"),
        ("reuse_before_grow", "true (default)"),
        ("map_run", "16.0 MiB (default)"),
        ("packing_time", "0.03 (default)"),
        ("host_pool", f"8.00 GiB ({8 << 30} bytes)"),
    ]
    assert config.describe({})[0] == ("budget", "the whole card (default)")


def test_units_read_binary_and_decimal_sizes_and_print_sizes_the_way_people_read_them():
    assert parse_bytes("2KiB") == 2048 and parse_bytes("2KB") == 2000 and parse_bytes("7") == 7
    assert format_bytes(3 * GiB // 2) == "1.50 GiB" and format_bytes(-3 * MiB) == "-3.0 MiB"


def test_sizes_are_counted_exactly_and_a_fraction_of_a_byte_is_refused():
    from torch_budget.units import memory_bytes

    assert parse_bytes("9007199254740993") == 2**53 + 1  # a float holds 2**53 + 1 as 2**53
    assert memory_bytes("9007199254740993B") == 2**53 + 1
    assert parse_bytes("1.5KiB") == 1536 and parse_bytes("0.1KiB") == 102  # a larger unit's fraction is dropped
    for text in ("1.5B", "0.5 b"):
        with pytest.raises(ValueError, match="is not a whole number of bytes"):
            parse_bytes(text)
    with pytest.raises(ValueError, match="is not a whole number of bytes"):
        memory_bytes("2097152.5B")
