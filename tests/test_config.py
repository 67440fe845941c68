"""Settings: budgets in bytes or fractions, units, TORCH_BUDGET_CONF and its errors."""
import pytest

from torch_budget import config
from torch_budget.units import GiB, MiB, format_bytes, parse_bytes


@pytest.mark.parametrize("value,expected", [
    (4096, ("bytes", 4096)),
    ("40GiB", ("bytes", 40 * GiB)),
    ("512 MiB", ("bytes", 512 * MiB)),
    ("60GB", ("bytes", 60 * 10**9)),
    ("1.5GiB", ("bytes", 3 * GiB // 2)),
    (0.9, ("fraction", 0.9)),
    ("0.85", ("fraction", 0.85)),
    (None, None),
])
def test_a_budget_is_bytes_or_a_fraction_of_the_card(value, expected):
    assert config.parse_budget(value) == expected


@pytest.mark.parametrize("value,error,message", [
    (-1, ValueError, ">= 0"),
    (1.5, ValueError, r"\(0, 1\]"),
    (True, TypeError, "bytes or a fraction"),
    ("12 parsecs", ValueError, "unknown unit 'parsecs'"),
    ("lots", ValueError, "cannot read"),
    ([1], TypeError, "int, float or str"),
])
def test_a_bad_budget_raises_naming_the_problem(value, error, message):
    with pytest.raises(error, match=message):
        config.parse_budget(value)


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
    with pytest.raises(ValueError, match="TORCH_BUDGET_CONF map_run must be at least 2MiB"):
        config.parse_conf("map_run:1MiB")


def test_the_environment_variable_gives_install_its_arguments(monkeypatch):
    monkeypatch.setenv(config.ENV_VAR, "budget:0.8, route:pool ,reuse_before_grow:off, host_pool:8GiB, map_run:16MiB")
    assert config.from_environment() == {"budget": "0.8", "route": "pool", "reuse_before_grow": False,
                                         "host_pool": 8 << 30, "map_run": 16 << 20}


def test_units_read_binary_and_decimal_sizes_and_print_sizes_the_way_people_read_them():
    assert parse_bytes("2KiB") == 2048 and parse_bytes("2KB") == 2000 and parse_bytes("7") == 7
    assert format_bytes(3 * GiB // 2) == "1.50 GiB" and format_bytes(-3 * MiB) == "-3.0 MiB"
