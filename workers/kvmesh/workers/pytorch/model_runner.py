"""Forward passes of a Hugging Face decoder over a paged KV cache.

How attention over paged KV works with stock transformers
    transformers' own attention wants each sequence's past KV as one contiguous tensor
    (DynamicCache), which cannot share blocks between requests. So the runner drives the HF
    model's modules itself and replaces only the attention core: per layer it calls the layer's
    own `input_layernorm`, `q/k/v_proj` (and Qwen3's `q_norm`/`k_norm`), the model's
    `rotary_emb` with transformers' `apply_rotary_pos_emb`, then
      * writes the new tokens' keys/values into their cache slots (block table -> slot index),
      * computes attention with `torch.nn.functional.scaled_dot_product_attention` over the
        sequence's blocks gathered from the cache (`cache[block_table]`, padded to the longest
        sequence of the group, with a boolean mask for causality, per-sequence length and the
        layer's sliding window; grouped-query attention via `enable_gqa`),
    and continues with the layer's `o_proj`, `post_attention_layernorm` and `mlp`, the model's
    final `norm` and `lm_head`. Only the attention core is reimplemented, so the numerics are
    the model's own (RMSNorm, rotary scaling variants, biases, activations).

Batching
    All scheduled tokens of a step (decodes and prefill chunks of many sequences) are packed
    into one [tokens, hidden] tensor, so every linear layer runs once per step. Attention runs
    per group: all single-token (decode) sequences together (queries [B, 1]); prefill chunks in
    groups of similar size, padded. A lone prefill of a fresh prompt uses its own keys/values
    directly with a causal mask (exactly what transformers computes, no gather). Logits are
    computed only for the last token of sequences that sample in this step.

Attention kernels on CUDA: prefill attention (queries of more than one token) runs without
    torch's cuDNN backend. cuDNN builds an execution plan for every new shape, and a prefill's
    shape is new with nearly every prompt length: on an H200 (torch 2.11, bfloat16, the 8-layer
    model of tests/benchmarks/bench_torch_engine.py) a 1,024-1,209-token prompt of a new length
    took 85 ms to its first token with cuDNN and 18 ms without (flash / memory-efficient
    kernels need no plan); a 16-token prefill over a 1,024-token cached prefix 78 vs 14 ms.
    Decode steps keep torch's default choice: their shapes recur.

Images (LLaVA-style models, `LlavaForConditionalGeneration`): the runner drives the language
    model the same way; a chunk covering image placeholders carries its request's images
    (kvmesh.workers.pytorch.vision), whose features overwrite those rows' token embeddings
    before the first layer, as transformers' LLaVA does. Chunks without images cost nothing more.

Threading: a runner is used from one thread at a time (the engine's executor thread).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvmesh.workers.pytorch.config import TorchDType
from kvmesh.workers.pytorch.kv_cache import KvCacheSpec, PagedKvCache
from kvmesh.workers.pytorch.lora import LORA_MODULES, LoraAdapter, LoraBatch
from kvmesh.workers.pytorch.sampler import Sampled, SampleSpec, sample
from kvmesh.workers.pytorch.vision import ImageEncoder, RequestImages

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "LoadedModel",
    "ModelRunner",
    "SeqChunk",
    "dtype_option",
    "load_model",
    "resolve_device",
    "resolve_dtype",
]

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""Architectures whose decoder layers the runner knows (pre-norm, RMSNorm, rotary, SwiGLU)."""
MULTIMODAL_MODEL_TYPES = frozenset({"llava"})
"""Image-text models whose language model is one of SUPPORTED_MODEL_TYPES (transformers'
`LlavaForConditionalGeneration`: vision tower + projector + language model)."""

_DTYPES = {
    TorchDType.FLOAT32: torch.float32,
    TorchDType.BFLOAT16: torch.bfloat16,
    TorchDType.FLOAT16: torch.float16,
}


def dtype_option(dtype: torch.dtype) -> TorchDType:
    """The TorchDType that names a torch dtype (the inverse of resolve_dtype's choice)."""
    for option, torch_dtype in _DTYPES.items():
        if torch_dtype == dtype:
            return option
    raise ValueError(f"no TorchDType for {dtype}")


