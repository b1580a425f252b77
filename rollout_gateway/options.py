"""Options declared once: a dataclass field says its flag, help, default and check.

A settings class (the gateway's :class:`~rollout_gateway.server.GatewayConfig` groups,
the demo's ``DemoOptions``) declares each option as a field made by :func:`option`. From
that one declaration:

- the settings object checks its values (:func:`check_options`, from ``__post_init__``),
  raising :class:`ConfigError` that names the field and the flag that sets it;
- the command line gets its flags (:func:`add_options`): type, default, help, metavar and
  choices come from the field, a bad value is refused by the same :class:`Bound`;
- a flag typed on the command line is recorded (:func:`typed_options`), so an option that
  only makes sense with another (``Option.requires``) is refused naming both.

Everything here is standard library: the core install uses it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn
from urllib.parse import urlsplit

_METADATA_KEY = "rollout_gateway.option"


class ConfigError(ValueError):
    """A setting that cannot be used; the message names the field and its flag.

    Attributes:
        field: the settings field (``max_body_bytes``), or ``None``.
        source: where a user sets it: a flag (``--max-body-bytes``), an environment
            variable (``$ROLLOUT_GATEWAY_UPSTREAM_API_KEY``), or ``None`` (code only).
        reason: what is wrong, without the names.
    """

    def __init__(self, field: str | None, source: str | None, reason: str) -> None:
        self.field, self.source, self.reason = field, source, reason
        super().__init__(self._text())

    def _text(self) -> str:
        if self.field and self.source:
            return f"{self.field} ({self.source}): {self.reason}"
        name = self.field or self.source
        return f"{name}: {self.reason}" if name else self.reason

    @property
    def command_line(self) -> str:
        """The message as the command line says it: the flag first (``--x: reason``)."""
        if self.source:
            return f"{self.source}: {self.reason}"
        return str(self)


@dataclass(frozen=True)
class Bound:
    """What a number option takes: its type and range (NaN is never in range).

    The one number check of the package: settings objects check values with
    :meth:`problem`, the command line parses with :meth:`parse` (via :meth:`arg_type`).
    """

    kind: type[int] | type[float]
    accept: Callable[[Any], bool]
    #: What a good value is, in a sentence: "must be <what>".
    what: str

    def problem(self, value: object) -> str | None:
        """Why ``value`` is not a good one (``None`` if it is). A bool or a string is never
        a number, nor a float an integer (JSON or YAML config files give such values)."""
        allowed = int if self.kind is int else (int, float)
        if isinstance(value, bool) or not isinstance(value, allowed):
            kind = "an integer" if self.kind is int else "a number"
            return f"must be {kind}, got {value!r}"
        if not self.accept(value):
            return f"must be {self.what}, got {value!r}"
        return None

    def parse(self, text: str) -> int | float:
        """``text`` as a number in range (``ValueError`` saying why not)."""
        try:
            value = self.kind(text)
        except ValueError:
            raise ValueError(f"not a number: {text!r}") from None
        if not self.accept(value):
            raise ValueError(f"must be {self.what}, got {text}")
        return value

    def arg_type(self) -> Callable[[str], int | float]:
        """An argparse ``type``: argparse names the option in its error."""

        def parse(text: str) -> int | float:
            try:
                return self.parse(text)
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None

        parse.__name__ = self.kind.__name__
        return parse


def _finite_positive(v: float) -> bool:
    return 0 < v < math.inf


#: Sizes, counts and times: positive and finite.
POSITIVE_INT = Bound(int, _finite_positive, "a positive finite number")
POSITIVE = Bound(float, _finite_positive, "a positive finite number")
#: A share of something: in (0, 1].
SHARE = Bound(float, lambda v: 0 < v <= 1, "a number in (0, 1]")
#: A TCP port (uvicorn took 70000 and bound another port).
PORT = Bound(int, lambda v: 0 < v < 65536, "a port from 1 to 65535")
#: A finite number >= 0.
NON_NEGATIVE = Bound(float, lambda v: 0 <= v < math.inf, "a finite number >= 0")
#: A count of at least one.
AT_LEAST_ONE = Bound(int, lambda v: v >= 1, "at least 1")
#: A share: in [0, 1].
SHARE_OR_NONE = Bound(float, lambda v: 0 <= v <= 1, "a number in [0, 1]")
#: A whole number >= 0.
NON_NEGATIVE_INT = Bound(int, lambda v: 0 <= v < math.inf, "a whole number >= 0")


@dataclass(frozen=True)
class Option:
    """One option's declaration (see :func:`option`)."""

    help: str
    flag: str | None = None
    env: str | None = None
    bound: Bound | None = None
    #: How the command line reads a value that is not a number (an argparse ``type``).
    convert: Callable[[str], Any] | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    #: The default as ``--help`` says it (default: the field's default).
    default_text: str | None = None
    #: A field this one needs: typing this flag without that one is refused.
    requires: str | None = None
    #: The flag must be given.
    required: bool = False
    #: The ``--help`` section it is listed in (default: the one :func:`add_options` got).
    group: str | None = None
    #: Options sharing this name (in one ``group``) exclude each other.
    exclusive: str | None = None

    @property
    def source(self) -> str | None:
        """Where a user sets it: the flag, else the environment variable."""
        return self.flag or (f"${self.env}" if self.env else None)


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,  # noqa: A002 (argparse's name)
    default_factory: Callable[[], Any] | None = None,
    **declared: Any,
) -> Any:
    """A dataclass field that is an option: ``default``, and :class:`Option`'s keywords
    (``flag``, ``env``, ``bound``, ``convert``, ``metavar``, ``choices``, ``default_text``,
    ``requires``, ``required``, ``group``, ``exclusive``)."""
    metadata = {_METADATA_KEY: Option(help=help, **declared)}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def options_of(cls: Any) -> Iterator[tuple[dataclasses.Field[Any], Option]]:
    """The option fields of a settings class (or object), in declaration order."""
    for f in dataclasses.fields(cls):
        declared = f.metadata.get(_METADATA_KEY)
        if declared is not None:
            yield f, declared


