"""llama.cpp as a bench peer: the bench model written as GGUF, its prompt timed through llama-cpp-python.

llama.cpp is what CPU users pick for prefill, so `ttftc bench` can put it beside ttftc in the same run
(`--variants llamacpp-bf16,...`). The variants need the optional extra (`pip install -e ".[llamacpp]"`, which
builds llama.cpp from source with the machine's compiler); without it they are skipped with that reason.

What is timed matches every other variant's prefill (ttftc.bench.models.prefill): one batch-1 forward over the
whole prompt into an empty KV cache, logits for the last position only (llama-cpp-python's default
`logits_all=False`), flash attention on, with torch's intra-op thread count.

The GGUF is written from the model's own weights: llama.cpp's `llama` architecture, with the Q and K
projections' rows reordered from Hugging Face's half-split rotary layout to llama.cpp's interleaved one, and a
placeholder SentencePiece vocabulary (token ids go in directly, nothing is tokenised). Only Llama-family models
(LlamaForCausalLM: no biases, RMSNorm, SwiGLU) convert; anything else is refused with that reason.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
import torch

from ttftc.bench.errors import BenchInputError

# GGUF file types by the name the variants carry; norms stay f32 in every one, as llama.cpp's converter keeps them.
FILE_TYPES = ("f32", "bf16", "q8_0")
# llama.cpp's default physical batch: the prompt goes in as one logical batch, computed 512 tokens at a time.
UBATCH = 512
# Placeholder vocabulary: <unk>, <s>, </s>, then the 256 byte tokens SentencePiece vocabularies carry (llama.cpp
# looks the newline byte up when it loads one), then numbered pieces up to the model's vocabulary size.
_SPECIAL = ("<unk>", "<s>", "</s>")
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_BYTE = 1, 2, 3, 6


def missing_reason() -> Optional[str]:
    """Why the llama.cpp variants cannot run here, or None."""
    absent = [name for name, module in (("llama-cpp-python", "llama_cpp"), ("gguf", "gguf"))
              if importlib.util.find_spec(module) is None]
    if absent:
        return f"{' and '.join(absent)} not installed: pip install -e \".[llamacpp]\""
    return None


@dataclass(frozen=True)
class LlamaShape:
    """What the GGUF header needs, read off a Hugging Face Llama config."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int
    rms_eps: float
    rope_theta: float

    @classmethod
    def of(cls, model: torch.nn.Module) -> "LlamaShape":
        config = model.config
        if getattr(config, "model_type", None) != "llama":
            raise BenchInputError(
                f"llama.cpp variants convert Llama-family models only; this model is "
                f"{getattr(config, 'model_type', type(model).__name__)!r} (use a llama preset, e.g. llama-135m)"
            )
        if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
            raise BenchInputError("llama.cpp variants convert Llama models without biases; this one has biases")
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise BenchInputError(f"llama.cpp variants convert plain RoPE only; this model uses {rope['rope_type']!r}")
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return cls(vocab=config.vocab_size, hidden=config.hidden_size, intermediate=config.intermediate_size,
                   layers=config.num_hidden_layers, heads=heads, kv_heads=config.num_key_value_heads or heads,
                   head_dim=head_dim, context=config.max_position_embeddings, rms_eps=config.rms_norm_eps,
                   rope_theta=float(theta))


def interleave_rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Reorder a Q or K projection's output rows from HF's rotary layout to llama.cpp's.

    Hugging Face rotates dimension i with i + d/2 of each head; llama.cpp's `llama` architecture rotates
    2i with 2i + 1. Row i of a head goes to 2i and row i + d/2 to 2i + 1.
    """
    rows, columns = weight.shape
    head_dim = rows // heads
    return weight.reshape(heads, 2, head_dim // 2, columns).swapaxes(1, 2).reshape(rows, columns)


def _placeholder_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    pieces = list(_SPECIAL) + [f"<0x{b:02X}>" for b in range(256)]
    types = [_TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_CONTROL] + [_TOKEN_BYTE] * 256
    if size < len(pieces):
        raise BenchInputError(f"llama.cpp variants need a vocabulary of at least {len(pieces)} tokens; this has {size}")
    pieces += [f"\u2581t{i}" for i in range(size - len(pieces))]
    types += [_TOKEN_NORMAL] * (size - len(types))
    return pieces, [0.0] * size, types


def _tensors(model: torch.nn.Module, shape: LlamaShape) -> list[tuple[str, np.ndarray, bool]]:
    """(GGUF name, fp32 array, is_matrix) for every weight, in llama.cpp's names."""
    state = {name: tensor.detach().float().cpu().numpy() for name, tensor in model.state_dict().items()}
    out = [("token_embd.weight", state["model.embed_tokens.weight"], True),
           ("output_norm.weight", state["model.norm.weight"], False)]
    if not model.config.tie_word_embeddings:
        out.append(("output.weight", state["lm_head.weight"], True))
    for i in range(shape.layers):
        hf = f"model.layers.{i}."
        out += [
            (f"blk.{i}.attn_norm.weight", state[hf + "input_layernorm.weight"], False),
            (f"blk.{i}.attn_q.weight", interleave_rotary_rows(state[hf + "self_attn.q_proj.weight"], shape.heads), True),
            (f"blk.{i}.attn_k.weight", interleave_rotary_rows(state[hf + "self_attn.k_proj.weight"], shape.kv_heads),
             True),
            (f"blk.{i}.attn_v.weight", state[hf + "self_attn.v_proj.weight"], True),
            (f"blk.{i}.attn_output.weight", state[hf + "self_attn.o_proj.weight"], True),
            (f"blk.{i}.ffn_norm.weight", state[hf + "post_attention_layernorm.weight"], False),
            (f"blk.{i}.ffn_gate.weight", state[hf + "mlp.gate_proj.weight"], True),
            (f"blk.{i}.ffn_up.weight", state[hf + "mlp.up_proj.weight"], True),
            (f"blk.{i}.ffn_down.weight", state[hf + "mlp.down_proj.weight"], True),
        ]
    return out


