"""kestrel chat: a conversation with a model, one message a line on stdin, each reply streamed as it is generated."""

from __future__ import annotations

import json
import sys
import warnings

import attrs

from kestrel_core.io import progress

from kestrel_core.formats import template_limits
from kestrel_core.formats.chat_template import RESERVED, ChatTemplate, end_ids
from kestrel_core.config import model_dir
from kestrel_core.errors import ConfigError, KestrelNote
from kestrel_core.engine.run import load
from kestrel_core.engine.results import GenerationResult
from kestrel_core.formats.tokenizer import check_utf8
from kestrel_core.io.jsonout import finite
from kestrel_core.commands.common import add_run_flags, config_from_args
from kestrel_core.engine.limits import check_max_seq

HELP = "chat with a model: one message a line on stdin (until EOF or /exit), each reply streamed as it is generated"

EXIT, RESET = ("/exit", "/quit"), "/reset"
MAX_LINE = template_limits.CHARS  # a message longer than any prompt may be is not read whole
REPLY_TOKENS = 512  # a reply's cap where neither --max-new-tokens nor kestrel.toml sets one (generate's 16 is short)


def add_arguments(p):
    add_run_flags(p)
    p.add_argument("--system", help="a system message that opens the conversation")
    p.add_argument("--max-seq", type=int, help="the context: positions the conversation may use, its replies "
                   "included, at least 2 and at most the model's (default: the model's); past it a message is refused "
                   "with the way to start over")
    p.add_argument("--template-var", action="append", default=[], metavar="NAME=VALUE",
                   help="a variable for the chat template, VALUE as JSON where it parses (e.g. enable_thinking=false "
                        "for Qwen3); repeatable")


def run(args) -> int:
    if args.prompt is not None or args.prompt_ids is not None:
        raise ConfigError("kestrel chat reads its messages from stdin, one a line; drop --prompt/--prompt-ids "
                          "(use --system for a system message, or kestrel generate for one prompt)")
    if sys.stdin is None:  # started with stdin closed (`<&-`): Python gives None, not a stream
        raise ConfigError("standard input is closed, and kestrel chat reads its messages from it: type them, or pipe "
                          "them in, one a line")
    variables = template_vars(args.template_var)
    check_max_seq(args.max_seq)  # before the model loads
    cfg = config_from_args(args)
    if not cfg.was_given("generation", "max_new_tokens"):  # kestrel.toml's 16, given, is taken
        cfg = cfg.override(generation__max_new_tokens=REPLY_TOKENS)
    with progress.shown(not args.json), load(model_dir(cfg)) as model:
        if model.tokenizer is None:
            raise ConfigError(f"{model.no_tokenizer()}, and chat turns text into ids through it: a model "
                              "without a tokenizer cannot chat; use `kestrel generate --prompt-ids 1,2,3`")
        template = model.chat_template()
        ends = end_ids(model, template)
        check_max_seq(args.max_seq, model.config.max_position_embeddings, str(model.dir))
        with model.open(cfg) as r:
            if r.follows:  # a pipeline's later rank: rank 0 reads the messages and answers, this one makes its steps
                r.follow()
                return 0
            chat = Chat(r, template, ends, variables, args.system, positions=args.max_seq)
            prompt = "> " if sys.stdin.isatty() and not args.json else ""
            if prompt:
                import readline  # noqa: F401  (line editing and history for input())
            progress.say(f"kestrel chat: {model.dir}; one message a line, {RESET} starts over, {EXIT[0]} or Ctrl-D leaves")
            while (line := read_line(prompt)) is not None:
                message = line.strip()
                if not message:
                    continue
                if message in EXIT:
                    break
                if message == RESET:
                    chat.reset()
                    continue
                if args.json:
                    reply = chat.reply(message)
                    print(json.dumps(finite(reply.record()), allow_nan=False), flush=True)
                else:
                    reply = chat.reply(message, write)
                    write("\n")
                progress.say(f"[{len(reply.ids)} tokens, {reply.result.ms_per_token:.1f} ms/token]")
    if chat.cut:
        warnings.warn(f"{chat.cut} of {chat.replies} replies stopped at the {cfg.generation.max_new_tokens}-token cap "
                      "(or the model's last position) before the model ended its turn; raise --max-new-tokens "
                      "for longer replies", KestrelNote)
    return 0


@attrs.frozen
class Reply:
    result: GenerationResult
    ids: list[int]  # as generated, the end-of-turn id included
    text: str  # the reply as it joins the conversation: the end-of-turn token's text left out
    ended: bool  # whether the model ended its turn (else the token cap cut it)
    prompt_tokens: int  # the conversation so far, rendered

    def record(self) -> dict:
        return {"reply": self.text, "token_ids": self.ids, "ended": self.ended, "prompt_tokens": self.prompt_tokens,
                "ms_per_token": round(self.result.ms_per_token, 3), "prefill_ms": round(self.result.prefill_ms, 3)}


