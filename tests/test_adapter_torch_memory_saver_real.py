"""The torch_memory_saver adapter against torch_memory_saver's own released source
(.stack_src/torch_memory_saver-*/, tools/fetch_stack_sources.py; CI fetches it, elsewhere these
tests skip): every public name of its package and of its TorchMemorySaver class, with the same
parameters and defaults, read from the source without importing it (it loads its compiled hook).
"""
import ast
import inspect

import pytest

from _harness import REPO
from _hostcore import isolated
from test_adapter_torch_memory_saver import _parameters, _saver

SOURCES = sorted((REPO / ".stack_src").glob("torch_memory_saver-*"))
pytestmark = [pytest.mark.built("_host_core"),
              pytest.mark.skipif(not SOURCES, reason="no torch_memory_saver release source "
                                                     "(python tools/fetch_stack_sources.py)")]
RELEASES = [pytest.param(p, id=p.name) for p in SOURCES]


def _released_api(source):
    """{name: ("method", [(parameter, default)]) | ("property", has_setter)} of TorchMemorySaver's public
    members, and the names its package binds, from the released files."""
    tree = ast.parse((source / "torch_memory_saver/entrypoint.py").read_text())
    constants = {n.targets[0].id: ast.literal_eval(n.value) for n in tree.body
                 if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
                 and isinstance(n.value, ast.Constant)}
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TorchMemorySaver")
    api = {}
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("_"):
            continue
        decorators = [ast.unparse(d) for d in fn.decorator_list]
        if "property" in decorators:
            api[fn.name] = ("property", False)
        elif f"{fn.name}.setter" in decorators:
            api[fn.name] = ("property", True)
        else:
            args = fn.args.args
            defaults = [inspect.Parameter.empty] * (len(args) - len(fn.args.defaults)) + [
                constants[d.id] if isinstance(d, ast.Name) else ast.literal_eval(d) for d in fn.args.defaults]
            api[fn.name] = ("method", [(a.arg, d) for a, d in zip(args, defaults)])
    package = ast.parse((source / "torch_memory_saver/__init__.py").read_text())
    names = set()
    for node in package.body:
        if isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return api, names


@pytest.mark.parametrize("source", RELEASES)
def test_every_public_name_of_the_release_is_the_adapters_with_its_parameters(source):
    api, names = _released_api(source)
    assert {"region", "cuda_graph", "pause", "resume"} <= set(api) and "torch_memory_saver" in names

    @isolated
    def body():
        _, module = _saver()
        for name in names:
            assert hasattr(module, name), f"torch_memory_saver binds {name}; the adapter has none"
        assert isinstance(module.torch_memory_saver, module.TorchMemorySaver)
        cls = module.TorchMemorySaver
        assert {n for n in dir(cls) if not n.startswith("_")} == set(api)
        for name, (kind, detail) in api.items():
            ours = inspect.getattr_static(cls, name)
            if kind == "property":
                assert isinstance(ours, property) and (ours.fset is not None) == detail, name
            else:
                assert _parameters(ours) == detail, name

    body()
