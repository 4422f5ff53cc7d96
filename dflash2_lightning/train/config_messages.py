"""jsonargparse's errors (``dflash2 fit`` / ``validate``) as one line: the key, what was expected, the closest key.

jsonargparse reports a typo such as ``selector_rnak`` or a value such as ``selector_rank: sixteen`` as a
nested "Does not validate against any of the Union subtypes" report of 10-60 lines with the key named
once in the middle. :func:`explain` reads that report and returns, for example::

    model.init_args.selector_rnak is not a setting of DFlash2Module (in config small.yaml); did you mean
    selector_rank? `dflash2 fit --help` lists every setting

The valid keys come from the signatures of the classes the message names (the model and data
classes, ``Trainer``), so the suggestion is always a key the CLI accepts.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
from collections.abc import Sequence
from typing import Any

_CLASS_PATH = re.compile(r"Problem with given class_path '([\w.]+)'")
_NOT_ACCEPTED = re.compile(r"Option '([\w.]+)' is not accepted")
_PARSER_KEY = re.compile(r'Parser key "([\w.]+)":')
_EXPECTED = re.compile(r"Expected an? (.+?)\. Got value: (.*)$", re.M)
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)$", re.M)
_FILE_MISSING = re.compile(r'Parser key "config": File does not exist: (.*)$', re.M)
_GROUP_OPTION = re.compile(r"Group '([\w.]+)' does not accept option '([\w.]+)'")
_SUBCOMMAND_OPTION = re.compile(r"Subcommand '(\w+)' does not accept option '([\w.]+)'")
_REQUIRED = re.compile(r"the following arguments are required: (.*)$", re.M)
_NO_VALUE = re.compile(r"argument (--[\w.]+): expected (one argument|at least one argument)")
_SECTIONS = ("model", "data", "optimizer", "lr_scheduler")


def _class(path: str) -> Any:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def parameters(cls: Any) -> list[str]:
    """The ``__init__`` parameter names of ``cls`` and its bases (the keys a config may give it)."""
    names: list[str] = []
    for klass in getattr(cls, "__mro__", [])[:-1]:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            sig = inspect.signature(init)
        except (TypeError, ValueError):
            continue
        names += [
            p
            for p, v in sig.parameters.items()
            if p != "self" and v.kind not in (v.VAR_POSITIONAL, v.VAR_KEYWORD) and p not in names
        ]
    return names


def _top_level_keys() -> list[str]:
    from lightning.pytorch import Trainer

    keys = [
        "config",
        "print_config",
        "seed_everything",
        "ckpt_path",
        "trainer",
        "model",
        "data",
        "optimizer",
        "lr_scheduler",
    ]
    return keys + [f"trainer.{p}" for p in parameters(Trainer)]


def group_fields(cls: Any) -> dict[str, list[str]]:
    """The option groups of ``cls``'s ``__init__`` (parameters annotated with a dataclass) and their fields."""
    import dataclasses
    import typing

    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:
        return {}
    return {
        name: [f.name for f in dataclasses.fields(hint)]
        for name, hint in hints.items()
        if dataclasses.is_dataclass(hint)
    }


def _closest(word: str, choices: Sequence[str]) -> str | None:
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return found[0] if found else None


def _closest_setting(key: str, cls: Any) -> str | None:
    """The closest setting of ``cls`` to ``key``: a parameter, or a field of one of its option groups."""
    direct = _closest(key.split(".")[0], parameters(cls))
    if direct is not None:
        return direct
    leaf = key.split(".")[-1]
    groups = group_fields(cls)
    exact = [f"{group}.{leaf}" for group, fields in groups.items() if leaf in fields]
    if exact:  # a name two groups share (target.cache_dir, offline.cache_dir): name them all
        return " or ".join(exact)
    for group, fields in groups.items():
        field = _closest(leaf, fields)
        if field is not None:
            return f"{group}.{field}"
    return None


def _type_name(text: str) -> str:
    m = re.fullmatch(r"<class '([\w.]+)'>", text.strip())
    return m.group(1) if m else text.strip()


def _where(message: str, config_files: Sequence[str]) -> str:
    if "NestedArg" in message or not config_files:
        return "on the command line"
    return "in config " + ", ".join(config_files)