class Chat:
    """The conversation on one open run: each reply is generated from the whole conversation, rendered again."""

    def __init__(self, run, template: ChatTemplate, ends: frozenset[int], variables: dict | None = None,
                 system: str | None = None, positions: int | None = None):
        self.run, self.template, self.ends = run, template, ends
        # the conversation's context: the model's positions, or fewer (--max-seq)
        self.positions = positions or run.model.config.max_position_embeddings
        self.whose = "the model's" if positions is None else "--max-seq's"
        self.variables = dict(variables or {})
        self.system = system
        self.tokenizer = run.model.tokenizer
        self.replies = self.cut = 0
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def _too_long(self, message: str, positions: int) -> ConfigError:
        """Why a prompt leaves no room for a reply: the message alone (and how long it may be), or the conversation."""
        start = [{"role": "system", "content": self.system}] if self.system else []
        frame = self.template.render(start + [{"role": "user", "content": ""}], add_generation_prompt=True,
                                     **self.variables)
        own = self.tokenizer.encode_at_most(frame, positions - 2)  # a fresh chat: the template's (and system's) tokens
        if own is None:
            what = "the chat template and the system message alone take" if self.system else "the chat template alone takes"
            return ConfigError(f"{what} more than {self.whose} {positions:,} positions, leaving no room for "
                               f"a message; {'shorten --system, or ' if self.system else ''}replace the template "
                               "with the model's own")
        most = positions - 1 - len(own)  # and one position for the reply
        counted = 4 * positions  # an exact count up to here, at a bounded cost
        alone = self.tokenizer.encode_at_most(message, counted)
        if alone is None or len(alone) > most:
            size = f"over {counted:,}" if alone is None else f"{len(alone):,}"
            return ConfigError(f"this message alone is {size} tokens, and {self.whose} {positions:,} positions leave at "
                               f"most {most:,} for one message (the chat template takes the rest, and the reply "
                               "needs one); send a shorter message")
        has = f"the model has {positions:,}" if self.whose == "the model's" else f"--max-seq gives {positions:,}"
        return ConfigError(f"the conversation is over {positions - 1:,} tokens, and {has} "
                           f"positions: no room for a reply; start a new chat ({RESET} starts over in one)")

    def reply(self, message: str, write=None) -> Reply:
        """The model's reply to ``message``, its text given to ``write`` as it grows; both join the conversation."""
        check_utf8(message)  # here, so that the error counts characters in the message, not in the rendered prompt
        gen = self.run.config.generation
        positions = self.positions
        if self.tokenizer.encode_at_most(message, positions) is None:  # before rendering: it cannot fit at all
            raise self._too_long(message, positions)
        messages = self.messages + [{"role": "user", "content": message}]
        text = self.template.render(messages, add_generation_prompt=True, **self.variables)
        if not text.strip():
            raise ConfigError(f"{self.template.where}: the chat template rendered the conversation as nothing, so there "
                              "is no prompt to reply to; fix the template (it must lay out the messages) or take the "
                              "model's own")
        prompt = self.tokenizer.encode_at_most(text, positions - 1)  # None: no room left for one reply token
        if prompt is None:
            raise self._too_long(message, positions)
        room = positions - len(prompt)
        stream = self.tokenizer.stream()
        ids: list[int] = []

        def hear(token: int) -> None:
            ids.append(token)
            if gen.stop_at_eos and token in self.ends:
                return  # the end of the turn is not part of the reply; the loop stops on it
            piece = stream.push(token)
            if write and piece:
                write(piece)

        result = self.run.generate(prompt_ids=prompt, on_token=hear, stop_ids=self.ends,
                                   max_new_tokens=min(gen.max_new_tokens, room))
        rest = stream.finish()
        if write and rest:
            write(rest)
        ended = gen.stop_at_eos and bool(ids) and ids[-1] in self.ends
        text = stream.text
        self.messages = messages + [{"role": "assistant", "content": text}]
        self.replies += 1
        self.cut += gen.stop_at_eos and not ended
        return Reply(result, ids, text, bool(ended), len(prompt))


def template_vars(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq or not name.strip().isidentifier():
            raise ConfigError(f"--template-var must be NAME=VALUE, got {pair!r}; e.g. --template-var enable_thinking=false")
        if name.strip() in out:  # the first would be silently replaced
            raise ConfigError(f"--template-var {name.strip()} is given twice; give it once")
        if name.strip() in RESERVED:
            raise ConfigError(f"--template-var {name.strip()} is what kestrel chat passes the template itself "
                              f"({', '.join(RESERVED)} are reserved); pick another name")
        try:
            out[name.strip()] = json.loads(value)
        except ValueError:  # not JSON (or an integer past Python's 4300 digits)
            out[name.strip()] = value  # a plain string
        except RecursionError:
            raise ConfigError(f"--template-var {name.strip()}: the JSON value is nested too deeply") from None
    return out


def read_line(prompt: str) -> str | None:
    """A line of stdin without its newline, or None at its end; a piped line is read only up to ``MAX_LINE``."""
    try:
        if sys.stdin.isatty():
            return input(prompt)  # a person types it, with line editing
        line = sys.stdin.readline(MAX_LINE + 1)
        if not line:
            return None
        if len(line) > MAX_LINE:
            raise ConfigError(f"a message on stdin is over {MAX_LINE:,} characters, more than any model's context; "
                              "send a shorter message")
        return line[:-1] if line.endswith("\n") else line
    except EOFError:
        return None
    except UnicodeDecodeError as exc:  # a strict UTF-8 stdin; under surrogateescape the tokenizer refuses instead
        raise ConfigError(f"a message on stdin is not valid UTF-8 (byte 0x{exc.object[exc.start]:02x}); send UTF-8 "
                          "text, e.g. convert it with iconv -f latin1 -t utf-8") from None


def write(text: str) -> None:
    print(text, end="", flush=True)
