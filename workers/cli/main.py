"""The `streamer` command: `up`, `worker`, `gateway`, `generate`, `bench`, `dead`, `lora`, `top`.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`.
Modules are imported only when their command runs (the imports inside the `_load_*` functions), so
`streamer --help` is instant and one broken module does not take the others down. Every option can
also come from the environment as `STREAMER_<DEST>` (e.g. `--num-kv-blocks` ->
`STREAMER_NUM_KV_BLOCKS`); a flag on the command line wins over the environment. Mistakes a user
can fix are printed as one line, no traceback (see workers/errors.py; STREAMER_DEBUG=1 shows the
traceback anyway).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType

from workers.cli.parent import exit_with_parent
from workers.errors import UserError, friendly_message

ENV_PREFIX = "STREAMER_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _load_up() -> ModuleType:
    from workers.cli import up

    return up


def _load_worker() -> ModuleType:
    from workers.worker import command

    return command


def _load_gateway() -> ModuleType:
    from workers.gateway import command

    return command


def _load_generate() -> ModuleType:
    from workers.cli import generate_cmd

    return generate_cmd


def _load_bench() -> ModuleType:
    from workers.cli import bench_cmd

    return bench_cmd


def _load_dead() -> ModuleType:
    from workers.cli import dead_cmd

    return dead_cmd


def _load_lora() -> ModuleType:
    from workers.cli import lora_cmd

    return lora_cmd


def _load_top() -> ModuleType:
    from workers.cli import top_cmd

    return top_cmd


@dataclass(frozen=True)
class Command:
    load: Callable[[], ModuleType]  # imports the command's module: add_arguments(parser), run(args)
    summary: str


COMMANDS: dict[str, Command] = {
    "up": Command(_load_up, "run everything on this machine (Redis, a worker, the gateway) "
                            "and print the chat page URL"),
    "worker": Command(_load_worker, "serve jobs from the Redis stream with the engine"),
    "gateway": Command(_load_gateway, "WebSocket gateway and browser chat page in front of Redis"),
    "generate": Command(_load_generate, "send one prompt through Redis and stream the answer "
                                        "to the terminal"),
    "bench": Command(_load_bench, "run a benchmark script from bench/ (arguments pass through)"),
    "dead": Command(_load_dead, "list, show, requeue or purge dead letters (jobs no worker could serve)"),
    "lora": Command(_load_lora, "add, list or remove the LoRA adapters every worker serves (registered in Redis)"),
    "top": Command(_load_top, "live view of every worker (model, device, load, KV cache, tokens/s), the "
                              "request backlog, dead letters and slow steps, from Redis"),
}
# Commands whose --model, when not given, means the built-in default model.
_DEFAULT_MODEL_COMMANDS = {"worker"}


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("streamer")
    except Exception:  # not installed (running from a checkout)
        return "unknown"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the empty ones ("default: None" says nothing)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, [], "") or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamer",
        description="LLM inference server: paged KV cache, continuous batching, tokens streamed "
                    "over Redis and WebSockets. Start with `streamer up`.",
        epilog="Run `streamer COMMAND --help` for a command's options. Every option can also be "
               "set with an environment variable STREAMER_<OPTION> (shown in each --help).",
    )
    parser.add_argument("--version", action="version", version=f"streamer {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, cmd in COMMANDS.items():
        # Only names and summaries here: the options are added when the command is chosen.
        sub.add_parser(name, help=cmd.summary, add_help=False)
    return parser


def load_command(name: str) -> ModuleType:
    try:
        return COMMANDS[name].load()
    except ImportError as exc:
        raise UserError(f"`streamer {name}` is not available: {exc} (reinstall streamer: "
                        "`pip install -e .` in the source checkout)") from exc


def command_parser(name: str) -> argparse.ArgumentParser:
    """The full parser of one command, with environment defaults applied."""
    module = load_command(name)
    parser = argparse.ArgumentParser(prog=f"streamer {name}", description=COMMANDS[name].summary,
                                     formatter_class=_HelpFormatter)
    module.add_arguments(parser)
    if name in _DEFAULT_MODEL_COMMANDS:
        _default_model_option(parser)
    apply_env_defaults(parser)
    return parser


def _default_model_option(parser: argparse.ArgumentParser) -> None:
    for action in option_actions(parser):
        if action.dest == "model":
            action.required = False
            action.default = None
            action.help = ((action.help or "model checkpoint directory")
                           + " (default: the built-in SmolLM2-135M-Instruct)")


# --- environment variables -------------------------------------------------------------------

def option_actions(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """The parser's options that can take a value from the environment."""
    for action in parser._actions:  # argparse has no public accessor for its actions
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._HelpAction | argparse._VersionAction):
            continue
        yield action


def env_name(action: argparse.Action) -> str:
    return ENV_PREFIX + action.dest.upper()


def _is_bool(action: argparse.Action) -> bool:
    return isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction
                      | argparse.BooleanOptionalAction)


def _convert_one(action: argparse.Action, text: str) -> object:
    value = action.type(text) if callable(action.type) else text
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"must be one of {', '.join(map(str, action.choices))}")
    return value


