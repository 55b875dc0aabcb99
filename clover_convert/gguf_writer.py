"""The GGUF output: gguf-py's writer with every key of spec/gguf-layout.md and the tensor infos
(built once per conversion, by the plan), written to temporaries next to the final shard names;
the layout of the tensor data (where each tensor's bytes go, so that the chunks can be written
in any order, from any thread), and the write-back of the written bytes to disk."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import gguf
import numpy as np
from gguf import GGUFWriter, LlamaFileType
from gguf.constants import GGML_QUANT_VERSION

from clover_gguf import keys as gguf_keys

from . import config as keys
from .config import ARCH, CloverConfig
from .tokenizer import TokenizerInfo, add_tokenizer

if TYPE_CHECKING:
    from .tensors import TensorPlan

__all__ = ["ShardWriter", "Placement", "WriteBack", "build_writer", "add_identity", "add_metadata",
           "WRITEBACK_BYTES"]

_FILE_TYPES = {
    "f32": LlamaFileType.ALL_F32,
    "f16": LlamaFileType.MOSTLY_F16,
    "bf16": LlamaFileType.MOSTLY_BF16,
    "q8_0": LlamaFileType.MOSTLY_Q8_0,
}

WRITEBACK_BYTES = 256 * 1024 * 1024    # start writing the output to disk after this many bytes


class Placement(NamedTuple):
    """Where a tensor's bytes go: an open output file and the offset in it."""

    fd: int
    offset: int


class ShardWriter(GGUFWriter):
    """A GGUFWriter whose files are temporaries next to the final shard names (renamed into place
    once everything is written): GGUFWriter opens the names format_shard_names gives, so the
    temporaries are substituted there (``temps``: final path -> temporary)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.temps: dict[Path, Path] = {}

    def format_shard_names(self, path: Path) -> list[Path]:
        return [self.temps.get(p, p) for p in super().format_shard_names(path)]

    def write_header(self, out: Path, temps: dict[Path, Path]) -> dict[str, Placement]:
        """Open the temporaries of out's shards (``temps``: final path -> temporary), write the
        header, the metadata and the tensor infos, and lay the tensor data out
        (:meth:`lay_out_tensor_data`)."""
        self.temps = dict(temps)
        self.open_output_file(out)
        self.write_header_to_file()
        self.write_kv_data_to_file()
        self.write_ti_data_to_file()
        return self.lay_out_tensor_data()

    def lay_out_tensor_data(self) -> dict[str, Placement]:
        """After write_ti_data_to_file: where each tensor's bytes go, laid out as
        write_tensor_data lays them (each at the next multiple of the alignment, padding after
        the last). Every file is sized to its end now, so the padding is the zeros of the holes,
        and the tensors can be written in any order, from any thread (os.pwrite)."""
        assert self.fout is not None
        where: dict[str, Placement] = {}
        for f, tensors in zip(self.fout, self.tensors):
            f.flush()
            pos = f.tell()
            for name, ti in tensors.items():
                pos = self.ggml_pad(pos, self.data_alignment)
                where[name] = Placement(f.fileno(), pos)
                pos += ti.nbytes
            os.ftruncate(f.fileno(), self.ggml_pad(pos, self.data_alignment) if tensors else pos)
        return where

    def finish(self) -> None:
        """Flush, fsync and close every file (the data is on disk before the rename)."""
        self.flush()
        for f in self.fout or ():
            os.fsync(f.fileno())
        self.close()


class WriteBack:
    """Starts writing a file's new bytes to disk as they come, without waiting for them (Linux's
    POSIX_FADV_DONTNEED starts the write-back of dirty pages, and drops pages already written):
    the disk works while the next tensors are converted, the final fsync has little left to
    wait for, and a big conversion does not fill the page cache."""

    def __init__(self) -> None:
        self._dropped: dict[int, int] = {}  # fd -> pages dropped up to here
        self._started: dict[int, int] = {}  # fd -> write-back started up to here

    def written_up_to(self, fd: int, end: int) -> None:
        """The file's bytes before ``end`` are all written (to the page cache)."""
        if not hasattr(os, "posix_fadvise"):
            return
        dropped, started = self._dropped.get(fd, 0), self._started.get(fd, 0)
        if end - started >= WRITEBACK_BYTES:
            # from the range started last time (written by now, mostly: dropped) to the end
            os.posix_fadvise(fd, dropped, end - dropped, os.POSIX_FADV_DONTNEED)
            self._dropped[fd], self._started[fd] = started, end


