"""q8 checkpoints: symmetric int8 with one scale per group of input columns, stored in device layout.

A linear weight ``W [N, K]`` (out, in) named ``<p>.weight`` is replaced by two tensors::

    <p>.qweight  I8  [K, Npad]         q[k, n] = round(W[n, k] / s[k // g, n]), clamped to -127..127
    <p>.scales   F32 [K // g, Npad]    s[j, n] = max |W[n, k]| over the g inputs k of group j, / 127

``Npad`` is ``N`` rounded up to a multiple of ``N_ALIGN`` (64): every row of both tensors
then starts 64-byte aligned, and a kernel thread can load 8 (or 16) columns at once without
bounds checks. Pad columns are zero in both tensors. A group whose weights are all zero has
scale 0 (and q 0). The writer puts each ``qweight`` right before its ``scales`` in the file,
so one entry is one contiguous byte range of the mapping.

A Mixture-of-Experts (``qwen3_moe``) checkpoint is quantized the same way, tensor by tensor:
a sparse layer's q/k/v/o and every expert's ``mlp.experts.E.{gate,up,down}_proj`` become
``.qweight``/``.scales`` pairs named as above, and a dense layer of it (``mlp_only_layers``)
quantizes its seven linears like a dense model's. The router (``mlp.gate.weight``,
``[num_experts, hidden]``) keeps its original dtype (``FLOAT_ROLES``).

Embeddings and norms keep their original dtype. ``lm_head`` is quantized unless
``keep_lm_head``. A tied model (``tie_word_embeddings``) with a quantized lm_head is untied:
the embedding stays full precision for the lookup, a q8 copy of it becomes ``lm_head``, and
config.json says ``tie_word_embeddings: false``. With ``keep_lm_head`` a tied model stays tied.

A GGUF's Q8_0 weight (one f16 scale a block of 32 int8 values) is this format with group 32, stored as
ggml's blocks: its ``Q8Tensor`` is ``packed``, one stored tensor that the GGUF reader repacks into this
layout as it is read (``read_q8``), with no rounding.

The safetensors metadata records it: ``kestrel.quant = "q8"``, ``kestrel.group_size``,
``kestrel.lm_head = "q8" | "full"``, ``kestrel.n_align``, ``kestrel.layout`` and
``kestrel.untied`` (``"true"`` when a tied lm_head was split off). The output is
deterministic: the same input gives byte-identical files.
"""

from __future__ import annotations

import attrs
import torch

from kestrel_core.formats.checkpoint import Checkpoint
from kestrel_core.errors import CheckpointError, KestrelError
from kestrel_core.formats.modelconfig import ModelConfig
from kestrel_core.formats.tensor_table import unit_specs

GROUP_SIZES = (32, 64, 128)
N_ALIGN = 64
METHOD = "q8"
META_QUANT = "kestrel.quant"
META_GROUP = "kestrel.group_size"
META_LM_HEAD = "kestrel.lm_head"
META_N_ALIGN = "kestrel.n_align"
META_LAYOUT = "kestrel.layout"
META_UNTIED = "kestrel.untied"
LAYOUT = "qweight I8 [K, Npad] then scales F32 [K/group, Npad]; W[n, k] = qweight[k, n] * scales[k // group, n]"
QMAX = 127
# Streamed roles that stay in the checkpoint's float dtype. The router of a sparse layer is small
# ([num_experts, hidden]: 0.5 MB of Qwen3-30B-A3B's 1.2 GB layer in bf16) and decides which experts
# run: int8 rounding of its weights would move its logits, flip near ties in the top-k and change the routing.
FLOAT_ROLES = frozenset({"router"})


class QuantError(KestrelError):
    """A quantization request that cannot be carried out."""


class GroupSizeError(QuantError):
    """The group size is not supported, or does not divide a weight's input dimension."""


class AlreadyQuantizedError(QuantError):
    """The input checkpoint holds quantized weights already."""


