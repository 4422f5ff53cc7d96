"""Every action's options come from one typed declaration (dflash2_lightning/action_options.py).

The mechanism itself on a small options class (command line, --config file, one parser for both, LightningCLI's
spelling, --print-config round trip), then every ``dflash2`` action: its --help lists exactly the options its
dataclass declares, and jsonargparse (LightningCLI's parser) reads the same dataclass.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, Literal

import pytest

from dflash2_lightning import cli
from dflash2_lightning.action_options import REQUIRED, build_parser, option, parse_options
from dflash2_lightning.errors import ConfigError, UsageError, bounded


@dataclass(kw_only=True)
class Shared:
    target: str = option(REQUIRED, "the target")


@dataclass(kw_only=True)
class Options(Shared):
    draft: str = option(REQUIRED, "the draft")
    max_new_tokens: int = option(64, "budget (default {default})", parse=bounded(int, 1))
    temperatures: list[float] = option([0.0], "temperatures", flag="--temperature")
    path: Literal["selector", "backbone"] = option("selector", "which path")
    progress: bool = option(True, "no progress bars", flag="--no-progress")
    overwrite: bool = option(False, "overwrite")
    note: str | None = option(None, "a note")

    def __post_init__(self) -> None:
        if self.draft == self.target:
            raise ConfigError(f"draft={self.draft!r} is invalid: must differ from target")


def parse(argv: list[str]) -> Options:
    return parse_options(Options, argv, prog="dflash2 test", description="a test action")


def test_the_command_line_makes_the_dataclass_and_its_defaults_hold():
    assert parse(["--target", "t", "--draft", "d"]) == Options(target="t", draft="d")
    given = parse(
        [
            *("--target", "t", "--draft", "d", "--max-new-tokens", "8", "--temperature", "0", "1"),
            *("--temperature", "0.5", "--path", "backbone", "--no-progress", "--overwrite", "--note", "hi"),
        ]
    )
    assert given == Options(
        target="t",
        draft="d",
        max_new_tokens=8,
        temperatures=[0.0, 1.0, 0.5],
        path="backbone",
        progress=False,
        overwrite=True,
        note="hi",
    )
    # LightningCLI's spelling of a key is the same option
    assert parse(["--target", "t", "--draft", "d", "--max_new_tokens", "9"]).max_new_tokens == 9


def test_bad_values_are_refused_by_the_parser_or_the_dataclass(capsys):
    for argv in (
        ["--draft", "d"],  # --target missing
        ["--target", "t", "--draft", "d", "--max-new-tokens", "0"],
        ["--target", "t", "--draft", "d", "--max-new-tokens", "x"],
        ["--target", "t", "--draft", "d", "--path", "other"],
    ):
        with pytest.raises(SystemExit) as exit_:
            parse(argv)
        assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "required: --target" in err and "0 is invalid: must be >= 1" in err and "invalid choice: 'other'" in err
    with pytest.raises(ConfigError, match="must differ from target"):
        parse(["--target", "same", "--draft", "same"])


def test_a_config_file_gives_options_through_the_same_parser(tmp_path, capsys):
    config = tmp_path / "opts.yaml"
    config.write_text("target: t\ndraft: d\nmax_new_tokens: 12\ntemperatures: [0, 1]\nprogress: false\n")
    assert parse(["--config", str(config)]) == Options(
        target="t", draft="d", max_new_tokens=12, temperatures=[0.0, 1.0], progress=False
    )
    # the command line overrides the file; a later file overrides an earlier one
    later = tmp_path / "later.yaml"
    later.write_text("max-new-tokens: 20\n")  # a dashed key is the same option
    assert parse(["--config", str(config), "--config", str(later)]).max_new_tokens == 20
    assert parse(["--config", str(config), "--max-new-tokens", "3", "--config", str(later)]).max_new_tokens == 3
    for text, message in [
        ("max_new_tokens: 0\n", "max_new_tokens: 0 is invalid: must be >= 1"),  # the parser's own bound
        ("max_new_tokens: many\n", "'many' is invalid: must be an int"),
        ("path: other\n", "path='other' is invalid: must be one of ['selector', 'backbone']"),
        ("progress: maybe\n", "progress='maybe' is invalid: must be true or false"),
        ("max_new_tokes: 3\n", "unknown option 'max_new_tokes'; did you mean 'max_new_tokens'?"),
        ("- 1\n", "must be a mapping of option names to values"),
        ("a: [\n", "is not valid YAML"),
    ]:
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(UsageError, match="--config .*bad.yaml") as error:
            parse(["--config", str(bad), "--target", "t", "--draft", "d"])
        assert message in str(error.value)
    with pytest.raises(UsageError, match="cannot read it"):
        parse(["--config", str(tmp_path / "absent.yaml")])


def test_print_config_writes_what_config_reads(tmp_path, capsys):
    argv = ["--target", "t", "--draft", "d", "--temperature", "0.7", "--no-progress", "--note", "x"]
    with pytest.raises(SystemExit) as exit_:
        parse([*argv, "--print-config"])
    assert exit_.value.code == 0
    (tmp_path / "printed.yaml").write_text(capsys.readouterr().out)
    assert parse(["--config", str(tmp_path / "printed.yaml")]) == parse(argv)


def test_help_shows_each_option_once_with_its_default():
    text = " ".join(build_parser(Options, "dflash2 test", "a test action").format_help().split())
    assert "--max-new-tokens MAX_NEW_TOKENS budget (default 64)" in text
    assert "--max_new_tokens" not in text  # the LightningCLI spelling is accepted, not listed twice
    assert "--draft DRAFT the draft (required)" in text
    assert text.index("--draft") < text.index("--target")  # the action's own options before the shared group


# ----------------------------------------------------------------------------- every dflash2 action
def _options_class(action: cli.Action) -> type:
    assert action.options is not None
    module, _, name = action.options.partition(":")
    return getattr(importlib.import_module(module), name)


ACTIONS_WITH_OPTIONS = {name: a for name, a in cli.ACTIONS.items() if name != "plan"}


def test_every_action_but_plan_declares_its_options_as_a_dataclass():
    """`plan` reads a fit config with LightningCLI's parser (the fit's own typed declaration)."""
    assert cli.ACTIONS["plan"].options is None
    undeclared = [name for name, action in ACTIONS_WITH_OPTIONS.items() if action.options is None]
    assert not undeclared, f"actions whose options are not one dataclass: {undeclared}"
    for action in ACTIONS_WITH_OPTIONS.values():
        assert dataclasses.is_dataclass(_options_class(action))


def _flags_in_help(text: str) -> set[str]:
    """Every ``--flag`` of an --help text's usage lines."""
    import re

    usage = text[: text.index("\n\n")]
    return set(re.findall(r"(--[A-Za-z][\w-]*)", usage))


