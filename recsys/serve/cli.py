"""``recsys backend start|stop|status`` and ``recsys serve``: registered by ``recsys.cli.main`` in two lines.

The command line's own helpers (the ``--conf``/``--set`` arguments, reading the configuration once and
installing its object store) are handed in by ``recsys.cli.main``, their one home: the frontend never
imports the CLI.
"""
from __future__ import annotations

import argparse
import logging
import uuid
from functools import partial
from typing import TYPE_CHECKING, Callable

from recsys.errors import ConfigError, ExitCode
from recsys.redaction import redact_uri

if TYPE_CHECKING:
    from recsys.config import Config

log = logging.getLogger("recsys")


def add_commands(sub, add_config_args: Callable[[argparse.ArgumentParser], None],
                 load_config: Callable[[argparse.Namespace], "Config"]) -> None:
    """Register the commands; ``add_config_args`` and ``load_config`` are the CLI's (``recsys.cli.main``)."""
    p = sub.add_parser("backend", help="start, stop or inspect the warm Spark Connect backend of `recsys serve`")
    p.add_argument("action", choices=("start", "stop", "status"))
    p.add_argument("--properties-file", metavar="FILE",
                   help="Spark properties for the server (default: conf/spark-defaults.conf when present)")
    add_config_args(p)
    p.set_defaults(func=partial(cmd_backend, load_config=load_config))

    p = sub.add_parser("serve", help="the HTTP frontend: published lists (serve.store), on-demand recommendations "
                                     "and nightly jobs on the backend")
    p.add_argument("--remote", metavar="sc://HOST:PORT",
                   help="the Spark Connect backend (default: the one `recsys backend start` recorded)")
    p.add_argument("--port", type=int, help="HTTP port (default: serve.port)")
    p.add_argument("--host", help="HTTP address (default: serve.host, loopback)")
    add_config_args(p)
    p.set_defaults(func=partial(cmd_serve, load_config=load_config))


def cmd_backend(args: argparse.Namespace, load_config: Callable[[argparse.Namespace], "Config"]) -> int:
    from recsys.serve import backend

    cfg = load_config(args)
    if args.action == "start":
        state = backend.start(cfg, properties_file=args.properties_file)
        print(f"backend started: {state.remote} (pid {state.pid}, session {state.session_id}); logs in {state.log_dir}")
        return ExitCode.OK
    if args.action == "stop":
        state = backend.stop(cfg)
        print(f"backend stopped: {state.remote} (pid {state.pid})" if state else "no backend was running")
        return ExitCode.OK
    status = backend.status(cfg)
    print(status.describe())
    return ExitCode.OK if status.running and status.listening else ExitCode.UNEXPECTED_ERROR


def remote_url(remote: str, session_id: str) -> str:
    """``sc://host:port`` plus a fixed session id, so reconnects find the same warm workers."""
    if not remote.startswith("sc://"):
        raise ConfigError(f"--remote {remote!r} must look like sc://HOST:PORT")
    if "session_id=" in remote:
        return remote
    return remote.rstrip("/") + ("" if "/;" in remote else "/") + f";session_id={session_id}"


def cmd_serve(args: argparse.Namespace, load_config: Callable[[argparse.Namespace], "Config"]) -> int:
    import uvicorn

    from recsys.serve import backend
    from recsys.serve.app import create_app

    cfg = load_config(args)
    if args.remote:
        from recsys import redaction

        redaction.register(redaction.collect(args.remote, {}))   # a token in --remote is masked like the config's
        url = remote_url(args.remote, str(uuid.uuid4()))

        def url_provider() -> str:
            return url
    else:
        if backend.read_state(cfg.serve.backend_dir) is None:
            if cfg.serve.store == "none":
                raise ConfigError(f"no backend recorded under {cfg.serve.backend_dir} and serve.store is none: run "
                                  f"`recsys backend start`, pass --remote sc://HOST:PORT, or serve published lists "
                                  f"(serve.store: embedded or a Redis URL)")
            log.info("no on-demand backend recorded under %s: answering from the published lists (serve.store=%s); "
                     "a backend started later is found", cfg.serve.backend_dir, redact_uri(cfg.serve.store))

        def url_provider() -> str:   # re-read on every reconnect: a restarted backend may have a new port
            state = backend.read_state(cfg.serve.backend_dir)
            if state is None:
                raise backend.BackendError(f"no backend recorded under {cfg.serve.backend_dir}")
            return state.url

    from recsys.config import load_hooks

    app = create_app(cfg, url_provider, load_hooks())   # RECSYS_FAULT_INJECTION etc., read once here
    uvicorn.run(app, host=args.host or cfg.serve.host, port=args.port if args.port is not None else cfg.serve.port,
                log_level="info", access_log=False, timeout_graceful_shutdown=None)
    return ExitCode.OK
