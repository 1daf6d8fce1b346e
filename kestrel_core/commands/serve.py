"""kestrel serve: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over one model and one continuous batch."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
import signal
import sys
import threading
import time

from kestrel_core.config import model_dir
from kestrel_core.engine.pipeline import launched_rank
from kestrel_core.engine.batch import LEFT_OUT_CHUNK
from kestrel_core.engine.limits import check_max_seq
from kestrel_core.errors import ConfigError
from kestrel_core.commands.common import add_draft_flags, add_run_flags, check_batch_flags, config_from_args, with_draft

HELP = ("serve a model over HTTP with OpenAI's API (/v1/completions, /v1/chat/completions, /v1/models) and /health; "
        "loopback only unless an API key is set")

KEY_ENV = "KESTREL_API_KEY"


# What generate's flags mean here: the prompt comes from each request, and the generation flags are the defaults of
# a request that leaves a parameter out.
_RUN_FLAGS_HERE = {"--prompt": "refused: each request brings its prompt", "--prompt-ids": "refused: each request "
                   "brings its prompt", "--json": "refused: the server logs lines on stderr and answers JSON over HTTP",
                   "--max-new-tokens": "max_tokens where a request gives none (default: 16 for a completion; a chat "
                                       "reply runs to the end of its turn)",
                   "--temperature": "temperature where a request gives none (default 0: greedy)",
                   "--seed": "seed where a request gives none (default: a new one each request)",
                   "--top-k": "top_k where a request gives none (default 0: no cut)",
                   "--top-p": "top_p where a request gives none (default 1)",
                   "--ignore-eos": "generate max_tokens whatever end-of-sequence tokens come (a request may ask "
                                   "for it with ignore_eos)"}


MAX_BODY_MB = 2**20  # a request body of a tebibyte: past any a client sends


def add_arguments(p):
    add_run_flags(p)
    for action in p._actions:  # argparse has no public way to reword a flag another function added
        for flag in action.option_strings:
            if flag in _RUN_FLAGS_HERE:
                action.help = _RUN_FLAGS_HERE[flag]
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; any other than "
                   "loopback needs an API key or --allow-insecure)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free port)")
    p.add_argument("--served-model-name", help="the model's name in the API, and other names for it, comma-separated "
                   "(default: the model's own: a directory's base name, a .gguf file's name without .gguf; --model as "
                   "given, its full path and a file's whole name are accepted too)")
    p.add_argument("--api-key", help=f"require Authorization: Bearer KEY on /v1 (also {KEY_ENV}, which keeps it out of "
                   "the process list)")
    p.add_argument("--allowed-hosts", help="Host names the server answers besides loopback's, comma-separated ('*': "
                   "any); on loopback only loopback names are answered unless named here (DNS rebinding)")
    p.add_argument("--allowed-origins", help="browser origins given CORS headers, comma-separated ('*': any); "
                   "default none")
    p.add_argument("--allow-insecure", action="store_true",
                   help="serve a non-loopback --host without an API key (anyone who reaches the port may use it)")
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded together (default 8)")
    p.add_argument("--max-seq", type=int, help="the context: positions a sequence may use, prompt and generation "
                   "(default: the model's, at most 4096); each of the max-batch KV slots holds this many")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens a step takes beside the decoding sequences (default 512; 8192 for a MoE model "
                        "under an expert policy, whose chunks stream their experts)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait while every slot is taken (default 64); past it, 429")
    p.add_argument("--max-tokens-limit", type=int, default=4096, help="the largest max_tokens a request may ask for "
                   "(default 4096); a chat request without one generates up to this, within the context")
    p.add_argument("--max-body-mb", type=float, default=4.0, help="the largest request body in MiB (default 4); "
                   "past it, 413")
    add_draft_flags(p)
    p.add_argument("--shutdown-timeout", type=float, default=10.0, help="on SIGINT or SIGTERM, seconds the running "
                   "generations may go on before they are cut (default 10; a second signal cuts them at once)")


def run(args) -> int:
    settings = _checked(args)
    cfg = with_draft(config_from_args(args), args)
    name, aliases = served_names(args.served_model_name, model_dir(cfg))
    api_key = args.api_key if args.api_key is not None else os.environ.get(KEY_ENV) or None
    if api_key and (api_key != api_key.strip() or not api_key.isascii() or not api_key.isprintable()):
        where = "--api-key" if args.api_key is not None else KEY_ENV
        raise ConfigError(f"{where}: the API key must be printable ASCII with no space at either end (a client sends "
                          "it in an HTTP header, which could never match it); choose another key")

    # The heavy imports after the flags are checked: a wrong flag stays a quick one-line error.
    import uvicorn

    from kestrel_core.serve.app import create_app
    from kestrel_core.serve.origins import allowed_hosts, parse_list
    from kestrel_core.serve.server import Server, bind, check_bind, header_deadline, is_loopback, url_of
    from kestrel_core.serve.service import FAILED, READY, Limits, Service

    check_bind(args.host, api_key, args.allow_insecure)
    if args.api_key is not None and not args.api_key:
        raise ConfigError("--api-key is empty; give a key, or leave the flag out")
    # A chat reply without max_tokens runs to the end of its turn, unless --max-new-tokens or kestrel.toml set a length.
    chat_tokens = cfg.generation.max_new_tokens if cfg.was_given("generation", "max_new_tokens") else None
    # A seed the operator chose makes requests without one repeatable; else each draws its own, as OpenAI's do.
    seed = cfg.generation.seed if cfg.was_given("generation", "seed") else None
    log = _logger()
    service = Service(cfg, name, Limits(**settings), chat_tokens, seed, aliases)
    if launched_rank()[0] > 0:  # a pipeline's later rank: rank 0 serves, this one makes its steps after it
        service.follow()
        return 0
    service.check()  # a model it cannot serve is a one-line error before the address is announced
    hosts = allowed_hosts(parse_list(args.allowed_hosts, "--allowed-hosts"), is_loopback(args.host))
    app = create_app(service, api_key, int(args.max_body_mb * 2**20), hosts=hosts,
                     origins=parse_list(args.allowed_origins, "--allowed-origins"))
    sock = bind(args.host, args.port)
    url = url_of(sock)
    service.address = url
    log.info("listening on %s (the OpenAI API at %s/v1); loading %s", url, url, model_dir(cfg))
    log.info("API key: %s", "required (Authorization: Bearer KEY)" if api_key else "none (anyone who reaches the "
             "address may use it)" if args.allow_insecure else "none (loopback only)")

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", server_header=False,
                            http=header_deadline(),  # slow or absent request headers close their connection
                            timeout_graceful_shutdown=args.shutdown_timeout + 30)  # a backstop past the grace

    def stop(signum: int) -> None:
        log.info("%s: taking no new requests; %d running may go on for %g s, then are cut", signal.Signals(signum).name,
                 len(service.live), args.shutdown_timeout)
        service.begin_shutdown(args.shutdown_timeout)

    def force() -> None:
        log.info("cutting %d running generations now", len(service.live))
        service.cut_all()

    server = Server(config, stop, force)
    t0 = time.monotonic()

    def load() -> None:
        service.load()
        if service.state == FAILED:
            server.should_exit = True  # the error is told once the server has stopped
            return
        if service.state != READY:  # a signal came while it loaded
            return
        for line in service.describe():
            log.info("%s", line)
        log.info("ready in %.1f s: %s/v1", time.monotonic() - t0, url)

    loader = threading.Thread(target=load, name="kestrel-load", daemon=True)
    loader.start()
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        sock.close()
    if service.load_error is not None:
        raise service.load_error
    if loader.is_alive():
        # A signal came mid-load. The loading thread cannot be stopped, and the interpreter's exit would destroy the
        # C++ threads it runs on under it ("terminate called without an active exception", SIGABRT): end here.
        log.info("stopped (the model was still loading)")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    service.close()
    log.info("stopped")
    return 0


def served_names(given: str | None, model: str) -> tuple[str, frozenset[str]]:
    """The model's name in the API and the other names a request may give for it. By default its own: a directory's
    base name, a GGUF file's without its .gguf (its whole file name is accepted too), a Hugging Face name as given;
    ``--served-model-name a,b`` names it a, also b. The model as given to --model, and its full path, are accepted
    either way."""
    names = [n.strip() for n in given.split(",")] if given is not None else []
    if given is not None and not all(names):
        raise ConfigError(f"--served-model-name {given!r} holds an empty name; give the names clients send as model, "
                          "comma-separated, or leave the flag out (the name is then the model's own)")
    path = Path(model)
    own = model
    aliases = {model, *names[1:]}
    if path.exists():
        # The name of the path as given, its links not followed: a Hugging Face snapshot's file is a link to a blob
        # named by its hash. "." and ".." are the directories they stand for.
        where = Path(os.path.abspath(model))
        own = where.name or path.resolve().name
        if path.is_file() and where.suffix.lower() == ".gguf" and where.stem:
            own = where.stem
            aliases.add(where.name)
        aliases |= {str(where), str(path.resolve())}
    return (names[0] if names else own), frozenset(aliases)


def _checked(args) -> dict:
    """The batch's settings from the flags, each in range."""
    if args.prompt is not None or args.prompt_ids is not None:
        raise ConfigError("kestrel serve takes its prompts from requests; drop --prompt/--prompt-ids")
    if args.json:
        raise ConfigError("kestrel serve logs lines on stderr and answers in JSON over HTTP; drop --json")
    if args.served_model_name is not None:
        served_names(args.served_model_name, "")  # an empty name is refused before anything loads
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {args.port}")
    check_batch_flags(args.max_batch, args.prefill_chunk, left_out=LEFT_OUT_CHUNK)
    check_max_seq(args.max_seq)
    if args.max_queue < 0:
        raise ConfigError(f"--max-queue must be 0 or more, got {args.max_queue}")
    if args.max_tokens_limit < 1:
        raise ConfigError(f"--max-tokens-limit must be at least 1, got {args.max_tokens_limit}")
    if not (0 < args.max_body_mb <= MAX_BODY_MB):  # NaN fails too; past the bound, its bytes overflowed an int
        raise ConfigError(f"--max-body-mb must be a number above 0 and at most {MAX_BODY_MB:,} (1 TiB), got "
                          f"{args.max_body_mb}")
    if not args.shutdown_timeout >= 0:
        raise ConfigError(f"--shutdown-timeout must be 0 or more seconds, got {args.shutdown_timeout}")
    return {"max_batch": args.max_batch, "max_seq": args.max_seq, "prefill_chunk": args.prefill_chunk,
            "max_queue": args.max_queue, "max_tokens": args.max_tokens_limit}


def _logger() -> logging.Logger:
    """``kestrel serve: ...`` lines on stderr: the start, each request, the stop."""
    log = logging.getLogger("kestrel.serve")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("kestrel serve: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log
