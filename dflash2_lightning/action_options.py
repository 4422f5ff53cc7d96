"""Every ``dflash2`` action's options, declared once: a dataclass whose fields are the options.

An action declares its options as a ``@dataclass(kw_only=True)``; each field is made by :func:`option`, which
carries the field's help text and, where needed, its command-line flag and value parser. From that one declaration:

- :func:`parse_options` builds the action's parser (``--help``), reads a ``--config FILE`` (YAML: the fields by
  name, as ``--print-config`` writes them), lets the command line override it, and builds the dataclass, whose
  ``__post_init__`` validates the values together;
- every option is spelled as LightningCLI spells a config key: ``--max_new_tokens 64``; the dashed form
  ``--max-new-tokens 64`` is the same option (the help shows that one);
- a value from a ``--config`` file goes through the same parser as one typed on the command line, so a bound is
  checked once, in one place, whichever way the value came;
- an action that writes a LightningCLI config (the quickstart) takes its entries as ``fit`` does, dotted:
  ``--trainer.max_steps 200``, ``--data.init_args.batch_size=4`` (a ``dict`` field made by :func:`config_entries`).

The dataclasses are plain typed dataclasses, so jsonargparse (LightningCLI's parser) reads them as well
(``tests/test_action_options.py`` checks that it does for every action).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

#: the default of an option that has none: the command line (or ``--config``) must give it.
REQUIRED: Any = dataclasses.MISSING

Options = TypeVar("Options")


def option(
    default: Any = REQUIRED,
    help: str = "",
    *,
    flag: str | None = None,
    parse: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    choices: Sequence[Any] | None = None,
) -> Any:
    """A field of an action's options dataclass.

    ``help`` may name ``{default}``; ``flag`` replaces ``--field-name`` (``--no-progress`` for a bool whose
    default is True); ``parse`` turns the command-line text into the value and may refuse it
    (:func:`~dflash2_lightning.errors.bounded`); ``choices`` lists the allowed values (a ``Literal`` annotation
    gives them too).
    """
    metadata = {"help": help, "flag": flag, "parse": parse, "metavar": metavar, "choices": choices}
    if isinstance(default, list):
        frozen = list(default)
        return dataclasses.field(default_factory=lambda: list(frozen), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def config_entries(help: str) -> Any:
    """A ``dict[str, Any]`` field that collects every dotted option of the command line (``--a.b.c VALUE`` or
    ``--a.b.c=VALUE``, the value read as YAML) as ``{"a.b.c": value}``: LightningCLI's override syntax for the
    entries of a config the action writes. In a ``--config`` file it is a mapping of the same keys."""
    return dataclasses.field(default_factory=dict, metadata={"help": help, "entries": True})


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _unwrap(hint: Any) -> tuple[Any, bool]:
    """``(T, optional)`` for ``T``, ``T | None`` and ``Optional[T]``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(rest) == 1:
            return rest[0], True
    return hint, False


def _scalar_parser(hint: Any) -> Callable[[str], Any]:
    from dflash2_lightning.errors import bounded

    if hint in (int, float):
        return bounded(hint)  # says "'x' is invalid: must be an int"; refuses nan and inf
    if hint is str:
        return str
    if hint is Path:
        return Path
    if typing.get_origin(hint) is Literal:
        kinds = {type(v) for v in typing.get_args(hint)}
        return kinds.pop() if len(kinds) == 1 else str
    raise TypeError(f"no command-line parser for {hint!r}: give option(..., parse=...)")


@dataclasses.dataclass(frozen=True)
class _Spec:
    """How one field reads from the command line and from a config file."""

    field: dataclasses.Field
    flag: str
    kind: Literal["flag", "list", "value", "entries"]
    parse: Callable[[str], Any]
    choices: Sequence[Any] | None