@pytest.mark.parametrize("name", sorted(ACTIONS_WITH_OPTIONS))
def test_an_actions_help_lists_exactly_the_options_of_its_dataclass(name, capsys):
    cls = _options_class(ACTIONS_WITH_OPTIONS[name])
    with pytest.raises(SystemExit) as exit_:
        cli.main([name, "--help"])
    assert exit_.value.code == 0
    shown = _flags_in_help(capsys.readouterr().out)
    declared = {
        f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        for f in dataclasses.fields(cls)
        if f.init and not f.metadata.get("entries")
    }
    extra = shown - declared - {"--config", "--print-config"}
    assert declared <= shown, f"declared but not in --help: {declared - shown}"
    assert not extra, f"{name} --help lists options its dataclass does not declare: {extra}"


@pytest.mark.parametrize("name", sorted(ACTIONS_WITH_OPTIONS))
def test_jsonargparse_reads_each_actions_options(name):
    """The declaration is plain typed Python: LightningCLI's parser reads it too (its defaults are the fields')."""
    from jsonargparse import ArgumentParser

    cls = _options_class(ACTIONS_WITH_OPTIONS[name])
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, nested_key="options", fail_untyped=True)
    defaults: dict[str, Any] = vars(parser.get_defaults().options)
    for f in dataclasses.fields(cls):
        if f.init and f.default is not dataclasses.MISSING:
            assert defaults[f.name] == f.default, (name, f.name)