def explain(message: str, config_files: Sequence[str] = (), prog: str = "dflash2 fit") -> str:
    """One line for a jsonargparse error ``message`` (see the module docstring); never raises."""
    help_hint = f"`{prog} --help` lists every setting"
    missing = _FILE_MISSING.search(message)
    if missing:
        return f"config file {missing.group(1).strip()} does not exist: check the --config path"
    required = _REQUIRED.search(message)
    if required:
        not_given = re.sub(r"\b(?:fit|validate)\.", "", required.group(1).strip())  # the subcommand's own keys
        return (
            f"{not_given} not given (no config?): pass the run's config, `{prog} --config "
            f"CONFIG.yaml` (e.g. configs/tiny.yaml), or those settings on the command line; {help_hint}"
        )
    no_value = _NO_VALUE.search(message)
    if no_value:
        return f"{no_value.group(1)} needs a value (on the command line): `{no_value.group(1)} VALUE`; {help_hint}"
    outer = _PARSER_KEY.match(message.strip())
    section = outer.group(1) if outer else None
    class_path = _CLASS_PATH.search(message)
    cls = _class(class_path.group(1)) if class_path else None
    prefix = f"{section}.init_args." if section in _SECTIONS and cls is not None else ""
    owner = getattr(cls, "__name__", None)

    top = _SUBCOMMAND_OPTION.search(message)
    group_key = _GROUP_OPTION.search(message)
    file_key = top.group(2) if top else ".".join(group_key.groups()) if group_key else None
    if file_key is not None and not class_path:  # a top-level or trainer key of a config file (jsonargparse names
        # no file): `fit` reports it for its subcommand, `plan` (no subcommands) for the group it is in
        head, _, rest = file_key.partition(".")
        if head in _top_level_keys():
            guess = _closest(file_key, _top_level_keys())
            shown = file_key
        else:
            guess = _closest(head, [k for k in _top_level_keys() if "." not in k])
            guess, shown = (f"{guess}.{rest}" if guess and rest else guess), file_key
        where = "in config " + ", ".join(config_files) if config_files else "in the config"
        return f"{shown} is not a setting ({where})" + (f"; did you mean {guess}?" if guess else ";") + f" {help_hint}"

    in_group = _GROUP_OPTION.search(message)
    if in_group and cls is not None:
        group, key = in_group.groups()
        guess = _closest(key, group_fields(cls).get(group, []))
        return (
            f"{prefix}{group}.{key} is not a setting of {owner}'s {group} group ({_where(message, config_files)})"
            + (f"; did you mean {group}.{guess}?" if guess else ";")
            + f" {help_hint}"
        )

    bad = _NOT_ACCEPTED.search(message)
    if bad:
        key = bad.group(1)
        guess = _closest_setting(key, cls) if cls is not None else None
        return (
            f"{prefix}{key} is not a setting of {owner or section} ({_where(message, config_files)})"
            + (f"; did you mean {guess}?" if guess else ";")
            + f" {help_hint}"
        )

    unknown = _UNRECOGNIZED.search(message)
    if unknown:
        words = [w for w in unknown.group(1).split() if w.startswith("--")]
        if not words:
            return f"unexpected argument(s) {unknown.group(1).strip()!r}; {help_hint}"
        key = words[0][2:].split("=", 1)[0]
        if cls is not None:  # nested inside a class's arguments: model.init_args.<key> or <group>.<key>
            group, _, field = key.rpartition(".")
            fields = group_fields(cls).get(group)
            guess = (
                f"{group}.{_closest(field, fields)}"
                if fields and _closest(field, fields)
                else _closest_setting(key, cls)
            )
            full = f"{prefix}{key}"
        else:
            choices = _top_level_keys()
            guess = _closest(key, choices)
            full = key
        return (
            f"--{full} is not a setting (on the command line)"
            + (f"; did you mean --{prefix if cls is not None else ''}{guess}?" if guess else ";")
            + f" {help_hint}"
        )

    keys = _PARSER_KEY.findall(message)
    expected = _EXPECTED.search(message)
    if expected and keys:
        inner = keys[-1]
        full = inner if inner == section else f"{prefix}{inner}" if prefix else inner
        value = expected.group(2).strip()
        return (
            f"{full}={value!r} is invalid ({_where(message, config_files)}): expected "
            f"{_type_name(expected.group(1))}; {help_hint}"
        )

    # One of our own errors raised while jsonargparse built a value (a TargetSpec): its message alone.
    own = re.match(r"(?:\w+\.)*(?:Config|Target|Data|Objective|Checkpoint)Error: (.*)", message.strip(), re.S)
    if own:
        return own.group(1).strip()
    # Anything else: the report without its bookkeeping lines, on one line.
    keep = [
        line.strip()
        for line in message.splitlines()
        if line.strip()
        and not re.match(
            r"(Given value|Subtypes|Errors:|- Expected a <class 'NoneType'>|"
            r"Does not validate against any)",
            line.strip(),
        )
    ]
    text = "; ".join(keep)
    return (text[:400] + " ...") if len(text) > 400 else text