def env_value(action: argparse.Action, text: str) -> object:
    """Convert an environment string the way argparse would convert the flag's argument."""
    name = env_name(action)
    try:
        if _is_bool(action):
            low = text.strip().lower()
            if low not in _TRUE | _FALSE:
                raise ValueError("use 1/0, true/false, yes/no or on/off")
            return low in _TRUE  # the variable holds the value of its dest, also for store_false
        if isinstance(action, argparse._CountAction):
            return int(text)
        if action.nargs not in (None, "?") or isinstance(action, argparse._AppendAction):
            return [_convert_one(action, part) for part in shlex.split(text)]
        return _convert_one(action, text)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
        raise UserError(f"environment variable {name}={text!r} is invalid for "
                        f"{'/'.join(action.option_strings)}: {exc}") from exc


def apply_env_defaults(parser: argparse.ArgumentParser, environ: dict[str, str] | None = None) -> None:
    """Use STREAMER_<DEST> as the default of each option; mention the variable in --help."""
    environ = os.environ if environ is None else environ
    for action in option_actions(parser):
        name = env_name(action)
        if action.help is not None and name not in action.help:
            action.help = f"{action.help} [env: {name}]"
        elif action.help is None:
            action.help = f"[env: {name}]"
        text = environ.get(name, "")
        if text != "":  # empty means unset: compose passes `${MODEL:-}` through as ""
            action.default = env_value(action, text)
            action.required = False


def env_table() -> str:
    """Markdown table of every environment variable, for the README's configuration section.

    One row per variable; where commands give it different meanings, each meaning is listed."""
    rows: dict[str, tuple[str, dict[str, str]]] = {}
    for name in COMMANDS:
        for action in option_actions(command_parser(name)):
            flag = next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])
            meaning = (action.help or "").split(" [env:")[0].replace("|", "\\|").replace("%%", "%")
            rows.setdefault(env_name(action), (flag, {}))[1][name] = meaning
    lines = ["| Variable | Flag | Command: meaning |", "|---|---|---|"]
    for env in sorted(rows):
        flag, meanings = rows[env]
        if len(set(meanings.values())) == 1:
            text = f"{', '.join(meanings)}: {next(iter(meanings.values()))}"
        else:
            text = "<br>".join(f"{cmd}: {m}" for cmd, m in meanings.items())
        lines.append(f"| `{env}` | `{flag}` | {text} |")
    return "\n".join(lines)


# --- running ----------------------------------------------------------------------------------

def _leaf_exceptions(exc: BaseException) -> Iterator[BaseException]:
    """The exceptions inside (nested) exception groups, as raised by anyio task groups."""
    inner = getattr(exc, "exceptions", None)
    if isinstance(inner, tuple | list) and isinstance(exc, BaseException) and hasattr(exc, "derive"):
        for e in inner:
            yield from _leaf_exceptions(e)
    else:
        yield exc


def explain(exc: BaseException, redis_url: str | None = None) -> str | None:
    """The one-line message for a user-fixable error, also when wrapped in an exception group."""
    for leaf in _leaf_exceptions(exc):
        msg = friendly_message(leaf, redis_url)
        if msg is not None:
            return msg
    return None


# Commands that talk to a running system: without --redis they use a running `streamer up`'s Redis.
_CLIENT_COMMANDS = ("generate", "top", "dead", "lora")


def _use_running_up(args: argparse.Namespace, argv: list[str]) -> None:
    """Where neither --redis nor STREAMER_REDIS says which Redis, a running `streamer up` (on a port
    of its own) is the one meant; say so, since the default would have been another."""
    def given(flag: str) -> bool:
        return any(a == flag or a.startswith(flag + "=") for a in argv) or bool(os.environ.get(env_name_of(flag)))

    from clients.errors import redact_url
    from workers.up_state import running_up

    up = None if given("--redis") else running_up()
    if up is None:
        return
    args.redis = up["redis"]
    if not given("--prefix") and isinstance(up.get("prefix"), str):
        args.prefix = up["prefix"]
    print(f"using the Redis of the running `streamer up` (pid {up['pid']}): {redact_url(args.redis)}",
          file=sys.stderr)


def env_name_of(flag: str) -> str:
    """The environment variable of a long option (`--redis` -> STREAMER_REDIS)."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def _fail(prog: str, msg: str) -> int:
    print(f"{prog}: error: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    top = top_parser()
    if not argv or argv[0].startswith("-") or argv[0] not in COMMANDS:
        args = top.parse_args(argv)  # --help, --version, or a usage error; all exit here
        top.print_help()
        return 2
    name = argv[0]
    prog = f"streamer {name}"
    exit_with_parent()
    args = None
    try:
        parser = command_parser(name)
        args = parser.parse_args(argv[1:])
        if name in _CLIENT_COMMANDS:
            _use_running_up(args, argv[1:])
        if name in _DEFAULT_MODEL_COMMANDS:
            from workers.default_model import resolve_model

            args.model = str(resolve_model(args.model))
        return int(load_command(name).run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        msg = explain(exc, getattr(args, "redis", None))
        if msg is None or os.environ.get(ENV_PREFIX + "DEBUG"):
            raise
        return _fail(prog, msg)


if __name__ == "__main__":
    sys.exit(main())
