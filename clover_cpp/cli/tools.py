"""The commands around a model file: `clover quantize`, `clover inspect` and `clover serve` (the
server itself is clover_cpp.server, imported when the command runs)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from .group import CONTEXT_SETTINGS, UserError, cli
from .options import chat_template_options, model_option, runtime_options, set_verbose


@cli.command(context_settings=CONTEXT_SETTINGS)
@click.argument("inp", metavar="IN")
@click.argument("out")
@click.argument("qtype", metavar="TYPE")
@click.option("-t", "--threads", type=click.IntRange(min=0), default=0, help="Threads (0 = all cores).")
@click.option("--force", is_flag=True, help="Overwrite an existing OUT.")
@click.option("--allow-requantize", is_flag=True, help="Allow requantizing already quantized tensors.")
@click.option("--leave-output-tensor", is_flag=True, help="Keep output.weight unquantized.")
@click.option("--pure", is_flag=True, help="Use TYPE for all tensors (no mixtures).")
@click.option("--imatrix", default=None, metavar="FILE",
              help="Importance matrix (llama.cpp's GGUF imatrix format), as llama-quantize --imatrix.")
@click.option("--verbose", is_flag=True, help="Show llama.cpp's log.")
def quantize(inp: str, out: str, qtype: str, threads: int, force: bool, allow_requantize: bool,
             leave_output_tensor: bool, pure: bool, imatrix: str | None, verbose: bool) -> None:
    """Quantize the Clover GGUF IN to TYPE (Q4_0, Q4_K_M, Q5_K_M, Q6_K, Q8_0, F16, BF16, ...) at OUT.

    Runs llama.cpp's llama_model_quantize; writes a temporary file and renames it."""
    from ..gguf_info import human_bytes
    from ..quant import parse_quant_type
    from ..quant import quantize as do_quantize

    name, _ = parse_quant_type(qtype)
    if verbose:
        set_verbose()
    t0 = time.monotonic()
    bar = None

    def progress(i: int, n: int, tensor: str) -> None:
        nonlocal bar
        if verbose or not sys.stderr.isatty():
            return
        if bar is None:
            from tqdm import tqdm
            bar = tqdm(total=n, unit="tensor", desc="Quantizing", leave=False)
        bar.set_postfix_str(tensor, refresh=False)
        bar.update(i - bar.n)
    try:
        dst = do_quantize(inp, out, name, n_threads=threads, force=force, allow_requantize=allow_requantize,
                          leave_output_tensor=leave_output_tensor, pure=pure, imatrix=imatrix, progress=progress,
                          verbose=verbose)
    finally:
        if bar is not None:
            bar.close()
    click.echo(f"quantized {inp} ({human_bytes(Path(inp).stat().st_size)}) -> {dst} "
               f"({human_bytes(dst.stat().st_size)}, {name}) in {time.monotonic() - t0:.1f} s", err=True)


@cli.command(context_settings=CONTEXT_SETTINGS)
@click.argument("model")
@click.option("--tensors", "all_tensors", is_flag=True, help="List every tensor (default: one layer of each kind).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def inspect(model: str, all_tensors: bool, as_json: bool) -> None:
    """Architecture, hyperparameters, tensors, size and tokenizer of a Clover GGUF."""
    from clover_gguf.reader import read_info

    from ..gguf_info import format_info

    info = read_info(model, require_clover=True)
    if as_json:
        md = {k: v for k, v in info.metadata.items()}
        click.echo(json.dumps({
            "path": str(info.path), "file_size": info.file_size, "gguf_version": info.version,
            "architecture": info.architecture, "hyperparameters": info.hparams(),
            "n_tensors": len(info.tensors), "n_params": info.n_params, "types": dict(info.type_counts),
            "tensors": [{"name": t.name, "shape": list(t.shape), "type": t.type} for t in info.tensors],
            "metadata": md}, indent=2, default=str))
        return
    click.echo(format_info(info, all_tensors=all_tensors))


@cli.command(context_settings=CONTEXT_SETTINGS)
@model_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="Port.")
@click.option("-np", "--parallel", type=click.IntRange(min=1, max=64), default=1, show_default=True,
              help="Requests served at once (one decoding context each, one model).")