def _prefill_attention_context(device: torch.device) -> Callable[[], Any]:
    """A context manager factory for prefill attention calls (module docstring: on CUDA, every
    SDPA backend but cuDNN's)."""
    if device.type != "cuda":
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return lambda: sdpa_kernel(backends)


def resolve_device(device: str) -> torch.device:
    """`auto` -> cuda when available, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was requested but CUDA is not available")
    return dev


def resolve_dtype(dtype: TorchDType, device: torch.device, checkpoint: torch.dtype) -> torch.dtype:
    """The compute dtype (see TorchDType.AUTO)."""
    if dtype is not TorchDType.AUTO:
        return _DTYPES[dtype]
    if device.type != "cuda":
        return torch.float32
    if checkpoint in (torch.bfloat16, torch.float16):
        return checkpoint
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A Hugging Face causal LM in eval mode on its device. Read-only: engines may share one."""

    model: Any
    """The transformers PreTrainedModel (…ForCausalLM, or LlavaForConditionalGeneration)."""
    path: Path
    device: torch.device
    dtype: torch.dtype
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    image_token_id: int | None = None
    """Multimodal models: the image placeholder token (None: a text-only model)."""

    @property
    def decoder(self) -> Any:
        """The language model's decoder (embed_tokens, layers, norm, rotary_emb)."""
        inner = self.model.model
        return inner.language_model if self.image_token_id is not None else inner

    @property
    def lm_head(self) -> Any:
        return self.model.lm_head

    def image_encoder(self) -> ImageEncoder | None:
        """The image preprocessing and features of a multimodal model (None: text-only);
        call on the forward thread."""
        if self.image_token_id is None:
            return None
        return ImageEncoder(self.model, self.path, self.device, self.dtype, self.image_token_id)

    def kv_spec(self, block_size: int) -> KvCacheSpec:
        """The KV cache block shape for this model."""
        return KvCacheSpec(
            self.num_layers, self.num_kv_heads, self.head_dim, block_size, self.dtype
        )

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each decoder layer's projections (what a LoRA adapter must fit)."""
        layer = self.decoder.layers[0]
        mods = {**dict(layer.self_attn.named_children()), **dict(layer.mlp.named_children())}
        return {
            name: (int(m.weight.shape[0]), int(m.weight.shape[1]))
            for name, m in mods.items()
            if name in LORA_MODULES
        }

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())


