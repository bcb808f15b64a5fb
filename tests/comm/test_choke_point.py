"""Every collective of the package goes through the choke point (``moesaic.comm``).

``EPGroup`` is where collectives get their deadline, their device (control-plane tensors on a
device the group's backend accepts, stream waits on NCCL), their traffic count and their place
in the recorded issue order. A ``torch.distributed`` collective, point-to-point call, group
creation or world initialisation anywhere else in ``src/moesaic`` escapes all four, so this test
parses every module (``ast``, not a text search: aliases, ``from`` imports and ``getattr``
are followed; comments, strings and docstrings are not code) and lists each such use outside
``src/moesaic/comm/`` with its file and line.

What the scan follows: ``import torch``, ``import torch.distributed [as d]``, ``from torch
import distributed [as d]``, ``from torch.distributed[.sub] import name [as n]``, a name bound
to one of those by plain assignment (``d = dist``, ``f = dist.all_reduce``) and
``getattr(d, "name")``; references count, not only calls (``fn = dist.all_reduce`` is as much
a bypass as a call). What it cannot follow: a module handed in as an argument under another
name, or names built at run time.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "moesaic"
COMM = SRC / "comm"

# Collectives, point-to-point, group creation and initialisation of torch.distributed (and of
# its submodules, e.g. ``distributed_c10d``), by name.
FORBIDDEN = re.compile(
    r"(all_reduce|all_gather|all_to_all|broadcast|reduce|scatter|gather)\w*"
    r"|(send|recv)\w*|isend|irecv|batch_isend_irecv|barrier|monitored_barrier"
    r"|new_group|new_subgroups\w*|split_group|init_process_group"
)
DIST = "torch.distributed"


def _dotted(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None for anything that is not a plain name chain."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _from_torch(node: ast.ImportFrom) -> bool:
    module = node.module or ""
    return node.level == 0 and (module == "torch" or module.startswith("torch."))


class _Scan(ast.NodeVisitor):
    """Offending references of one module: ``(line, qualified name)``."""

    def __init__(self, tree: ast.Module) -> None:
        self.aliases: dict[str, str] = {}  # local name -> qualified torch name
        self.found: list[tuple[int, str]] = []
        self._imports(tree)
        self._assignments(tree)

    def _imports(self, tree: ast.Module) -> None:
        for node in ast.walk(tree):  # imports inside functions count: scopes are not tracked
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "torch" or a.name.startswith("torch."):
                        # ``import torch.distributed`` binds ``torch``; ``as d`` binds the module
                        if a.asname:
                            self.aliases[a.asname] = a.name
                        else:
                            self.aliases[a.name.split(".")[0]] = "torch"
            elif isinstance(node, ast.ImportFrom) and _from_torch(node):
                for a in node.names:
                    if a.name == "*" and str(node.module).startswith(DIST):
                        self.found.append((node.lineno, f"from {node.module} import *"))
                    self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"

    def _assignments(self, tree: ast.Module) -> None:
        # Two passes: an alias of an alias (d = dist; f = d.all_reduce) resolves on the second.
        for _ in range(2):
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign) and len(node.targets) == 1:
                    target, value = node.targets[0], self._resolve(node.value)
                    if isinstance(target, ast.Name) and value and value.startswith(DIST):
                        self.aliases[target.id] = value

    def _resolve(self, node: ast.AST) -> str | None:
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            base = self._resolve(node.args[0])
            return f"{base}.{node.args[1].value}" if base else None
        parts = _dotted(node)
        if parts is None or parts[0] not in self.aliases:
            return None
        return ".".join([self.aliases[parts[0]], *parts[1:]])

    def _check(self, node: ast.AST) -> None:
        name = self._resolve(node)
        if name and name.startswith(DIST + ".") and FORBIDDEN.fullmatch(name.rsplit(".", 1)[1]):
            self.found.append((node.lineno, name))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, ast.Load):
            self._check(node)
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self._check(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id == "getattr":
            self._check(node)
        self.generic_visit(node)


def offenders(source: str) -> list[tuple[int, str]]:
    """``(line, qualified name)`` of every torch.distributed collective ``source`` uses."""
    tree = ast.parse(source)
    scan = _Scan(tree)
    scan.visit(tree)
    return sorted(set(scan.found))


def test_no_collective_bypasses_the_choke_point():
    modules = sorted(p for p in SRC.rglob("*.py") if COMM not in p.parents)
    assert len(modules) > 50  # the scan sees the package, not an empty glob
    found = [
        f"{path.relative_to(SRC.parents[1])}:{line}: {name}"
        for path in modules
        for line, name in offenders(path.read_text())
    ]
    assert not found, (
        "torch.distributed collectives outside src/moesaic/comm/ (issue them through "
        "moesaic.comm.collectives.EPGroup, create groups through comm.groups, initialise the "
        "world with comm.world.init_world):\n" + "\n".join(found)
    )


# ---- the scanner itself: every spelling it must see, and what it must leave alone ----------

CAUGHT = [
    ("import torch.distributed as dist\ndist.all_reduce(t)", "torch.distributed.all_reduce"),
    ("import torch.distributed\ntorch.distributed.barrier()", "torch.distributed.barrier"),
    (
        "import torch\ntorch.distributed.all_to_all_single(o, i)",
        "torch.distributed.all_to_all_single",
    ),
    ("from torch import distributed as d\nd.isend(t, 1)", "torch.distributed.isend"),
    ("from torch.distributed import new_group as ng\nng([0, 1])", "torch.distributed.new_group"),
    # inside a function, and referenced without a call (handed on as a callback)
    ("def f():\n    import torch.distributed as c\n    g(c.send)", "torch.distributed.send"),
    ("import torch.distributed as dist\nf = dist.gather\n", "torch.distributed.gather"),
    ("import torch.distributed as dist\nd = dist\nd.recv(t, 0)", "torch.distributed.recv"),
    (
        "import torch.distributed as dist\ngetattr(dist, 'all_gather_single')(o, i)",
        "torch.distributed.all_gather_single",
    ),
    (
        "import torch.distributed.distributed_c10d as c10d\nc10d.reduce_scatter_tensor(o, i)",
        "torch.distributed.distributed_c10d.reduce_scatter_tensor",
    ),
    (
        "import torch.distributed as dist\ndist.init_process_group('gloo')",
        "torch.distributed.init_process_group",
    ),
    ("import torch.distributed as dist\ndist.new_subgroups(2)", "torch.distributed.new_subgroups"),
]

LEFT_ALONE = [
    # queries, types and reduce ops are not collectives
    "import torch.distributed as dist\ndist.get_rank(); dist.is_initialized(); dist.ReduceOp.MAX",
    "import torch.distributed as dist\nx: dist.ProcessGroup | None = None",
    # an EPGroup's methods share the names
    "group.all_reduce(t, what='x'); group.barrier(); ep.isend(t, 1, 0)",
    # other libraries' reduce / gather, and DCP's save
    "from functools import reduce\nreduce(f, xs)\nimport numpy as np\nnp.gather(x)",
    "import torch.distributed.checkpoint as dcp\ndcp.save(sd, checkpoint_id=p)",
    # words in strings and comments
    "'dist.all_reduce(t)'  # dist.barrier()",
    "import torch\ntorch.gather(x, 0, i)",
]


@pytest.mark.parametrize(("source", "name"), CAUGHT, ids=[n for _, n in CAUGHT])
def test_scanner_sees_every_spelling(source, name):
    assert [n for _, n in offenders(source)] == [name]


@pytest.mark.parametrize("source", LEFT_ALONE)
def test_scanner_leaves_non_collectives_alone(source):
    assert offenders(source) == []