def check_options(settings: Any) -> None:
    """Check every option field of ``settings`` by its declaration and annotation
    (``ConfigError`` naming the first bad one): numbers in their :class:`Bound`, flags
    bools, texts strings, choices among theirs; ``None`` where the annotation allows it."""
    for f, declared in options_of(settings):
        value = getattr(settings, f.name)
        problem = _problem(str(f.type), declared, value)
        if problem is not None:
            raise ConfigError(f.name, declared.source, problem)


def _problem(kind: str, declared: Option, value: object) -> str | None:
    if value is None and kind.replace(" ", "").endswith("|None"):
        return None
    if declared.bound is not None:
        return declared.bound.problem(value)
    if kind == "bool":
        return None if isinstance(value, bool) else f"must be true or false, got {value!r}"
    if kind.startswith("str") and not isinstance(value, str):
        return f"must be a string, got {value!r}"
    if kind.startswith("list") and not isinstance(value, list | tuple):
        return f"must be a list, got {value!r}"
    if declared.choices and value not in declared.choices:
        return f"must be one of {', '.join(map(repr, declared.choices))}, got {value!r}"
    return None


def source_of(cls: Any, name: str) -> str | None:
    """The flag (or variable) that sets field ``name`` of ``cls``."""
    for f, declared in options_of(cls):
        if f.name == name:
            return declared.source
    return None


# -- URLs -------------------------------------------------------------------------------


def base_url_problem(text: str) -> str | None:
    """Why ``text`` is not an http(s) base URL with a host and a valid port (``None``
    if it is); a URL without a scheme gets "did you mean http://...?"."""
    parts = urlsplit(text.strip())
    try:
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https"):
        hint = f" (did you mean http://{text.strip()}?)" if "://" not in text else ""
        return f"not an http(s) URL{hint}"
    if not parts.hostname or not port_ok:
        return "not a valid base URL (host and port)"
    return None


def base_url(text: str) -> str:
    """An argparse ``type``: ``text`` stripped, if an http(s) base URL."""
    problem = base_url_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text.strip()}: {problem}")
    return text.strip()


# -- the command line -------------------------------------------------------------------