def load_model(
    path: str | Path, device: str = "auto", dtype: TorchDType = TorchDType.AUTO
) -> LoadedModel:
    """Load the causal LM in `path` (a local directory; nothing is downloaded).

    Raises ValueError for an architecture the runner does not support, FileNotFoundError when
    the directory has no weights.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, LlavaForConditionalGeneration
    from transformers.utils import logging as hf_logging

    from kvmesh.workers.pytorch.weights import has_weights

    root = Path(path)
    config = AutoConfig.from_pretrained(root, local_files_only=True)
    model_type = str(getattr(config, "model_type", ""))
    multimodal = model_type in MULTIMODAL_MODEL_TYPES
    text_type = str(getattr(config.text_config, "model_type", "")) if multimodal else model_type
    if text_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type {model_type!r} is not supported by the torch engine; supported: "
            + ", ".join(sorted(SUPPORTED_MODEL_TYPES | MULTIMODAL_MODEL_TYPES))
            + (f" (with a language model of these: {text_type!r} is not)" if multimodal else "")
        )
    if not has_weights(root):
        raise FileNotFoundError(
            f"{root} has no weights (*.safetensors or pytorch_model*.bin); for a random-weight "
            "test model run kvmesh.workers.pytorch.weights.create_tiny_weights on it"
        )
    dev = resolve_device(device)
    checkpoint = getattr(config, "dtype", None) or torch.float32
    if not isinstance(checkpoint, torch.dtype):
        checkpoint = getattr(torch, str(checkpoint), torch.float32)
    dt = resolve_dtype(dtype, dev, checkpoint)
    hf_log: Any = hf_logging  # transformers' functions are untyped
    hf_log.disable_progress_bar()
    auto: Any = LlavaForConditionalGeneration if multimodal else AutoModelForCausalLM
    model: Any = auto.from_pretrained(root, dtype=dt, local_files_only=True)
    model.to(dev)
    model.eval()
    cfg = model.config.text_config if multimodal else model.config
    num_heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads)
    return LoadedModel(
        model=model,
        path=root,
        device=dev,
        dtype=dt,
        model_type=text_type,
        num_layers=int(cfg.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or num_heads),
        head_dim=head_dim,
        vocab_size=int(cfg.vocab_size),
        context_length=int(getattr(cfg, "max_position_embeddings", 0) or 0),
        image_token_id=int(model.config.image_token_id) if multimodal else None,
    )


@dataclass(slots=True)
class SeqChunk:
    """One sequence's work in a step: compute the KV of `token_ids` at positions
    `start .. start + len(token_ids) - 1`, stored through `block_table`; sample the next token
    when `sample` is set (the chunk ends the sequence's known tokens)."""

    token_ids: list[int]
    start: int
    block_table: list[int]
    sample: SampleSpec | None = None
    lora: LoraAdapter | None = None
    """The request's LoRA adapter (None: the base model)."""
    verify: bool = False
    """Speculative decoding: the chunk ends with draft tokens; the runner sets `greedy`."""
    greedy: list[int] | None = None
    """With `verify`: the argmax token after each of the chunk's tokens (set by the runner)."""
    images: RequestImages | None = None
    """The request's images, when the chunk covers some of their placeholders: their features
    replace those tokens' embeddings."""
    draft_prefix: list[int] = field(default_factory=list)
    """With a draft model: the known tokens before `start` whose draft-model KV is missing
    (kvmesh.workers.pytorch.draft computes them first)."""


@dataclass(slots=True)
class _Group:
    """Attention metadata of sequences attended together (see the module docstring)."""

    rows: torch.Tensor | None
    """Packed rows of the group's tokens, in order; None: all rows of the step, in order."""
    direct: bool
    """A fresh prefill attending to its own keys (no gather)."""
    q_index: torch.Tensor | None = None
    """[B, Q] packed row of each padded query (padding repeats a sequence's last row)."""
    valid: torch.Tensor | None = None
    """Flat indices into B*Q of the real queries, in row order."""
    table: torch.Tensor | None = None
    """[B, blocks] block tables (padded with block 0, masked)."""
    masks: dict[int | None, torch.Tensor] | None = None
    """Boolean [B, 1, Q, blocks*block_size] mask per sliding window (None: no window)."""


class ModelRunner:
    """Runs steps of `model` over `cache` (see the module docstring)."""

    def __init__(self, loaded: LoadedModel, cache: PagedKvCache) -> None:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.loaded = loaded
        self.cache = cache
        self.block_size = cache.spec.block_size
        self.device = loaded.device
        self._lm_head = loaded.lm_head
        self._decoder = loaded.decoder
        self._layers = list(self._decoder.layers)
        self._rope = apply_rotary_pos_emb
        self._prefill_attention = _prefill_attention_context(self.device)
        config = self._decoder.config
        default_window = (
            getattr(config, "sliding_window", None) if loaded.model_type == "mistral" else None
        )
        self._windows: list[int | None] = []
        for layer in self._layers:
            window = getattr(layer.self_attn, "sliding_window", default_window)
            self._windows.append(int(window) if window else None)

    # -- metadata -------------------------------------------------------------------------------

    def _groups(self, chunks: Sequence[SeqChunk], offsets: list[int]) -> list[_Group]:
        decodes = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
        prefills = sorted(
            (i for i, c in enumerate(chunks) if len(c.token_ids) > 1),
            key=lambda i: -len(chunks[i].token_ids),
        )
        plans: list[list[int]] = []
        if decodes:
            plans.append(decodes)
        # Greedy packing of prefill chunks while padding at most doubles the attention area.
        current: list[int] = []
        area = 0
        q_max = c_max = 0
        for i in prefills:
            n = len(chunks[i].token_ids)
            ctx = chunks[i].start + n
            if current:
                new_q, new_c = max(q_max, n), max(c_max, ctx)
                if new_q * new_c * (len(current) + 1) <= 2 * (area + n * ctx):
                    current.append(i)
                    area += n * ctx
                    q_max, c_max = new_q, new_c
                    continue
                plans.append(current)
            current, area, q_max, c_max = [i], n * ctx, n, ctx
        if current:
            plans.append(current)
        total = offsets[-1]
        groups = []
        for plan in plans:
            groups.append(self._group(chunks, offsets, plan, total, single=len(plans) == 1))
        return groups

    def _group(
        self,
        chunks: Sequence[SeqChunk],
        offsets: list[int],
        plan: list[int],
        total: int,
        single: bool,
    ) -> _Group:
        device = self.device
        bs = self.block_size
        rows_list: list[int] = []
        for i in plan:
            rows_list.extend(range(offsets[i], offsets[i + 1]))
        in_order = single and plan == sorted(plan) and len(rows_list) == total
        rows = None if in_order else torch.tensor(rows_list, dtype=torch.long, device=device)
        if len(plan) == 1 and chunks[plan[0]].start == 0:
            return _Group(rows, direct=True)
        q = max(len(chunks[i].token_ids) for i in plan)
        nb = max(-(-(chunks[i].start + len(chunks[i].token_ids)) // bs) for i in plan)
        q_index: list[list[int]] = []
        q_pos: list[list[int]] = []
        valid: list[int] = []
        table: list[list[int]] = []
        for b, i in enumerate(plan):
            c = chunks[i]
            n = len(c.token_ids)
            first = offsets[i]
            q_index.append([first + min(j, n - 1) for j in range(q)])
            q_pos.append([c.start + min(j, n - 1) for j in range(q)])
            valid.extend(range(b * q, b * q + n))
            t = c.block_table[: -(-(c.start + n) // bs)]
            table.append(t + [0] * (nb - len(t)))
        pos = torch.tensor(q_pos, dtype=torch.long)[:, None, :, None]  # [B, 1, Q, 1]
        keys = torch.arange(nb * bs, dtype=torch.long)[None, None, None, :]
        causal = keys <= pos
        masks: dict[int | None, torch.Tensor] = {}
        for window in set(self._windows):
            mask = causal if window is None else causal & (keys > pos - window)
            masks[window] = mask.to(device)
        return _Group(
            rows,
            direct=False,
            q_index=torch.tensor(q_index, dtype=torch.long, device=device),
            valid=torch.tensor(valid, dtype=torch.long, device=device),
            table=torch.tensor(table, dtype=torch.long, device=device),
            masks=masks,
        )

    # -- the step -------------------------------------------------------------------------------

    def execute(self, chunks: Sequence[SeqChunk]) -> list[Sampled]:
        """Run one step; returns the sampled tokens of the chunks with `sample`, in order."""
        with torch.inference_mode():
            return self._execute(chunks)

    def _execute(self, chunks: Sequence[SeqChunk]) -> list[Sampled]:
        device = self.device
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        offsets = [0]
        sample_rows: list[int] = []
        specs: list[SampleSpec] = []
        adapters: list[tuple[LoraAdapter, int, int]] = []
        verify: list[SeqChunk] = []
        verify_rows: list[int] = []
        with_images: list[tuple[SeqChunk, int]] = []
        for c in chunks:
            n = len(c.token_ids)
            if c.lora is not None:
                adapters.append((c.lora, offsets[-1], n))
            if c.images is not None:
                with_images.append((c, offsets[-1]))
            if c.verify:
                verify.append(c)
                verify_rows.extend(range(offsets[-1], offsets[-1] + n))
            tokens.extend(c.token_ids)
            span = range(c.start, c.start + n)
            positions.extend(span)
            table = c.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in span)
            offsets.append(offsets[-1] + n)
            if c.sample is not None:
                sample_rows.append(offsets[-1] - 1)
                specs.append(c.sample)
        groups = self._groups(chunks, offsets)
        ids = torch.tensor(tokens, dtype=torch.long, device=device)
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        slot_index = torch.tensor(slots, dtype=torch.long, device=device)

        hidden = self._decoder.embed_tokens(ids)  # [T, hidden]
        for c, row in with_images:
            assert c.images is not None
            placeholders, features = c.images.span(c.start, c.start + len(c.token_ids))
            rows = torch.tensor([row + p - c.start for p in placeholders], device=device)
            hidden[rows] = features.to(hidden.dtype)
        cos, sin = self._decoder.rotary_emb(hidden[None], pos[None])
        cos, sin = cos[0], sin[0]  # [T, head_dim]
        head_dim = self.loaded.head_dim
        cache = self.cache
        lb = LoraBatch(adapters, device) if adapters else None
        for li, layer in enumerate(self._layers):
            attn = layer.self_attn
            residual = hidden
            h = layer.input_layernorm(hidden)
            q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
            if lb is not None:
                q = lb.apply(li, "q_proj", h, q)
                k = lb.apply(li, "k_proj", h, k)
                v = lb.apply(li, "v_proj", h, v)
            q = q.view(len(tokens), -1, head_dim)
            k = k.view(len(tokens), -1, head_dim)
            v = v.view(len(tokens), -1, head_dim)
            if hasattr(attn, "q_norm"):
                q = attn.q_norm(q)
                k = attn.k_norm(k)
            q, k = self._rope(q, k, cos, sin, unsqueeze_dim=1)
            cache.write_tokens(li, slot_index, k, v)
            out = self._attention(li, attn.scaling, q, k, v, groups)
            if lb is None:
                hidden = residual + attn.o_proj(out)
                residual = hidden
                hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
                continue
            hidden = residual + lb.apply(li, "o_proj", out, attn.o_proj(out))
            residual = hidden
            x = layer.post_attention_layernorm(hidden)
            mlp = layer.mlp
            gate = lb.apply(li, "gate_proj", x, mlp.gate_proj(x))
            up = lb.apply(li, "up_proj", x, mlp.up_proj(x))
            act = mlp.act_fn(gate) * up
            hidden = residual + lb.apply(li, "down_proj", act, mlp.down_proj(act))
        if verify:
            rows = torch.tensor(verify_rows, dtype=torch.long, device=device)
            greedy = self._lm_head(self._decoder.norm(hidden[rows])).argmax(-1).tolist()
            at = 0
            for c in verify:
                c.greedy = greedy[at : at + len(c.token_ids)]
                at += len(c.token_ids)
        if not specs:
            return []
        last = hidden[torch.tensor(sample_rows, dtype=torch.long, device=device)]
        logits = self._lm_head(self._decoder.norm(last)).float()
        return sample(logits, specs)

    def _attention(
        self,
        layer: int,
        scale: float,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        groups: list[_Group],
    ) -> torch.Tensor:
        """Attention output [T, heads * head_dim] for the packed queries `q` ([T, heads, d])."""
        window = self._windows[layer]
        num_tokens = q.shape[0]
        if len(groups) == 1 and groups[0].rows is None:
            return self._attend(layer, window, scale, q, k, v, groups[0]).reshape(num_tokens, -1)
        out = q.new_empty(num_tokens, q.shape[1] * q.shape[2])
        for g in groups:
            assert g.rows is not None
            out[g.rows] = self._attend(layer, window, scale, q, k, v, g).reshape(
                g.rows.shape[0], -1
            )
        return out

    def _attend(
        self,
        layer: int,
        window: int | None,
        scale: float,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: _Group,
    ) -> torch.Tensor:
        """One group's attention output [group tokens, heads, head_dim] in row order."""
        if g.direct:
            if g.rows is not None:
                q, k, v = q[g.rows], k[g.rows], v[g.rows]
            qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            n = q.shape[0]
            with self._prefill_attention():
                if window is None or window >= n:
                    o = F.scaled_dot_product_attention(
                        qh, kh, vh, is_causal=n > 1, scale=scale, enable_gqa=True
                    )
                else:
                    idx = torch.arange(n, device=q.device)
                    diff = idx[:, None] - idx[None, :]
                    mask = (diff >= 0) & (diff < window)
                    o = F.scaled_dot_product_attention(
                        qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True
                    )
            return o[0].transpose(0, 1)
        assert g.q_index is not None and g.table is not None and g.masks is not None
        assert g.valid is not None
        kb, vb = self.cache.layer_blocks(layer)
        batch, blocks = g.table.shape
        ctx = blocks * self.block_size
        kg = kb[g.table].view(batch, ctx, kb.shape[2], kb.shape[3]).transpose(1, 2)
        vg = vb[g.table].view(batch, ctx, vb.shape[2], vb.shape[3]).transpose(1, 2)
        qg = q[g.q_index].transpose(1, 2)  # [B, heads, Q, d]
        with self._prefill_attention() if qg.shape[2] > 1 else contextlib.nullcontext():
            o = F.scaled_dot_product_attention(
                qg, kg, vg, attn_mask=g.masks[window], scale=scale, enable_gqa=True
            )
        o = o.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])  # [B*Q, heads, d]
        return o[g.valid]