def write_gguf(model: torch.nn.Module, path: str, file_type: str) -> str:
    """Write `model` (a Hugging Face LlamaForCausalLM) to `path` as GGUF with matrices in `file_type`."""
    import gguf  # lazy: the [llamacpp] extra; missing_reason() has said so when it is absent

    if file_type not in FILE_TYPES:
        raise BenchInputError(f"GGUF file type {file_type!r} is not one of {', '.join(FILE_TYPES)}")
    shape = LlamaShape.of(model)
    quant = {"f32": gguf.GGMLQuantizationType.F32, "bf16": gguf.GGMLQuantizationType.BF16,
             "q8_0": gguf.GGMLQuantizationType.Q8_0}[file_type]
    file_enum = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[file_type]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("ttftc-bench")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(shape.vocab)
    writer.add_file_type(file_enum)
    pieces, scores, types = _placeholder_vocab(shape.vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    for name, array, is_matrix in _tensors(model, shape):
        if is_matrix and quant != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(array), quant), raw_dtype=quant)
        else:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class LlamaCppModel:
    """A GGUF loaded into llama.cpp, called as the bench calls every variant; the prefill is all it runs."""

    def __init__(self, gguf_path: str, context: int, threads: int):
        import llama_cpp  # lazy: the [llamacpp] extra; missing_reason() has said so when it is absent

        self._llama_cpp = llama_cpp
        self.llama = llama_cpp.Llama(
            model_path=gguf_path, n_ctx=context, n_batch=context, n_ubatch=min(UBATCH, context), n_threads=threads,
            n_threads_batch=threads, flash_attn=True, logits_all=False, verbose=False,
        )

    def __call__(self, input_ids: torch.Tensor, logits_to_keep: int = 1, use_cache: bool = True,
                 **unsupported: Any) -> SimpleNamespace:
        """The bench's prefill call (ttftc.bench.models.prefill): last-position logits, [1, 1, vocab], of one
        prompt whose KV cache starts empty. Any other call is refused: this is not a Hugging Face model."""
        if unsupported or logits_to_keep != 1 or not use_cache:
            raise BenchInputError(
                "llama.cpp variants run the plain prefill only (logits_to_keep=1, use_cache=True: the single-prompt "
                f"and batch workloads); got {sorted(unsupported) or dict(logits_to_keep=logits_to_keep)}"
            )
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise BenchInputError(f"llama.cpp variants time batch-1 prompts; got input ids of shape "
                                  f"{tuple(input_ids.shape)}")
        if input_ids.shape[1] > self.llama.n_ctx():
            raise BenchInputError(f"a prompt of {input_ids.shape[1]} tokens exceeds the llama.cpp context "
                                  f"{self.llama.n_ctx()}")
        self.llama.reset()  # n_tokens = 0: eval() drops the previous prompt's KV cache before it writes
        self.llama.eval(input_ids[0].tolist())
        last = self._llama_cpp.llama_get_logits_ith(self.llama.ctx, -1)
        logits = np.ctypeslib.as_array(last, shape=(self.llama.n_vocab(),)).copy()
        return SimpleNamespace(logits=torch.from_numpy(logits).view(1, 1, -1))


def load(model: torch.nn.Module, file_type: str, threads: int) -> LlamaCppModel:
    """Convert `model` to a temporary GGUF of `file_type` and load it; the file goes when the result does."""
    directory = tempfile.mkdtemp(prefix="ttftc-llamacpp-")
    path = os.path.join(directory, f"model-{file_type}.gguf")
    try:
        write_gguf(model, path, file_type)
        loaded = LlamaCppModel(path, LlamaShape.of(model).context, threads)
    finally:
        # llama.cpp maps the file; unlinking it now keeps the mapping and leaves nothing behind on any exit.
        if os.path.exists(path):
            os.unlink(path)
        os.rmdir(directory)
    return loaded