def build_writer(tensors: list[TensorPlan], cfg: CloverConfig, tok: TokenizerInfo, outtype: str,
                 model_name: str, split_max_size: int | None, folder: Path | None = None) -> ShardWriter:
    """The output's writer with every tensor info and key added (nothing opened yet)."""
    w = ShardWriter(None, ARCH, split_max_size=split_max_size or 0)
    for t in tensors:
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
    add_identity(w, folder, model_name)
    add_metadata(w, cfg, tok, outtype)
    return w


def add_identity(w: GGUFWriter, folder: Path | None, model_name: str) -> None:
    """general.name, basename, size_label, finetune, version, license, ... as the hub and
    llama.cpp's own converter fill them: gguf-py's Metadata reads the model card (README.md
    front matter), config.json and the name; the size label counts the tensors (MoE: 8x1.2M)."""
    total, shared, expert, n_expert = w.get_total_parameter_count()
    meta = gguf.Metadata.load(None, folder if folder and folder.is_dir() else None, model_name, total)
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, shared, expert, n_expert)
    meta.set_gguf_meta_model(w)


def add_metadata(w: GGUFWriter, cfg: CloverConfig, tok: TokenizerInfo, outtype: str) -> None:
    """Every key of spec/gguf-layout.md but the identity ones (add_identity): gguf-py's typed
    helpers for the standard keys, config.KEY_* for our own."""
    w.add_file_type(int(_FILE_TYPES[outtype]))
    w.add_quantization_version(GGML_QUANT_VERSION)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.H)
    w.add_block_count(cfg.L)
    w.add_feed_forward_length(cfg.I)
    w.add_head_count(cfg.nh)
    w.add_head_count_kv(cfg.nkv)
    w.add_key_length(cfg.dh)
    w.add_value_length(cfg.dh)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_value(keys.KEY_RECURRENT_LAYERS.format(arch=w.arch), [cfg.is_recurrent(i) for i in range(cfg.L)],
                    gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.BOOL)
    w.add_full_attention_interval(cfg.full_attention_interval)
    w.add_rope_dimension_count(cfg.rope_dims)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_expert_count(cfg.E)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.I)
    w.add_expert_shared_feed_forward_length(cfg.Is)
    w.add_expert_weights_norm(cfg.norm_topk_prob)
    w.add_ssm_conv_kernel(cfg.K)
    w.add_uint32(keys.KEY_CONV_LOOKAHEAD.format(arch=w.arch), cfg.R)
    w.add_ssm_state_size(cfg.dk)
    w.add_ssm_group_count(cfg.Hk)
    w.add_ssm_time_step_rank(cfg.Hv)
    w.add_ssm_inner_size(cfg.Hv * cfg.dv)
    w.add_uint32(keys.KEY_DIFFUSION_BLOCK_SIZE.format(arch=w.arch), cfg.block_size)
    w.add_string(keys.KEY_SEMANTICS.format(arch=w.arch), cfg.clover_semantics)
    w.add_string(keys.KEY_BLOCK_OPERATOR.format(arch=w.arch), cfg.block_operator)
    w.add_expert_shared_count(cfg.num_shared_experts)
    if cfg.canvas_ffn_intermediate_size:
        w.add_uint32(keys.KEY_CANVAS_FFN_LENGTH.format(arch=w.arch), cfg.canvas_ffn_intermediate_size)
    coreset = cfg.raw.get(gguf_keys.CONFIG_EXPERT_CORESET)  # the file's default block expert coreset, if given
    if coreset is not None:
        if isinstance(coreset, bool) or not isinstance(coreset, int) or not 0 <= coreset <= 0xFFFFFFFF:
            raise ValueError(f"config.json: {gguf_keys.CONFIG_EXPERT_CORESET} must be an integer >= 0, got {coreset!r}")
        w.add_uint32(gguf_keys.KEY_EXPERT_CORESET.format(arch=w.arch), coreset)
    add_tokenizer(w, tok)