def _fields_own_first(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls``, its own before those it inherits (an action's options before the shared groups)."""
    by_name = {f.name: f for f in dataclasses.fields(cls) if f.init}
    order: list[str] = []
    for klass in cls.__mro__:
        order += [name for name in vars(klass).get("__annotations__", {}) if name in by_name and name not in order]
    return [by_name[name] for name in order]


def _specs(cls: type) -> list[_Spec]:
    hints = typing.get_type_hints(cls)
    specs = []
    for f in _fields_own_first(cls):
        meta = f.metadata
        hint, _ = _unwrap(hints[f.name])
        flag = meta.get("flag") or "--" + f.name.replace("_", "-")
        choices = meta.get("choices")
        if choices is None and typing.get_origin(hint) is Literal:
            choices = list(typing.get_args(hint))
        if meta.get("entries"):
            specs.append(_Spec(f, "--KEY.PATH", "entries", str, None))
        elif hint is bool:
            specs.append(_Spec(f, flag, "flag", bool, None))
        elif typing.get_origin(hint) is list:
            (element,) = typing.get_args(hint)
            specs.append(_Spec(f, flag, "list", meta.get("parse") or _scalar_parser(element), choices))
        else:
            specs.append(_Spec(f, flag, "value", meta.get("parse") or _scalar_parser(hint), choices))
    return specs


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)
    return str(value)


def add_options(parser: argparse.ArgumentParser, cls: type, defaults: dict[str, Any] | None = None) -> None:
    """Add one ``argparse`` option per field of ``cls`` to ``parser``. Every parsed default is ``None`` ("not
    given": the dataclass keeps the one default), except the ``defaults`` given here: a benchmark's plain parser
    reuses an action's options group this way, with defaults of its own."""
    defaults = defaults or {}
    for spec in _specs(cls):
        f, meta = spec.field, spec.field.metadata
        if spec.kind == "entries":
            parser.add_argument_group("config entries", meta["help"])
            continue
        default = defaults.get(f.name, _default(f))
        required = default is dataclasses.MISSING
        text = meta.get("help", "").replace("{default}", _shown(default)) + (" (required)" if required else "")
        if f.name in defaults:
            text += f" (default {_shown(default)})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": defaults.get(f.name), "help": text}
        if spec.kind == "flag":
            kwargs["action"] = "store_false" if default else "store_true"
        else:
            kwargs.update(type=spec.parse, choices=spec.choices, metavar=meta.get("metavar"))
            if spec.kind == "list":
                kwargs.update(nargs="+", action="extend")
        parser.add_argument(spec.flag, **kwargs)
        snake = "--" + spec.flag[2:].replace("-", "_")
        if snake != spec.flag:  # LightningCLI's spelling of the same option, not shown twice in --help
            parser.add_argument(snake, **{**kwargs, "help": argparse.SUPPRESS})


def build_parser(
    cls: type,
    prog: str,
    description: str,
    epilog: str | None = None,
    formatter_class: type[argparse.HelpFormatter] = argparse.HelpFormatter,
) -> argparse.ArgumentParser:
    """The ``argparse`` parser of an options dataclass: :func:`add_options`, plus ``--config`` and
    ``--print-config`` (``formatter_class=argparse.RawDescriptionHelpFormatter`` keeps a description's lines)."""
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog, formatter_class=formatter_class)
    add_options(parser, cls)
    parser.add_argument(
        "--config",
        metavar="FILE",
        action="append",
        default=None,
        help="YAML file of these options by name (as --print-config writes it); the command line overrides it "
        "(repeatable: later files override earlier ones)",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the options as YAML (usable with --config) and exit"
    )
    return parser


