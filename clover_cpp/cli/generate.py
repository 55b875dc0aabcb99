"""The generating commands: `clover run` (a prompt), `clover chat` (a conversation on stdin) and
`clover perplexity` (the causal model's perplexity over a text, as llama-perplexity)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import click

from .group import CONTEXT_SETTINGS, UserError, cli
from .live import generate_to_terminal
from .options import (chain_options, chat_template_options, check_flags, constraint_kwargs, constraint_options,
                      coreset_option, expert_stats_option, flag_errors, gen_kwargs, model_option, open_model,
                      runtime_options, sampling_options, until_context_end, use_visual, visual_option)

CHAT_SEPARATOR = "----"

# common's escape processing (string_process_escapes): \n \r \t \' \" \\ and \xHH
_ESCAPE = re.compile(rb"\\(?:([nrt'\"\\])|x([0-9A-Fa-f]{2}))")
_ESCAPED = {b"n": b"\n", b"r": b"\r", b"t": b"\t"}


def _unescape(m: re.Match[bytes]) -> bytes:
    if m.group(1) is not None:
        return _ESCAPED.get(m.group(1), m.group(1))
    return bytes([int(m.group(2), 16)])


def _read_llama_text_file(path: Path, escape: bool) -> bytes:
    """A text file as llama.cpp's tools read -f: the bytes less one trailing newline, escape
    sequences processed unless --no-escape (so that the same file gives the same tokens)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot read the text ({e.strerror or e})") from None
    if data.endswith(b"\n"):
        data = data[:-1]
    return _ESCAPE.sub(_unescape, data) if escape else data


