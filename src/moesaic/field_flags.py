"""Command-line flags generated from a config dataclass: each field is one flag, its help the
field's entry in the class docstring's ``Attributes:`` section, its type and default the
field's own. A new field is a new flag with no table to edit.

The rule (torchtitan's config manager works the same way): ``--<name with dashes>`` takes a
value parsed by the field's type (``int``, ``float``; anything else, an ``int | str`` field such
as ``"auto"`` or a count included, the text, which the field's own check parses); a ``bool``
field is a switch, ``--<name>``
when it defaults to False, ``--no-<name>`` when it defaults to True. ``None`` in a union only
makes the value optional. A field whose type is another dataclass or a mapping is a nested
table, not a flag. A field may say more in its ``metadata`` (``dataclasses.field``):

* ``FLAG``: its flag's spelling (``"--experts"``), or None: no flag (a field set by another
  option);
* ``ALIASES``: other spellings (``("--strategy",)``);
* ``METAVAR``: the value's placeholder, or a function returning it (a registry's names).

Whatever a value means beyond its type is checked by the dataclass when it is built, which
names the field. Torch-free; imports nothing of the package.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ALIASES", "FLAG", "METAVAR", "FieldFlag", "add_flags", "field_docs", "field_flags"]

FLAG = "flag"
ALIASES = "aliases"
METAVAR = "metavar"


@dataclass(frozen=True, slots=True)
class FieldFlag:
    """One field's flag.

    Attributes:
        dest: where argparse stores it (the field's name under the caller's prefix).
        flags: its spellings, the first the one messages name.
        action: "store" (a value), "store_true" or "store_false" (a switch).
        parse: the value's parser (None for a switch).
        metavar: the value's placeholder.
        help: the field's doc, with its default for a value.
    """

    dest: str
    flags: tuple[str, ...]
    action: str
    parse: Callable[[str], Any] | None
    metavar: str | None
    help: str


def field_docs(cls: type) -> dict[str, str]:
    """Each field's entry in the ``Attributes:`` sections of ``cls``'s docstring and its bases'
    (a subclass's entry wins), as one line."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        doc = klass.__dict__.get("__doc__")
        if isinstance(doc, str):
            out.update(_attributes(inspect.cleandoc(doc)))
    return out


def _attributes(doc: str) -> dict[str, str]:
    out: dict[str, str] = {}
    name, indent, inside = None, None, False
    for line in doc.splitlines():
        if line.strip() == "Attributes:":
            inside, name, indent = True, None, None
            continue
        if not inside:
            continue
        if line and not line[0].isspace():  # the next section
            inside = False
            continue
        m = re.match(r"^( +)([A-Za-z_]\w*)(?: \([^)]*\))?:(?: (.*))?$", line)
        if m and (indent is None or len(m.group(1)) == indent):
            indent, name = len(m.group(1)), m.group(2)
            out[name] = (m.group(3) or "").strip()
        elif name is not None and line.strip():
            out[name] = f"{out[name]} {line.strip()}".strip()
    return out


def _members(hint: Any) -> tuple[Any, ...]:
    """The types of a union (None left out), or ``(hint,)``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(t for t in typing.get_args(hint) if t is not type(None))
    return (hint,)


def _is_table(hint: Any) -> bool:
    """A nested dataclass or a mapping (a table of its own, not a flag)."""
    for t in _members(hint):
        origin = typing.get_origin(t) or t
        if dataclasses.is_dataclass(origin) or (
            isinstance(origin, type) and issubclass(origin, Mapping)
        ):
            return True
    return False


def _parser(hint: Any) -> Callable[[str], Any]:
    members = set(_members(hint))
    if members == {int}:
        return int
    if members == {float}:
        return float
    # str, a union with str ("auto" or a count) and a sequence given as text ("1,2"): the
    # field's own check parses the text, and names the field and the text given when it is bad
    return str


def _shown(value: Any) -> str:
    return "None" if value is None else str(value)


def field_flags(
    cls: type,
    *,
    prefix: str = "",
    flag_prefix: str = "",
    defaults: object | None = None,
    skip: tuple[str, ...] = (),
) -> list[FieldFlag]:
    """The flags of ``cls``'s fields (see the module docstring).

    Args:
        cls: a dataclass.
        prefix: prepended to each field's name to make its ``dest`` (``"model."``).
        flag_prefix: prepended to each generated flag's name (``"taskflow-"``: a strategy's
            options).
        defaults: an instance whose attributes are the defaults shown; None: the fields'
            declared defaults.
        skip: names of fields that are not flags here.

    Raises:
        ValueError: a field without an entry in the docstring (every option has its doc).
    """
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.name in skip or _is_table(hints[f.name]):
            continue
        dashed = flag_prefix + f.name.replace("_", "-")
        flag = f.metadata.get(FLAG, f"--{dashed}")
        if flag is None:
            continue
        if f.name not in docs:
            raise ValueError(
                f"{cls.__name__}.{f.name} has no entry in the class docstring's Attributes: "
                "its flag's help is that entry"
            )
        text = docs[f.name].replace("``", "").replace("%", "%%")
        if defaults is not None:
            default = getattr(defaults, f.name)
        elif f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        spellings = (flag, *f.metadata.get(ALIASES, ()))
        if _members(hints[f.name]) == (bool,):
            off = default is True
            if off and FLAG not in f.metadata:
                spellings = (f"--no-{dashed}", *spellings[1:])
            action = "store_false" if off else "store_true"
            out.append(FieldFlag(prefix + f.name, spellings, action, None, None, text))
            continue
        metavar = f.metadata.get(METAVAR, f.name.upper())
        metavar = metavar() if callable(metavar) else metavar
        help_text = f"{text} (default: {_shown(default)})"
        out.append(
            FieldFlag(
                prefix + f.name, spellings, "store", _parser(hints[f.name]), metavar, help_text
            )
        )
    return out


def add_flags(group: argparse._ActionsContainer, flags: list[FieldFlag]) -> None:
    """Add ``flags`` to ``group``, each left absent when not given (``argparse.SUPPRESS``), so
    that a value from elsewhere (a TOML file) survives an unset flag."""
    for f in flags:
        if f.action == "store":
            group.add_argument(
                *f.flags,
                dest=f.dest,
                type=f.parse or str,
                metavar=f.metavar,
                default=argparse.SUPPRESS,
                help=f.help,
            )
        else:
            group.add_argument(
                *f.flags, dest=f.dest, action=f.action, default=argparse.SUPPRESS, help=f.help
            )
