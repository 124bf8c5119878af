"""Write docs/reference/cli.md from dpserve's argument parser.

    python tools/gen_cli_reference.py          # rewrite the page
    python tools/gen_cli_reference.py --check  # exit 1 if the page is stale

The page lists every subcommand of `dpserve`, and for each one every option in
the group its parser puts it in: its flags, its default and its help. Nothing
here names an option or a group: whatever the parser says is what the page
says, so a flag added to `dpserve/config.py` (an `EngineArgs` field) or to an
entry point shows up on the next run. tests/unit/test_docs_reference.py fails
when the committed page differs from what this script writes.

Not here: the parser itself (`dpserve/cli.py` builds it from the entry points'
`add_*_args` functions).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reference" / "cli.md"
REFRESH = "python tools/gen_cli_reference.py"

HEADER = f"""# Command line

<!-- Generated from dpserve's argument parser by tools/gen_cli_reference.py.
     Do not edit by hand: run `{REFRESH}`. -->

This page lists every option of every `dpserve` subcommand, grouped as
`dpserve SUBCOMMAND --help` groups them, with its default. It is generated from
the argument parser, so it matches the installed version.

Boolean engine options take a `--no-` form that turns them off. vLLM's short
flags (`-dp`, `-tp`, ...) are listed beside their long names.
"""


def build_parser() -> argparse.ArgumentParser:
    """The `dpserve` parser, built by the same functions `dpserve.cli.main` calls."""
    from dpserve import cli

    parser = argparse.ArgumentParser(prog="dpserve", description=cli.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    cli._generate_parser(sub)
    for entrypoint in cli._ENTRYPOINTS:
        cli._entrypoint_parser(sub, *entrypoint)
    cli._bench_parser(sub)
    return parser


def subcommands(parser: argparse.ArgumentParser, prefix: str = "dpserve"
                ) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """(command line, help, parser) of every leaf subcommand, in the parser's order."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help for choice in action._choices_actions}
        for name, child in action.choices.items():
            children = list(subcommands(child, f"{prefix} {name}"))
            if children:
                yield from children
            else:
                yield f"{prefix} {name}", helps.get(name) or "", child


def option_actions(parser: argparse.ArgumentParser
                   ) -> Iterator[tuple[str, str | None, list[argparse.Action]]]:
    """(title, description, actions) of each argument group that holds options."""
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if a.help is not argparse.SUPPRESS
                   and not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
        if actions:
            yield group.title or "options", group.description, actions


def escape(text: str) -> str:
    """Text as it reads inside a Markdown table cell."""
    for char in "\\|*<>[]":
        text = text.replace(char, "\\" + char)
    return " ".join(text.split())


def code(text: str) -> str:
    """`text` as inline code in a table cell (a backtick inside takes double ones)."""
    text = text.replace("|", "\\|")
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return code(action.metavar or action.dest)
    return ", ".join(code(flag) for flag in action.option_strings)


def default(action: argparse.Action) -> str:
    value = action.default
    if value is argparse.SUPPRESS:
        return ""
    if action.required:
        return "required"
    if isinstance(value, (list, tuple)):
        return code(" ".join(map(str, value))) if value else code("[]")
    if value == "":
        return code('""')
    return code(str(value))


def description(action: argparse.Action, prog: str) -> str:
    text = escape(argparse.HelpFormatter(prog)._expand_help(action)) if action.help else ""
    if action.choices is not None:
        choices = ", ".join(code(str(choice)) for choice in action.choices)
        text = f"{text} Choices: {choices}." if text else f"Choices: {choices}."
    if action.option_strings and action.nargs in ("+", "*"):
        text += " Takes several values."
    return text.strip()


def usage(command: str, parser: argparse.ArgumentParser) -> str:
    words = [command]
    for action in parser._actions:
        if not action.option_strings and not isinstance(action, argparse._SubParsersAction):
            name = action.metavar or action.dest
            words.append(f"[{name}]" if action.nargs in ("?", "*") else name)
    return " ".join([*words, "[options]"])


def section(command: str, help_text: str, parser: argparse.ArgumentParser) -> list[str]:
    lines = [f"## {command}", ""]
    if help_text:
        lines += [escape(help_text), ""]
    lines += ["```", usage(command, parser), "```", ""]
    for title, group_description, actions in option_actions(parser):
        lines += [f"### {title[:1].upper() + title[1:]}", ""]
        if group_description:
            lines += [escape(group_description), ""]
        lines += ["| Option | Default | Description |", "| --- | --- | --- |"]
        lines += [f"| {flags(a)} | {default(a)} | {description(a, parser.prog)} |"
                  for a in actions]
        lines.append("")
    return lines


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The whole page."""
    parser = parser or build_parser()
    lines = [HEADER]
    commands = list(subcommands(parser))
    lines += [f"* [`{command}`](#{anchor(command)}): {escape(help_text)}"
              for command, help_text, _ in commands]
    lines.append("")
    for command, help_text, child in commands:
        lines += section(command, help_text, child)
    return "\n".join(lines).rstrip() + "\n"


def anchor(heading: str) -> str:
    """The id Python-Markdown's toc extension gives a heading (its `slugify`)."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", heading).strip().lower())


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    args.add_argument("--check", action="store_true",
                      help="Exit 1, writing nothing, when the page is stale.")
    check = args.parse_args(argv).check
    page = render()
    if check:
        if not PAGE.exists() or PAGE.read_text() != page:
            print(f"{PAGE.relative_to(ROOT)} is stale: run `{REFRESH}`", file=sys.stderr)
            return 1
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # this tree's dpserve, not another installed one
    sys.exit(main())
