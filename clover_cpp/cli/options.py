"""Options shared by the commands (llama.cpp's flag names: -m, -p, -n, -t, -c, --temp, --top-k,
--top-p, --seed), the block-size type, and the steps every generating command takes with them:
open the model, turn the flags into Clover.generate's arguments, the budget of -n -1."""

from __future__ import annotations

import contextlib
import functools
import json
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import click

from .group import UserError


def model_option(f: Any) -> Any:
    return click.option("-m", "--model", "model", required=True, metavar="FILE", help="Clover GGUF file.")(f)


def runtime_options(f: Any) -> Any:
    opts = [
        click.option("-t", "--threads", "threads", type=click.IntRange(1, 512), default=None,
                     help="CPU threads (default: from the hardware)."),
        click.option("-c", "--ctx-size", "ctx_size", type=click.IntRange(min=0), default=4096, show_default=True,
                     help="Context size (prompt + generation) in tokens; 0 = the model's training context."),
        click.option("-ngl", "--n-gpu-layers", "n_gpu_layers", type=click.IntRange(min=-1), default=0,
                     show_default=True, help="Layers to offload to the GPU (-1 = all)."),
        click.option("-fa", "--flash-attn", "flash_attn", type=click.Choice(["on", "off", "auto"]), default="auto",
                     show_default=True, help="Flash attention (as llama.cpp's -fa)."),
        click.option("--rpc", "rpc", default=None, metavar="HOST:PORT,...",
                     help="llama.cpp RPC servers (ggml-rpc-server) that hold the offloaded layers (-ngl)."),
        click.option("-ts", "--tensor-split", "tensor_split", default=None, metavar="N0,N1,...",
                     callback=lambda ctx, p, v: _parse_split(v),
                     help="Share of the offloaded layers per device, RPC servers first (as llama.cpp's -ts)."),
        click.option("-ot", "--override-tensor", "override_tensor", default=None, metavar="PATTERN=BUFFER,...",
                     help="Put tensors matching PATTERN in BUFFER (as llama.cpp's -ot), e.g. '^output\\.weight=CPU'."),
        click.option("--verbose", is_flag=True, help="Show llama.cpp's log."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _parse_split(value: str | None) -> list[float] | None:
    if value is None:
        return None
    try:
        split = [float(x) for x in re.split(r"[,/]", value)]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a list of numbers like 3,1", param_hint="'-ts'") from None
    if any(not (x >= 0) or x == float("inf") for x in split):
        raise click.BadParameter(f"{value!r}: shares must be finite and >= 0", param_hint="'-ts'")
    return split


class BlockSizeType(click.ParamType):
    """A block size: an integer, or "auto" (chosen per block, see clover.h); its range is Clover's."""
    name = "N|auto"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if isinstance(value, int) or value == "auto":
            return value
        try:
            return int(value)
        except ValueError:
            self.fail(f"{value!r} is not an integer >= 1 or 'auto'", param, ctx)


BLOCK_SIZE = BlockSizeType()


class CoresetType(click.ParamType):
    """A block expert coreset: an integer (0 = off), "off", "auto" or "model"; its range is libclover's."""
    name = "N|off|auto|model"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if value is None or isinstance(value, int) or value in ("model", "auto"):
            return value
        if value == "off":
            return 0
        try:
            return int(value)
        except ValueError:
            self.fail(f"{value!r} is not an integer >= 0, 'off', 'auto' or 'model'", param, ctx)


CORESET = CoresetType()


def coreset_option(f: Any) -> Any:
    return click.option("--coreset", "coreset", type=CORESET, default="model", show_default=True,
                        help="Block expert coreset C: each MoE layer of a block pass routes among the C experts "
                             "the block's tokens weigh most (fewer expert bytes read per pass); 0 or off = every "
                             "expert; auto = 3 x the experts per token when below the expert count (a pass "
                             "reads at most 3x a B = 1 step's expert bytes); model = the GGUF's "
                             "clover.expert_coreset (off when absent). Draft-self's output does not depend on it.")(f)


def expert_stats_option(f: Any) -> Any:
    return click.option("--expert-stats", "expert_stats", is_flag=True, default=False,
                        help="Count the distinct routed experts of each block pass and the expert bytes they "
                             "are (the stats line). Costs a synchronisation per MoE layer of a pass: not for "
                             "timing.")(f)


def constraint_options(f: Any) -> Any:
    """llama-cli's output constraints: a GBNF grammar or a JSON schema (one of them)."""
    note = " Decoded at block size 1, or verified by --draft-self."
    for option in reversed([
        click.option("--grammar", "grammar", default=None, metavar="GBNF",
                     help="Constrain the output to this GBNF grammar (llama.cpp's format)." + note),
        click.option("--grammar-file", "grammar_file", default=None, metavar="FILE",
                     help="Constrain the output to the GBNF grammar in FILE." + note),
        click.option("-j", "--json-schema", "json_schema", default=None, metavar="SCHEMA",
                     help="Constrain the output to this JSON schema, as llama.cpp converts it; a keyword it cannot "
                          "enforce is refused." + note),
        click.option("-jf", "--json-schema-file", "json_schema_file", default=None, metavar="FILE",
                     help="Constrain the output to the JSON schema in FILE." + note),
        click.option("--json", "json_object", is_flag=True, help="Constrain the output to a JSON object." + note),
    ]):
        f = option(f)
    return f


def chat_template_options(f: Any) -> Any:
    """llama-server's chat-template flags, passed to the command as one ``chat_template``: the
    template's text (a file read, a name looked up) or None (the model's own)."""
    from ..chat import BUILTIN_TEMPLATES

    @functools.wraps(f)
    def command(*args: Any, **kw: Any) -> Any:
        text, path = kw.pop("chat_template"), kw.pop("chat_template_file")
        kw.pop("jinja")
        if text is not None and path is not None:
            raise UserError("give --chat-template or --chat-template-file, not both")
        if path is not None:
            text = _read_flag_file("--chat-template-file", path)
        if text is not None and not text.strip():
            raise UserError(f"{'--chat-template' if path is None else f'--chat-template-file {path}'}: "
                            "the template is empty")
        return f(*args, chat_template=None if text is None else BUILTIN_TEMPLATES.get(text, text), **kw)

    for option in reversed([
        click.option("--chat-template", "chat_template", default=None, metavar="NAME|JINJA",
                     help=f"Render chats with this template instead of the model's: a name "
                          f"({', '.join(BUILTIN_TEMPLATES)}) or Jinja text (as llama-server's)."),
        click.option("--chat-template-file", "chat_template_file", default=None, metavar="FILE",
                     help="Render chats with the Jinja template in FILE instead of the model's."),
        click.option("--jinja", "jinja", is_flag=True,
                     help="Accepted for llama-server's command lines; no effect: chat templates are always Jinja."),
    ]):
        command = option(command)
    return command


def _read_flag_file(flag: str, path: str) -> str:
    if not Path(path).is_file():  # (a FIFO would block the read)
        raise UserError(f"{flag} {path}: not a readable file")
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{flag} {path}: cannot read it: {getattr(e, 'strerror', None) or e}") from None


def constraint_kwargs(grammar: str | None, grammar_file: str | None, json_schema: str | None,
                      json_schema_file: str | None, json_object: bool) -> dict[str, Any]:
    """Clover.generate's grammar for the constraint flags (a schema converted now, before the model
    loads, so that a schema the converter cannot enforce is one line under its flag)."""
    from ..grammar import GrammarError, json_schema_grammar

    given = {"--grammar": grammar, "--grammar-file": grammar_file, "--json-schema": json_schema,
             "--json-schema-file": json_schema_file, "--json": json_object or None}
    flags = [flag for flag, value in given.items() if value is not None]
    if len(flags) > 1:
        raise UserError(f"give one of {', '.join(flags)}, not several")
    if grammar is not None or grammar_file is not None:
        return {"grammar": grammar if grammar is not None else _read_flag_file("--grammar-file", grammar_file)}
    if not flags:
        return {}
    flag = flags[0]
    text = (json_schema if json_schema is not None else
            _read_flag_file(flag, json_schema_file) if json_schema_file is not None else '{"type": "object"}')
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise UserError(f"{flag}: not JSON ({e})") from None
    try:
        return {"grammar": json_schema_grammar(schema)}
    except GrammarError as e:
        raise UserError(f"{flag}: {e}") from None


# llama.cpp's samplers, llama-cli's flags -> Clover.generate's keywords (each off unless given;
# spec/decoding.md, "Sampler chain")
CHAIN_FLAGS = [("min_p", "--min-p", float, "Min-p (0 = off)."), ("typical_p", "--typical", float, "Typical-p (1 = off)."),
               ("top_n_sigma", "--top-nsigma", float, "Top-n-sigma (<= 0 = off)."),
               ("xtc_probability", "--xtc-probability", float, "XTC probability (0 = off)."),
               ("xtc_threshold", "--xtc-threshold", float, "XTC threshold (> 0.5 = off)."),
               ("repeat_penalty", "--repeat-penalty", float, "Repeat penalty (1 = off)."),
               ("repeat_last_n", "--repeat-last-n", int, "Tokens the penalties look back over (-1 = n_ctx)."),
               ("presence_penalty", "--presence-penalty", float, "Presence penalty (0 = off)."),
               ("frequency_penalty", "--frequency-penalty", float, "Frequency penalty (0 = off)."),
               ("dry_multiplier", "--dry-multiplier", float, "DRY multiplier (0 = off)."),
               ("dry_base", "--dry-base", float, "DRY base."),
               ("dry_allowed_length", "--dry-allowed-length", int, "DRY allowed length."),
               ("dry_penalty_last_n", "--dry-penalty-last-n", int, "Tokens DRY looks back over (-1 = n_ctx)."),
               ("mirostat_mode", "--mirostat", int, "Mirostat 1 or 2 (0 = off; decodes at block size 1)."),
               ("mirostat_eta", "--mirostat-lr", float, "Mirostat learning rate (eta)."),
               ("mirostat_tau", "--mirostat-ent", float, "Mirostat target entropy (tau)."),
               ("dynatemp_range", "--dynatemp-range", float, "Dynamic temperature range (0 = off)."),
               ("dynatemp_exponent", "--dynatemp-exp", float, "Dynamic temperature exponent."),
               ("min_keep", "--min-keep", int, "Candidates top-p, min-p, typical and XTC keep at least (0 = off)."),
               ("samplers", "--samplers", str, "The chain's order: llama-server's names, ';'-separated."),
               ("samplers", "--sampling-seq", str, "The chain's order as llama-cli's letters (edskypmxt).")]


def chain_options(f: Any) -> Any:
    """llama-cli's sampler flags, passed to the command as one dict ``chain`` of the ones given."""
    keys = {name for name, *_ in CHAIN_FLAGS}

    @functools.wraps(f)
    def command(*args: Any, **kw: Any) -> Any:
        chain = {k: kw.pop(k) for k in list(kw) if k in keys or k.startswith("_seq_")}
        chain = {("samplers" if k.startswith("_seq_") else k): v for k, v in chain.items() if v is not None}
        breakers, biases = kw.pop("dry_sequence_breaker"), kw.pop("logit_bias")
        if breakers:
            chain["dry_sequence_breakers"] = list(breakers)
        if biases:
            chain["logit_bias"] = dict(logit_bias_flag(b) for b in biases)
        return f(*args, chain=chain, **kw)

    options = [click.option(flag, "_seq_" + name if flag == "--sampling-seq" else name, type=t, default=None,
                            help=text) for name, flag, t, text in CHAIN_FLAGS]
    options += [click.option("--dry-sequence-breaker", "dry_sequence_breaker", multiple=True, metavar="TEXT",
                             help="A DRY sequence breaker (repeatable; default llama.cpp's)."),
                click.option("-l", "--logit-bias", "logit_bias", multiple=True, metavar="TOKEN(+|-)BIAS",
                             help="Add BIAS to TOKEN's logit (repeatable; -inf bans it), as llama-cli.")]
    for option in reversed(options):
        command = option(command)
    return command


def logit_bias_flag(text: str) -> tuple[int, float]:
    """llama-cli's --logit-bias TOKEN(+|-)BIAS ("15043+1", "15043-inf")."""
    at = min((i for i in (text.find("+", 1), text.find("-", 1)) if i > 0), default=-1)
    try:
        return int(text[:at]), float(text[at:])
    except ValueError:
        raise UserError(f"--logit-bias: expects TOKEN(+|-)BIAS, got {text!r}") from None


# The generating flags' values go to Clover as given: their ranges are libclover's rules (one owner),
# and a value it refuses is reported under the flag that set it (CloverError.param -> the flag)
FLAGS = {"max_tokens": "--n-predict", "block_size": "--block-size", "threshold": "--threshold",
         "max_steps": "--step-cap", "temperature": "--temp", "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed",
         "draft_self": "--draft-self", "stop": "--reverse-prompt", "n_ctx": "--ctx-size", "n_threads": "--threads",
         "n_gpu_layers": "--n-gpu-layers", "flash_attn": "--flash-attn", "rpc_servers": "--rpc",
         "tensor_split": "--tensor-split", "override_tensor": "--override-tensor", "coreset": "--coreset",
         "chat_template": "--chat-template",
         "dry_sequence_breakers": "--dry-sequence-breaker", "logit_bias": "--logit-bias",
         **{name: flag for name, flag, *_ in CHAIN_FLAGS if flag != "--sampling-seq"}}


def refused(e: Any) -> UserError:
    """A CloverError as the user's error: libclover's message, under the flag of the value it refused."""
    flag = FLAGS.get(e.param or "")
    return UserError(f"{flag}: {e.message}" if flag else e.message)


@contextlib.contextmanager
def flag_errors() -> Iterator[None]:
    """Clover's refusal of a flag's value (while generating) as that flag's one-line error."""
    from .. import CloverError

    try:
        yield
    except CloverError as e:
        if e.param not in FLAGS:
            raise
        raise refused(e) from None


def check_flags(kw: dict[str, Any]) -> None:
    """The generating flags (Clover.generate's keyword arguments) checked before the model loads:
    Clover.check_generate_args, libclover's rules and messages, under the flags' names."""
    from .. import Clover

    with flag_errors():
        Clover.check_generate_args(**(dict(kw, max_tokens=0) if kw.get("max_tokens") == -1 else kw))


def library_default(name: str) -> Any:
    """Clover.generate's default for a keyword: libclover's (clover_generate_default_params; test_abi
    checks they agree). A flag's default= that reads it keeps no copy of the number."""
    import inspect

    from .. import Clover

    return inspect.signature(Clover.generate).parameters[name].default


LIBRARY_DEFAULT = "the library's"  # show_default of a flag whose default is library_default's


# Greedy by default, unlike llama-cli (temp 0.8, top-k 40, top-p 0.95, seed -1, -n -1): the same
# command prints the same text, as Clover.generate returns it, and --draft-self reproduces it token
# for token (README, "Command-line defaults"); llama-cli's sampling is one set of flags away
DEFAULT_TEMP, DEFAULT_TOP_K, DEFAULT_TOP_P, DEFAULT_SEED = 0.0, 0, 1.0, 0
DEFAULT_N_PREDICT = 128  # clover-cli's -n default too (a test keeps the two equal)


def sampling_options(f: Any, n_default: int = DEFAULT_N_PREDICT) -> Any:
    opts = [
        click.option("-n", "--n-predict", "n_predict", type=int, default=n_default,
                     show_default=True, help="Tokens to generate at most (-1 = until EOS or the end of the "
                                             "context, as llama-cli)."),
        click.option("--block-size", "block_size", type=BLOCK_SIZE, default="auto", show_default=True,
                     help="Block size B (1 = autoregressive; auto = chosen per block from the pass cost, "
                          "measured once per model and machine and cached, and the tokens per pass)."),
        click.option("--threshold", type=float, default=lambda: library_default("threshold"),
                     show_default=LIBRARY_DEFAULT,
                     help="Unmask every position whose confidence is at least this."),
        click.option("--step-cap", "--max-steps", "max_steps", type=int, default=0,
                     show_default=True, help="Denoising steps per block at most (0 = no cap)."),
        click.option("--temp", "temperature", type=float, default=DEFAULT_TEMP,
                     show_default=True, help="Sampling temperature (0 = greedy)."),
        click.option("--top-k", type=int, default=DEFAULT_TOP_K, show_default=True,
                     help="Top-k (0 = off)."),
        click.option("--top-p", type=float, default=DEFAULT_TOP_P,
                     show_default=True, help="Top-p (1 = off)."),
        click.option("-s", "--seed", type=int, default=DEFAULT_SEED, show_default=True,
                     help="Sampling seed (-1 = random)."),
        click.option("--draft-self", "draft_self", type=click.Choice(["on", "off", "auto"]), is_flag=False,
                     flag_value="on", default="off", show_default=True,
                     help="Lossless self-speculative decoding (--draft-self alone = on): blocks drafted by block "
                          "passes, verified by their causal commit (the output of --block-size 1, faster when "
                          "drafts are good). --draft-self=auto with --block-size auto: the mode too is chosen per "
                          "block (B = 1, block diffusion or draft-self); the stats line names the one chosen."),
        click.option("--ignore-eos", is_flag=True, help="Do not stop at the end-of-sequence token."),
        click.option("-r", "--reverse-prompt", "reverse_prompt", multiple=True, metavar="TEXT",
                     help="Stop before TEXT (repeatable; matched across token boundaries)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def visual_option(f: Any) -> Any:
    return click.option("--visual/--no-visual", default=None,
                        help="Live view of the block being denoised, on a terminal only (default: on when "
                             "stdout is a terminal; a pipe or a file always gets plain text).")(f)


def use_visual(visual: bool | None) -> bool:
    """--visual draws with cursor movements: only on a terminal, never into a pipe or a file."""
    return (visual is None or visual) and sys.stdout.isatty()


def set_verbose() -> None:
    """--verbose: llama.cpp's log on stderr."""
    from .. import set_verbosity

    set_verbosity(2)


def open_model(path: str, threads: int | None, ctx_size: int, n_gpu_layers: int, block_size: Any,
               verbose: bool, flash_attn: str = "auto", rpc: str | None = None,
               tensor_split: list[float] | None = None, override_tensor: str | None = None,
               chat_template: str | None = None, expert_stats: bool = False) -> Any:
    from .. import Clover, CloverError

    # libclover checks the file (missing, not a GGUF, wrong architecture, bad metadata) with
    # one-line messages in milliseconds; reading the header in Python first cost 0.3 s+
    if Path(path).is_dir():
        raise UserError(f"{path}: is a folder, not a GGUF file")
    if verbose:
        set_verbose()
    try:
        return Clover(path, n_ctx=ctx_size, n_threads=threads, n_gpu_layers=n_gpu_layers, block_size=block_size,
                      flash_attn=flash_attn, rpc_servers=rpc, tensor_split=tensor_split,
                      override_tensor=override_tensor, chat_template=chat_template, expert_stats=expert_stats)
    except CloverError as e:
        raise refused(e) from None


def gen_kwargs(n_predict: int, block_size: Any, threshold: float, max_steps: int, temperature: float,
               top_k: int, top_p: float, seed: int, ignore_eos: bool, reverse_prompt: Sequence[str] = (),
               draft_self: bool | str = False, coreset: Any = "context") -> dict[str, Any]:
    """The sampling flags as Clover.generate's keyword arguments (their values as the flags spell
    them: Clover reads block_size "auto", draft_self "on"/"off"/"auto" and seed -1 = a fresh random
    seed per call itself)."""
    return dict(max_tokens=n_predict, block_size=block_size, threshold=threshold, max_steps=max_steps,
                temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop_at_eos=not ignore_eos,
                stop=list(reverse_prompt), draft_self=draft_self, coreset=coreset)


def until_context_end(m: Any, n_prompt: int, block_size: Any, draft_self: bool | str = False) -> int:
    """The budget of -n -1: the rest of the context (Clover.room: in whole blocks of a fixed B,
    as decode blocks start right after the prompt)."""
    budget = m.room(n_prompt, block_size, draft_self)
    if budget < 1:
        B = 1 if block_size == "auto" or draft_self == "on" else int(block_size)  # (draft-self: no whole blocks)
        raise UserError(f"the prompt ({n_prompt} tokens) leaves no room for a block of {B} in the context "
                        f"({m.n_ctx()}); raise -c")
    return budget
