"""Checks of user input, with one policy for the whole package.

The wrong type raises TypeError, a value out of range raises InvalidArgumentError (a
ValueError); the message names the argument and shows what was given. bool is never
accepted as an int. Never `assert` (stripped under -O).
"""
from __future__ import annotations

from .errors import InvalidArgumentError

# The largest integer the core takes (a signed 64-bit one): ctypes would wrap a larger one
# silently on its way there (2**64 bytes read back as a budget of 0).
INT64_MAX = 2**63 - 1


def is_int(value: object) -> bool:
    """An integer (anything with __index__, numpy integers included), never a bool."""
    if isinstance(value, bool):
        return False
    try:
        value.__index__()  # type: ignore[union-attr]
    except (AttributeError, TypeError):
        return False
    return True


def integer(value: object, what: str, *, minimum: int | None = None) -> int:
    """`value` as an int, at least `minimum` when given."""
    if not is_int(value):
        raise TypeError(f"{what} must be an integer, got {type(value).__name__} ({value!r})")
    value = value.__index__()  # type: ignore[union-attr]
    if minimum is not None and value < minimum:
        raise InvalidArgumentError(f"{what} must be >= {minimum}, got {value}")
    if value > INT64_MAX:
        raise InvalidArgumentError(f"{what} must be below 2**63, got {value}")
    return value


POOL_HANDLE = "a graph pool handle is the (int, int) tuple from torch.cuda.graph_pool_handle() or CUDAGraph.pool()"


def pool_handle(value: object) -> tuple[int, int]:
    """A graph pool handle: two integers, each one of torch's 64-bit unsigned ids."""
    if not isinstance(value, tuple) or not all(is_int(x) for x in value):
        raise TypeError(POOL_HANDLE + f", got {value!r}")
    ids = tuple(x.__index__() for x in value)
    if len(ids) != 2 or not all(0 <= x < 2**64 for x in ids):
        raise InvalidArgumentError(POOL_HANDLE + f" (two ids in [0, 2**64)), got {value!r}")
    return ids


def positive_int(value: object, what: str) -> int:
    return integer(value, what, minimum=1)


def non_negative_int(value: object, what: str) -> int:
    return integer(value, what, minimum=0)


def number(value: object, what: str, *, minimum: float | None = None) -> float | int:
    """An int or float (not a bool), at least `minimum` when given."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number, got {type(value).__name__} ({value!r})")
    if minimum is not None and value < minimum:
        raise InvalidArgumentError(f"{what} must be >= {minimum}, got {value}")
    return value


def fraction(value: object, what: str) -> float:
    """A number in (0, 1]."""
    value = number(value, what)
    if not 0 < value <= 1:
        raise InvalidArgumentError(f"{what} must be in (0, 1], got {value}")
    return float(value)


def tag_name(value: object, what: str = "tag") -> str:
    """A tag name: a non-empty str."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__} ({value!r})")
    if not value:
        raise InvalidArgumentError(f"{what} must be a non-empty str")
    if "\x00" in value:  # the core reads names as C strings: "a\x00b" would be tag "a"
        raise InvalidArgumentError(f"{what} {value!r} holds a NUL character")
    try:
        value.encode()
    except UnicodeEncodeError as e:
        raise InvalidArgumentError(f"{what} {value!r} cannot be written as UTF-8 ({e.reason})") from None
    return value


def tag_names(value: object, what: str = "tags") -> list[str] | None:
    """None (every tag), a tag name, or an iterable of distinct names, as a list of names."""
    if value is None:
        return None
    if isinstance(value, str):
        return [tag_name(value, what)]
    if isinstance(value, (bytes, bytearray)):
        raise TypeError(f"{what} must be None, a tag name (str) or an iterable of names, got {type(value).__name__}")
    try:
        names = list(value)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"{what} must be None, a tag name or an iterable of names, "
                        f"got {type(value).__name__}") from None
    if not names:
        raise InvalidArgumentError(f"{what} must name at least one tag (None means every tag)")
    for name in names:
        tag_name(name, f"a tag of {what}")
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"{what} repeat a name: {names!r}")
    return names


def read_json_file(path, what: str):
    """The JSON value in file `path`, or a ValueError naming `what` (e.g. "config file") and the
    problem: missing, a folder, unreadable, not UTF-8 text, not JSON, or nested too deep."""
    import json

    name = repr(str(path))
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{what} {name} does not exist") from None
    except IsADirectoryError:
        raise ValueError(f"{what} {name} is a folder; give the JSON file in it") from None
    except OSError as e:
        raise ValueError(f"{what} {name} cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} {name} is not text (UTF-8): give the JSON file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {name} is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"{what} {name} nests its JSON too deep to be read") from None


def boolean(value: object, what: str) -> bool:
    """`value`, which must be a bool: a string such as "false" or None is a slip, not a setting."""
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be True or False, got {type(value).__name__} ({value!r:.60})")
    return value