class TypedOption(argparse.Action):
    """Stores the value and notes that the user typed the option (:func:`typed_options`)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        if self.nargs == 0:
            values = self.const
        elif isinstance(self.default, list):  # repeatable: append to what was typed
            typed = self.dest in typed_options(namespace)
            values = [*(getattr(namespace, self.dest) if typed else []), values]
        setattr(namespace, self.dest, values)
        namespace.explicit = frozenset(typed_options(namespace) | {self.dest})


def typed_options(namespace: argparse.Namespace) -> frozenset[str]:
    """The fields whose flags the user typed."""
    return frozenset(getattr(namespace, "explicit", ()) or ())


def add_options(
    parser: argparse.ArgumentParser,
    cls: Any,
    title: str | None = None,
    fill: dict[str, str] | None = None,
) -> None:
    """Add a flag to ``parser`` for every option field of ``cls`` that has one, listed
    under ``title`` in ``--help`` (or the option's own ``group``). The parsed value lands
    under the field's name; :func:`typed_options` says which were typed. A section of
    the same title added before (by an earlier call) is reused. ``fill``: values for
    ``{name}`` placeholders of the help texts (known when the parser is built)."""
    sections: dict[Any, Any] = {g.title: g for g in parser._action_groups if g.title}

    def section(declared: Option) -> Any:
        name = declared.group or title
        if name is None:
            return parser
        if name not in sections:
            sections[name] = parser.add_argument_group(name)
        if declared.exclusive is None:
            return sections[name]
        key = (name, declared.exclusive)
        if key not in sections:
            sections[key] = sections[name].add_mutually_exclusive_group()
        return sections[key]

    for f, declared in options_of(cls):
        if declared.flag is not None:
            if fill is not None:
                declared = dataclasses.replace(declared, help=declared.help.format_map(fill))
            section(declared).add_argument(declared.flag, **_argument(f, declared))
    parser.set_defaults(explicit=frozenset())


def _argument(f: dataclasses.Field[Any], declared: Option) -> dict[str, Any]:
    default = _default(f)
    kwargs: dict[str, Any] = {"dest": f.name, "action": TypedOption, "default": default}
    if declared.required:
        kwargs["required"] = True
    text = declared.help
    if isinstance(default, bool):  # a switch: the flag turns the default around
        kwargs.update(nargs=0, const=not default)
    else:
        if declared.bound is not None:
            kwargs["type"] = declared.bound.arg_type()
        elif declared.convert is not None:
            kwargs["type"] = declared.convert
        kwargs.update(metavar=declared.metavar, choices=declared.choices)
        shown = declared.default_text or (None if default in (None, []) else str(default))
        if shown is not None and text is not argparse.SUPPRESS:
            text = f"{text} (default: {shown})"
    kwargs["help"] = text if text is argparse.SUPPRESS else text.replace("%", "%%")
    return kwargs


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def values_from(args: argparse.Namespace, cls: Any) -> dict[str, Any]:
    """The parsed values of ``cls``'s option fields that have a flag."""
    return {f.name: getattr(args, f.name) for f, d in options_of(cls) if d.flag is not None}


def unmet_requirements(args: argparse.Namespace, classes: Sequence[Any]) -> str | None:
    """``"--x: only with --y"`` for the first typed flag whose ``requires`` is unset."""
    typed = typed_options(args)
    declared = {f.name: d for cls in classes for f, d in options_of(cls)}
    for name, d in declared.items():
        needed = d.requires
        if name in typed and needed is not None and getattr(args, needed, None) is None:
            return f"{d.flag}: only with {declared[needed].flag}"
    return None


def one_line_errors(parser: argparse.ArgumentParser, hint: str | None = None) -> None:
    """Make ``parser`` report a bad option in one line (``prog: error: ...``, no usage
    block) and exit 2; ``hint`` (e.g. "see --help") follows on the same line."""

    def error(message: str) -> NoReturn:
        tail = f" ({hint})" if hint else ""
        parser.exit(2, f"{parser.prog}: error: {message}{tail}\n")

    parser.error = error  # type: ignore[method-assign]


__all__ = [
    "AT_LEAST_ONE",
    "NON_NEGATIVE",
    "PORT",
    "POSITIVE",
    "POSITIVE_INT",
    "SHARE",
    "Bound",
    "ConfigError",
    "Option",
    "TypedOption",
    "add_options",
    "base_url",
    "base_url_problem",
    "check_options",
    "one_line_errors",
    "option",
    "options_of",
    "source_of",
    "typed_options",
    "unmet_requirements",
    "values_from",
]