@click.option("--queue-size", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests that may wait for a context; more get 503.")
@click.option("--api-key", default=None, envvar="CLOVER_API_KEY", metavar="KEY",
              help="Require 'Authorization: Bearer KEY' (also $CLOVER_API_KEY).")
@click.option("--max-body", type=click.IntRange(min=1024), default=8 * 2**20, show_default=True, metavar="BYTES",
              help="Largest request body; larger gets 413.")
@click.option("--max-messages", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Most chat messages per request.")
@click.option("--body-timeout", type=click.FloatRange(min=0.1), default=30.0, show_default=True, metavar="S",
              help="Seconds to receive a request body; slower (or a Content-Length larger than the body) gets 408.")
@click.option("--max-block-size", type=click.IntRange(min=1), default=512, show_default=True,
              help="Largest block_size a request may ask for.")
@click.option("--stuck-timeout", type=click.FloatRange(min=0.1), default=120.0, show_default=True, metavar="S",
              help="A generation without progress this long is stopped, and /health answers 503 meanwhile.")
@click.option("-a", "--alias", default=None, metavar="NAME",
              help="The model's name in the API (/v1/models, replies' \"model\"), as llama-server's --alias "
                   "[default: the file's general.name, else its file name].")
@click.option("--embeddings", is_flag=True, help="Serve /v1/embeddings (llama-server's --embeddings; llama.cpp's "
              "pooling over the causal pass, on an embedding context of its own).")
@click.option("--ssl-key-file", default=None, metavar="FILE", help="PEM private key: serve HTTPS (with --ssl-cert-file).")
@click.option("--ssl-cert-file", default=None, metavar="FILE", help="PEM certificate: serve HTTPS (with --ssl-key-file).")
@click.option("--access-log", is_flag=True, help="A line per request on stdout (uvicorn's access log; also with --verbose).")
@click.option("--reasoning-format", type=click.Choice(["none", "auto", "deepseek", "deepseek-legacy"]),
              default="deepseek", show_default=True,
              help="As llama-server's: other than none, a chat reply's thinking (<think>...</think>) goes to "
                   "message.reasoning_content; a request's reasoning_format overrides it.")
@runtime_options
@chat_template_options
def serve(model: str, host: str, port: int, parallel: int, queue_size: int, api_key: str | None, max_body: int,
          max_messages: int, body_timeout: float, max_block_size: int, stuck_timeout: float, alias: str | None,
          embeddings: bool, ssl_key_file: str | None, ssl_cert_file: str | None, access_log: bool,
          reasoning_format: str, threads: int | None, ctx_size: int, n_gpu_layers: int, flash_attn: str, rpc: str | None,
          tensor_split: list[float] | None, override_tensor: str | None, verbose: bool,
          chat_template: str | None = None) -> None:
    """OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions, /v1/models,
    /v1/embeddings (with --embeddings), /health, /metrics, /props, /tokenize, /detokenize;
    llama-server's /completion and /slots too. Clover's knobs are extra request fields
    (block_size, threshold); endpoints, fields and limits: docs/server.md."""
    try:
        from ..server import Limits
        from ..server import serve as run_server
    except ImportError as e:
        raise UserError(str(e)) from None
    if Path(model).is_dir():
        raise UserError(f"{model}: is a folder, not a GGUF file")
    if verbose:
        set_verbose()
    if alias is not None and not alias.strip():
        raise UserError("--alias: the model's name must not be empty")

    def banner(url: str) -> None:  # the port is bound and the model loaded
        click.echo(f"clover serve: {url} ({parallel} context(s)); Ctrl-C to stop", err=True)

    run_server(model, host=host, port=port, parallel=parallel, api_key=api_key, n_ctx=ctx_size, n_threads=threads,
               n_gpu_layers=n_gpu_layers, max_queue=queue_size, log_level="info" if verbose else "warning",
               flash_attn=flash_attn, rpc_servers=rpc, tensor_split=tensor_split,
               override_tensor=override_tensor, model_name=alias, access_log=access_log, on_ready=banner,
               chat_template=chat_template, embeddings=embeddings, ssl_key_file=ssl_key_file,
               ssl_cert_file=ssl_cert_file, reasoning_format=reasoning_format,
               limits=Limits(max_body_bytes=max_body, max_messages=max_messages, body_timeout=body_timeout,
                             max_block_size=max_block_size, stuck_after=stuck_timeout))
