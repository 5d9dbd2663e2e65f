"""The ``kvstore`` command line: look after a cache root like git, restic or pip would.

Every command takes ``--root`` (default ``$KVSTORE_ROOT``, else the user cache
dir); only ``init`` (and ``demo``/``serve``, which need somewhere to write) may
create one. Reporting commands print aligned human output, or with ``--json``
one JSON object whose schema is documented in ``docs/CLI.md``. A user mistake
prints one ``kvstore: error: …`` line and exits 2; a check that finds a problem
exits 1. Heavy modules (mlx, the store) are imported inside the commands.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence

import click

from ._util import REMOTE_COMMANDS, Options, UserError, oserror_line, with_remote
from .commands_files import export, import_, inspect_
from .commands_maintenance import compact, init, rm, stats, verify
from .commands_remote import pull, push, remote_group
from .commands_runners import BENCH_CONFIGS, bench, demo, model_group, serve
from .commands_view import ls_, show, tree

__all__ = ["BENCH_CONFIGS", "cli", "main"]

# --- the group -------------------------------------------------------------------------


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
             invoke_without_command=True)
@click.version_option(package_name="kvstore", prog_name="kvstore", message="%(prog)s %(version)s")
@with_remote
@click.pass_context
def cli(ctx: click.Context) -> None:
    """A persistent, shared, deduplicated KV-cache store for MLX language models.

    Start with 'kvstore demo' (in a root of its own: it says where), then 'kvstore ls'
    and 'kvstore tree'. The cache root is --root, else $KVSTORE_ROOT,
    else the user cache dir.
    """
    if ctx.invoked_subcommand is None:  # a bare `kvstore`: the help, like git and pip
        click.echo(ctx.get_help())
    elif ctx.ensure_object(Options).remote and ctx.invoked_subcommand not in REMOTE_COMMANDS:
        raise click.UsageError(  # it would do nothing there: refused, not ignored
            f"--remote goes with {', '.join(REMOTE_COMMANDS[:-1])} or {REMOTE_COMMANDS[-1]}; "
            f"'kvstore {ctx.invoked_subcommand}' does not use the remote tier")


for _command in (init, stats, ls_, show, tree, rm, compact, verify, import_, export, inspect_,
                 bench, demo, model_group, serve, push, pull, remote_group):
    cli.add_command(_command)


# --- entry point ----------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 a check failed, 2 an error)."""
    from ..errors import KVStoreError, NotAStoreError

    state = Options()
    try:
        rv = cli.main(args=list(argv) if argv is not None else None, prog_name="kvstore",
                      standalone_mode=False, obj=state)
    except click.UsageError as e:
        where = e.ctx.command_path if e.ctx is not None else "kvstore"
        click.echo(f"kvstore: error: {e.format_message()} (see '{where} --help')", err=True)
        return 2
    except click.ClickException as e:
        click.echo(f"kvstore: error: {e.format_message()}", err=True)
        return e.exit_code
    except click.Abort as e:  # click turns Ctrl-C into Abort (a declined prompt too)
        ctrl_c = isinstance(e.__cause__ or e.__context__, KeyboardInterrupt)
        click.echo("kvstore: interrupted" if ctrl_c else "kvstore: aborted", err=True)
        return 130
    except BrokenPipeError:  # `kvstore ls | head`: the reader left, nothing to report
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except (KVStoreError, UserError, OSError) as e:
        if state.debug:
            traceback.print_exc()
        line = oserror_line(e) if isinstance(e, OSError) and not isinstance(e, KVStoreError) \
            else str(e)
        if isinstance(e, NotAStoreError) and e.command:  # the hint, with the --root given
            line = f"{e.message}; run '{state.command(e.command)}'"
        click.echo(f"kvstore: error: {line}", err=True)
        return 2
    except KeyboardInterrupt:
        click.echo("kvstore: interrupted", err=True)
        return 130
    return rv if isinstance(rv, int) else 0