def _read_prompt(prompt: str | None, file: str | None) -> str:
    if prompt is not None and file is not None:
        raise UserError("give either -p/--prompt or -f/--file, not both")
    if file is not None:
        try:
            return Path(file).read_text(encoding="utf-8")
        except OSError as e:
            raise UserError(f"{file}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise UserError(f"{file}: not UTF-8 text") from None
    if prompt is None:
        raise UserError("missing prompt: give -p/--prompt TEXT or -f/--file FILE")
    if prompt == "-":
        return sys.stdin.read()
    return prompt


@cli.command(context_settings=CONTEXT_SETTINGS)
@model_option
@click.option("-p", "--prompt", default=None, help="Prompt text ('-' = read stdin).")
@click.option("-f", "--file", default=None, metavar="FILE", help="Read the prompt from FILE.")
@sampling_options
@coreset_option
@expert_stats_option
@runtime_options
@visual_option
@click.option("--echo/--no-echo", default=True, show_default=True,
              help="Print the prompt before the output, as llama-cli does.")
@click.option("--no-display-prompt", "no_display_prompt", is_flag=True, hidden=True,
              help="llama-cli's name for --no-echo.")
@click.option("--stats/--no-stats", default=True, show_default=True, help="Statistics line on stderr.")
@constraint_options
@chain_options
@chat_template_options
def run(model: str, prompt: str | None, file: str | None, n_predict: int, block_size: Any,
        threshold: float, max_steps: int, temperature: float, top_k: int, top_p: float, seed: int, draft_self: str,
        ignore_eos: bool, reverse_prompt: tuple[str, ...], coreset: Any, expert_stats: bool, threads: int | None,
        ctx_size: int, n_gpu_layers: int, flash_attn: str, rpc: str | None, tensor_split: list[float] | None,
        override_tensor: str | None, verbose: bool, visual: bool | None, echo: bool, no_display_prompt: bool, stats: bool,
        grammar: str | None = None, grammar_file: str | None = None, json_schema: str | None = None,
        json_schema_file: str | None = None, json_object: bool = False, chain: dict | None = None,
        chat_template: str | None = None) -> None:
    """Generate text from a prompt with block-diffusion decoding (the prompt is echoed first,
    as llama-cli does; --no-echo leaves it out). With --chat-template or --chat-template-file,
    the prompt is one user message rendered with that template (llama-cli's single turn)."""
    text = _read_prompt(prompt, file)
    kw = gen_kwargs(n_predict, block_size, threshold, max_steps, temperature, top_k, top_p, seed, ignore_eos,
                    reverse_prompt, draft_self, coreset)
    kw.update(constraint_kwargs(grammar, grammar_file, json_schema, json_schema_file, json_object))
    kw.update(chain)
    check_flags(kw)
    visual = use_visual(visual)
    turn = [{"role": "user", "content": text}] if chat_template is not None else None
    with flag_errors(), open_model(model, threads, ctx_size, n_gpu_layers, block_size, verbose, flash_attn, rpc,
                                   tensor_split, override_tensor, chat_template, expert_stats) as m:
        if n_predict == -1:
            n_prompt = len(m.tokenize(m.format_chat(turn) if turn else text, add_bos=True, special=True))
            kw["max_tokens"] = until_context_end(m, n_prompt, block_size, draft_self)
        r = generate_to_terminal(m, None if turn else text, visual, chat_messages=turn,
                                 prefix=text if echo and not no_display_prompt else "", **kw)
        sys.stdout.write("\n")
        sys.stdout.flush()
        if stats:
            click.echo(r.stats.format(), err=True)


@cli.command(context_settings=CONTEXT_SETTINGS)
@model_option
@click.argument("file", metavar="TEXT_FILE", required=False)
@click.option("-f", "--file", "file_opt", default=None, metavar="TEXT_FILE", help="The text (as llama-perplexity's -f).")
@click.option("-c", "--ctx-size", "chunk", type=int, default=512, show_default=True,
              help="Tokens per chunk (as llama-perplexity's -c): each chunk is scored on its second half.")
@click.option("--chunks", "n_chunks", type=int, default=-1, show_default=True,
              help="At most this many chunks (as llama-perplexity's --chunks; -1 = all).")
@click.option("-t", "--threads", "threads", type=click.IntRange(1, 512), default=None,
              help="CPU threads (default: from the hardware).")
@click.option("-ngl", "--n-gpu-layers", "n_gpu_layers", type=click.IntRange(min=-1), default=0, show_default=True,
              help="Layers to offload to the GPU (-1 = all).")
@click.option("--escape/--no-escape", "-e", "escape", default=True, show_default=True,
              help="Process escape sequences (\\n, \\t, ...) in the text, as llama-perplexity does by default.")
@click.option("--verbose", is_flag=True, help="Show llama.cpp's log.")
def perplexity(model: str, file: str | None, file_opt: str | None, chunk: int, n_chunks: int, escape: bool,
               threads: int | None, n_gpu_layers: int, verbose: bool) -> None:
    """Perplexity of the causal model over a text file, computed and printed as llama-perplexity does:
    the file read as its -f reads it (one trailing newline dropped, escapes processed) and tokenized
    as plain text (special-token text such as <|im_end|> is not parsed)."""
    if (file is None) == (file_opt is None):
        raise UserError("give the text file once, as TEXT_FILE or with -f")
    text = _read_llama_text_file(Path(file or file_opt), escape)
    with open_model(model, threads, chunk, n_gpu_layers, 1, verbose) as m:
        r = m.perplexity(text, n_ctx=chunk, n_chunks=None if n_chunks == -1 else n_chunks)
    click.echo(f"Final estimate: PPL = {r.ppl:.4f} +/- {r.uncertainty:.5f} ({r.n_chunks} chunks of {r.n_ctx} "
               f"tokens, {r.n_tokens} positions scored)")


@cli.command(context_settings=CONTEXT_SETTINGS)
@model_option
@click.option("--system", default=None, help="System message.")
@sampling_options
@coreset_option
@runtime_options
@visual_option
@click.option("--stats/--no-stats", default=False, show_default=True, help="Statistics line after each reply.")
@click.option("--separator", default=CHAT_SEPARATOR, show_default=True, metavar="TEXT",
              help="Line written between replies when stdout is not a terminal ('' = none).")
@constraint_options
@chain_options
@chat_template_options
def chat(model: str, system: str | None, n_predict: int, block_size: Any, threshold: float,
         max_steps: int, temperature: float, top_k: int, top_p: float, seed: int, draft_self: str, ignore_eos: bool,
         reverse_prompt: tuple[str, ...], coreset: Any, threads: int | None, ctx_size: int, n_gpu_layers: int,
         flash_attn: str,
         rpc: str | None, tensor_split: list[float] | None, override_tensor: str | None,
         verbose: bool, visual: bool | None, stats: bool, separator: str, grammar: str | None = None,
         grammar_file: str | None = None, json_schema: str | None = None, json_schema_file: str | None = None,
         json_object: bool = False, chain: dict | None = None, chat_template: str | None = None) -> None:
    """Interactive chat: one user message per line; /exit, /quit or end of input to leave,
    /reset to forget the conversation. Earlier turns stay in the context's memory and are
    not read again (prefix reuse). When stdout is not a terminal, a separator line is written
    between replies."""
    kw = gen_kwargs(n_predict, block_size, threshold, max_steps, temperature, top_k, top_p, seed, ignore_eos,
                    reverse_prompt, draft_self, coreset)
    kw.update(constraint_kwargs(grammar, grammar_file, json_schema, json_schema_file, json_object))
    kw.update(chain)
    check_flags(kw)
    interactive = sys.stdin.isatty()
    visual = use_visual(visual)
    separate = bool(separator) and not sys.stdout.isatty()
    n_replies = 0
    base: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    with flag_errors(), open_model(model, threads, ctx_size, n_gpu_layers, block_size, verbose, flash_attn, rpc,
                                   tensor_split, override_tensor, chat_template) as m:
        m.format_chat([{"role": "user", "content": "x"}])  # template problems show up now, not later
        history: list[dict[str, str]] = []
        if interactive:
            click.echo("clover chat - /exit to quit, /reset to start over", err=True)
        while True:
            if interactive:
                sys.stdout.write("> ")
                sys.stdout.flush()
            line = sys.stdin.readline()
            if not line:
                break
            line = line.rstrip("\n")
            if line.strip() in ("/exit", "/quit"):
                break
            if line.strip() == "/reset":
                history = []
                continue
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            try:
                msgs, budget = _fit_history(m, base, history, n_predict, block_size, draft_self)
            except UserError as e:  # this message does not fit: say so, keep the session and its history
                history.pop()
                click.echo(f"error: {e.format_message()}", err=True)
                continue
            if separate and n_replies:
                sys.stdout.write(separator + "\n")
            r = generate_to_terminal(m, None, visual, chat_messages=msgs, **dict(kw, max_tokens=budget))
            sys.stdout.write("\n")
            sys.stdout.flush()
            n_replies += 1
            history.append({"role": "assistant", "content": r.text})
            if stats:
                click.echo(r.stats.format(), err=True)


def _fit_history(m: Any, base: list[dict[str, str]], history: list[dict[str, str]],
                 max_tokens: int, block_size: Any, draft_self: str) -> tuple[list[dict[str, str]], int]:
    """Drop the oldest turns until the prompt plus the budget fits the context (Clover.fits:
    decode blocks of B start right after the prompt, so the budget counts in whole blocks).
    max_tokens -1: at least one block must fit, and the budget is the rest of the context.
    Returns the messages and the token budget."""
    while True:
        msgs = base + history
        n = len(m.tokenize(m.format_chat(msgs), add_bos=True, special=True))
        if max_tokens == -1:
            ok = m.room(n, block_size, draft_self) >= 1
        else:
            ok = m.fits(n, max_tokens, block_size, draft_self)
        if ok or len(history) <= 1:
            if not ok:
                raise UserError(f"the message ({n} tokens) and -n {max_tokens} do not fit the context "
                                f"({m.n_ctx()}); raise -c or lower -n")
            return msgs, (until_context_end(m, n, block_size, draft_self) if max_tokens == -1 else max_tokens)
        del history[:2]