def _from_file(parser: argparse.ArgumentParser, specs: list[_Spec], path: str) -> dict[str, Any]:
    """The options a ``--config`` file gives, each through its option's own parser (one check, one place)."""
    from dflash2_lightning.errors import UsageError

    try:
        data = yaml.safe_load(Path(path).expanduser().read_text(encoding="utf-8"))
    except OSError as error:
        raise UsageError(f"--config {path}: cannot read it ({error.strerror}); give a readable YAML file") from None
    except yaml.YAMLError as error:
        raise UsageError(f"--config {path} is not valid YAML ({str(error).splitlines()[0]}); fix the file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"--config {path} must be a mapping of option names to values, not {type(data).__name__}")
    by_name = {s.field.name: s for s in specs}
    given: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        spec = by_name.get(name)
        if spec is None:
            import difflib

            close = difflib.get_close_matches(name, list(by_name), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; the options are {sorted(by_name)}"
            raise UsageError(f"--config {path}: unknown option {key!r}{hint}")
        given[name] = _value_from_file(spec, value, f"--config {path}: {key}")
    return given


def _value_from_file(spec: _Spec, value: Any, where: str) -> Any:
    from dflash2_lightning.errors import UsageError

    if value is None:
        return None
    if spec.kind == "entries":
        if not isinstance(value, dict):
            raise UsageError(f"{where}={value!r} is invalid: must be a mapping of dotted config keys to values")
        return {str(k): v for k, v in value.items()}
    if spec.kind == "flag":
        if not isinstance(value, bool):
            raise UsageError(f"{where}={value!r} is invalid: must be true or false")
        return value
    values = value if spec.kind == "list" and isinstance(value, list) else [value]
    parsed = []
    for item in values:
        if isinstance(item, (dict, list)):
            raise UsageError(
                f"{where}={value!r} is invalid: must be a {'list of ' if spec.kind == 'list' else ''}value"
            )
        text = ("true" if item else "false") if isinstance(item, bool) else str(item)
        try:
            result = spec.parse(text)
        except (argparse.ArgumentTypeError, TypeError, ValueError) as error:
            raise UsageError(f"{where}: {error}") from None
        if spec.choices is not None and result not in spec.choices:
            raise UsageError(f"{where}={item!r} is invalid: must be one of {list(spec.choices)}")
        parsed.append(result)
    return parsed if spec.kind == "list" else parsed[0]


def split_entries(argv: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """``argv`` without its dotted options, and those options as ``{"a.b": value}`` (values read as YAML)."""
    rest: list[str] = []
    entries: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        word = argv[i]
        key, sep, text = word[2:].partition("=")
        if word.startswith("--") and "." in key and not key.startswith("."):
            if not sep:
                if i + 1 >= len(argv):
                    from dflash2_lightning.errors import UsageError

                    raise UsageError(f"{word} needs a value: give it as `{word} VALUE` or `{word}=VALUE`")
                text = argv[i + 1]
                i += 1
            entries[key] = yaml.safe_load(text)
        else:
            rest.append(word)
        i += 1
    return rest, entries


def options_from_args(
    cls: type[Options], args: argparse.Namespace, parser: argparse.ArgumentParser, entries: dict[str, Any] | None = None
) -> Options:
    """The dataclass of parsed arguments: ``--config`` files first, then the command line, then the defaults;
    a required option that neither gave is argparse's usage error. The dataclass validates the values.
    ``entries`` are the dotted options :func:`split_entries` took out of the command line."""
    specs = _specs(cls)
    given: dict[str, Any] = {}
    for path in getattr(args, "config", None) or []:
        for name, value in _from_file(parser, specs, path).items():
            if isinstance(value, dict) and isinstance(given.get(name), dict):
                value = {**given[name], **value}
            given[name] = value
    for spec in specs:
        if spec.kind == "entries":
            if entries:
                given[spec.field.name] = {**given.get(spec.field.name, {}), **entries}
            continue
        value = getattr(args, spec.field.name, None)
        if value is not None:
            given[spec.field.name] = value
    given = {k: v for k, v in given.items() if v is not None}
    missing = [s.flag for s in specs if s.field.name not in given and _default(s.field) is dataclasses.MISSING]
    if missing:
        parser.error(f"the following arguments are required: {', '.join(missing)}")
    return cls(**given)


def as_yaml(options: Any) -> str:
    """The options as the YAML ``--config`` reads (paths as text)."""

    def plain(value: Any) -> Any:
        if isinstance(value, Path):
            return str(value)
        if isinstance(value, list):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    data = {f.name: plain(getattr(options, f.name)) for f in dataclasses.fields(options) if f.init}
    return yaml.safe_dump(data, sort_keys=False)


def parse_options(
    cls: type[Options],
    argv: Sequence[str] | None,
    prog: str,
    description: str,
    epilog: str | None = None,
    formatter_class: type[argparse.HelpFormatter] = argparse.HelpFormatter,
) -> Options:
    """Parse an action's command line into its options dataclass (see the module docstring).

    ``--print-config`` prints the resolved options and exits with status 0."""
    parser = build_parser(cls, prog, description, epilog, formatter_class)
    words = list(sys.argv[1:] if argv is None else argv)
    entries: dict[str, Any] = {}
    if any(s.kind == "entries" for s in _specs(cls)):
        words, entries = split_entries(words)
    args = parser.parse_args(words)
    options = options_from_args(cls, args, parser, entries)
    if args.print_config:
        sys.stdout.write(as_yaml(options))
        raise SystemExit(0)
    return options


def as_options(value: Any, cls: type) -> Any:
    """``value`` as an instance of the option group ``cls`` (a Lightning component's settings group, such as the
    module's ``draft`` or the data's ``offline``): an instance, a mapping of its fields, or None (the defaults).
    jsonargparse hands over instances; Python callers may pass dicts."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if hasattr(value, "as_dict"):  # a jsonargparse Namespace
        value = value.as_dict()
    if isinstance(value, dict):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            from dflash2_lightning.errors import ConfigError

            raise ConfigError(
                f"{unknown} {'is' if len(unknown) == 1 else 'are'} not a setting of {cls.__name__} "
                f"(its settings: {', '.join(sorted(known))})"
            )
        return cls(**value)
    raise TypeError(f"expected {cls.__name__} or a mapping of its fields, got {type(value).__name__}")