# --- layout -----------------------------------------------------------------------
def pad_n(n: int, align: int = N_ALIGN) -> int:
    return -(-n // align) * align


def q8_names(weight_name: str) -> tuple[str, str]:
    """``<p>.weight`` -> (``<p>.qweight``, ``<p>.scales``)."""
    prefix = weight_name[: -len(".weight")] if weight_name.endswith(".weight") else weight_name
    return prefix + ".qweight", prefix + ".scales"


def layout_nbytes(k: int, group: int, npad: int) -> int:
    """Bytes of one q8 linear in device layout: int8 qweight [K, Npad] + f32 scales [K/group, Npad]."""
    return k * npad + (k // group) * npad * 4


def q8_nbytes(n: int, k: int, group: int, align: int = N_ALIGN) -> int:
    """Bytes of one q8 linear of N outputs in device layout (qweight + scales)."""
    return layout_nbytes(k, group, pad_n(n, align))


@attrs.frozen
class Q8Tensor:
    """Where one quantized linear ``W [n, k]`` lives in a checkpoint."""

    name: str  # the ``.weight`` name it stands for
    qweight: str
    scales: str
    n: int
    k: int
    group: int
    n_pad: int
    packed: bool = False  # stored as one tensor of another format's blocks (a GGUF's Q8_0), repacked by ``read_q8``

    @property
    def stored(self) -> tuple[str, ...]:
        """The checkpoint tensors it is stored as (what a reader maps, and drops the pages of)."""
        return (self.name,) if self.packed else (self.qweight, self.scales)

    @property
    def n_groups(self) -> int:
        return self.k // self.group

    @property
    def nbytes(self) -> int:
        return self.k * self.n_pad + self.n_groups * self.n_pad * 4

    @property
    def layout(self) -> tuple:
        """Geometry.layout for a buffer of this entry: q8 and float buffers never share a pool key."""
        return (METHOD, self.n_pad, self.n_groups)


@attrs.frozen
class QuantInfo:
    """A q8 checkpoint's quantization, read from its metadata and checked against its tensors."""

    method: str
    group_size: int
    lm_head: str  # "q8" or "full"
    n_align: int
    tensors: dict  # ``.weight`` name -> Q8Tensor

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.tensors)

    def get(self, weight_name: str) -> Q8Tensor | None:
        return self.tensors.get(weight_name)

    def stored_names(self) -> dict[str, tuple[str, str]]:
        """Each quantized ``.weight`` name -> the tensors it is stored as."""
        return {name: t.stored for name, t in self.tensors.items()}


def quantized_specs(cfg: ModelConfig, lm_head: bool) -> dict[str, tuple[int, int]]:
    """``.weight`` name -> [N, K] of every linear a q8 checkpoint stores quantized, in unit order: each
    layer's own unit (a dense layer's seven linears, a sparse layer's q/k/v/o), then that layer's experts
    (gate, up, down each). The router (``FLOAT_ROLES``) is not among them."""
    out = {name: tuple(shape) for unit in unit_specs(cfg) for role, (name, shape) in unit.tensors.items()
           if role not in FLOAT_ROLES}
    if lm_head:
        out["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return out


def looks_quantized(ckpt: Checkpoint) -> bool:
    return any(n.endswith((".qweight", ".scales")) for n in ckpt.names())


def read_quant(ckpt: Checkpoint, cfg: ModelConfig) -> QuantInfo | None:
    """The checkpoint's q8 description, or None for a float checkpoint. A q8 tensor of the wrong
    dtype or shape is a CheckpointError naming it."""
    meta = ckpt.metadata
    method = meta.get(META_QUANT)
    if method is None:
        if looks_quantized(ckpt):
            raise CheckpointError(
                f"{ckpt.dir}: has .qweight/.scales tensors but no {META_QUANT!r} metadata; re-create it with kestrel quantize"
            )
        return None
    if method != METHOD:
        raise CheckpointError(f"{ckpt.dir}: quantization {method!r} is not supported; supported: {METHOD}")
    try:
        group = int(meta.get(META_GROUP, ""))
        align = int(meta.get(META_N_ALIGN, str(N_ALIGN)))
    except ValueError:
        raise CheckpointError(f"{ckpt.dir}: metadata {META_GROUP}/{META_N_ALIGN} must be integers; the file is corrupt") from None
    if group not in GROUP_SIZES:
        raise CheckpointError(f"{ckpt.dir}: {META_GROUP}={group} is not one of {', '.join(map(str, GROUP_SIZES))}")
    if align <= 0 or align % 8:
        raise CheckpointError(f"{ckpt.dir}: {META_N_ALIGN}={align} must be a positive multiple of 8")
    lm_head = meta.get(META_LM_HEAD, "full")
    if lm_head not in ("q8", "full"):
        raise CheckpointError(f"{ckpt.dir}: {META_LM_HEAD}={lm_head!r} must be 'q8' or 'full'")
    if lm_head == "q8" and cfg.tie_word_embeddings:
        raise CheckpointError(f"{ckpt.dir}: lm_head is q8 but config.json ties it to the embeddings; set tie_word_embeddings false")
    tensors = {}
    for name, (n, k) in quantized_specs(cfg, lm_head == "q8").items():
        if k % group:
            raise CheckpointError(f"{ckpt.dir}: {META_GROUP}={group} does not divide K={k} of {name!r}; the file is corrupt")
        qname, sname = q8_names(name)
        npad = pad_n(n, align)
        for tname, dtype, shape in ((qname, "I8", (k, npad)), (sname, "F32", (k // group, npad))):
            info = ckpt.info(tname)
            if info.dtype != dtype or tuple(info.shape) != shape:
                raise CheckpointError(
                    f"tensor {tname!r} is {info.dtype} {list(info.shape)} but a q8 [{n}, {k}] weight with group {group} "
                    f"needs {dtype} {list(shape)}; config.json and the weights do not match"
                )
        tensors[name] = Q8Tensor(name, qname, sname, n, k, group, npad)
    return QuantInfo(method, group, lm_head, align, tensors)


def read_q8(ckpt, t: Q8Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t``'s qweight int8 [K, Npad] and scales f32 [K/group, Npad]: views of its two stored tensors, or, where it is
    ``packed``, its GGUF Q8_0 tensor repacked into this layout (``GGUFCheckpoint.q8``, no rounding)."""
    if t.packed:
        return ckpt.q8(t.name)
    return ckpt.view(t.qweight), ckpt.view(t.scales)


# --- the math ---------------------------------------------------------------------
def quantize(w: torch.Tensor, group: int, align: int = N_ALIGN) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] (any float dtype) -> qweight int8 [K, Npad], scales f32 [K/group, Npad]."""
    n, k = w.shape
    if group not in GROUP_SIZES:
        raise GroupSizeError(f"group size {group} is not supported; use one of {', '.join(map(str, GROUP_SIZES))}")
    if k % group:
        raise GroupSizeError(f"group size {group} does not divide K={k}")
    g = w.float().reshape(n, k // group, group)
    lo, hi = torch.aminmax(g, dim=-1)
    scale = torch.maximum(hi, -lo) / QMAX  # [N, G]: max |W| of each group / 127
    if not torch.isfinite(scale).all():
        raise QuantError("the weight holds inf or nan values; cannot quantize it")
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.div(g, safe[..., None])  # a true division (not a reciprocal multiply): the bound holds to an ulp
    q.round_().clamp_(-QMAX, QMAX)  # round half to even
    q = q.to(torch.int8).reshape(n, k)
    npad = pad_n(n, align)
    qweight = torch.zeros((k, npad), dtype=torch.int8, device=w.device)
    qweight[:, :n] = q.T
    scales = torch.zeros((k // group, npad), dtype=torch.float32, device=w.device)
    scales[:, :n] = scale.T
    return qweight, scales


def dequantize_into(out: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """Fill ``out [N, K]`` (float) with W[n, k] = qweight[k, n] * scales[k // group, n]."""
    n, k = out.shape
    q = qweight[:, :n].to(out.dtype).reshape(k // group, group, n)
    q.mul_(scales[:, None, :n].to(out.dtype))
    return out.copy_(q.reshape(k, n).T)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, n: int, group: int, dtype=torch.float32) -> torch.Tensor:
    return dequantize_into(torch.empty((n, qweight.shape[0]), dtype=dtype), qweight, scales, group)


__all__ = [
    "AlreadyQuantizedError",
    "GROUP_SIZES",
    "GroupSizeError",
    "N_ALIGN",
    "Q8Tensor",
    "QuantError",
    "QuantInfo",
    "dequantize",
    "dequantize_into",
    "pad_n",
    "q8_names",
    "q8_nbytes",
    "quantize",
    "read_q8",
    "read_quant",
]
