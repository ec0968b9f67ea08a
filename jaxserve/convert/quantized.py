"""Quantized Hugging Face checkpoints in: GPTQ, AWQ, compressed-tensors and FP8, unpacked into jaxserve's formats.

config.json's `quantization_config` (or `quantize_config.json` beside it, where older GPTQ tools wrote it) names
the method; `source_quantization(source)` reads it into a `SourceQuantization`, and `ImportedTensors` wraps the
shard reader so that the converter sees each quantized Linear as one tensor `<prefix>.weight` of the float
Linear's shape [out, in]. The converter then either asks for it in jaxserve's format (`read_quantized`: no
dequantization) or, with `--dequantize`, reads it as float32 like any other tensor.

    method (quant_method)         tensors of one Linear [N = out_features, K = in_features]     jaxserve scheme
    gptq  (AutoGPTQ/GPTQModel)    qweight i32 [K*b/32, N], qzeros i32 [K/G, N*b/32],            int{b}-g{G}[-zp][-act]
                                  scales f16 [K/G, N], g_idx i32 [K]                            (-ch for group -1)
    awq   (version gemm)          qweight i32 [K, N/8], qzeros i32 [K/G, N/8], scales [K/G, N]  int4-g{G}-zp
    compressed-tensors
      pack-quantized              weight_packed i32 [N, K*b/32], weight_scale [N, K/G | 1],     int{b}-g{G} | -ch
                                  weight_zero_point (packed i32 [N*b/32, K/G] or i8), weight_shape     [-zp]
      int-quantized               weight i8 [N, K], weight_scale [N, 1 | K/G]                   int8[-g{G}]
      float-quantized             weight f8_e4m3 [N, K], weight_scale [] | [N, 1] | blocks      fp8 | fp8-g{bk}
    fp8                           weight f8_e4m3 [N, K], weight_scale_inv [N/bn, K/bk]          fp8-g{bk}
                                  (weight_block_size [bn, bk]), or weight_scale [] (per tensor)  fp8

Packing (b bits, p = 32 / b values per int32 word, value i of a word at bits [b*i, b*i + b)): GPTQ packs qweight
along K and qzeros along N, both in plain order, and its v1 format ("gptq", the default) stores zero - 1 (so a
stored 15 with 4 bits means 16); "gptq_v2" stores the zero itself. AWQ packs along N in the interleaved order
0 2 4 6 1 3 5 7 (value i of word c is column 8c + AWQ_ORDER[i]). compressed-tensors packs along K (zero points
along N) in plain order, each value offset by 2^(b-1). Every method dequantizes as (q - zero) * scale per group
of G rows along K; act-order (`desc_act`, a g_idx that is not k // G) is stored sorted by group with the
permutation (see jaxserve.quant.schemes).

Left float whatever the checkpoint does: embeddings, norms, biases. The LM head is imported quantized when the
checkpoint quantized it, else it stays float; every decoder projection must be quantized the same way.
Activation quantization is dropped where it is float (FP8 `input_scale`s: jaxserve runs the FP8 weights with
bfloat16 activations, which only adds precision) and refused where it is integer (W8A8 int8).
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from jaxserve.convert.hf_source import ConvertError, HFSource, TensorReader
from jaxserve.quant import schemes

QUANTIZE_CONFIG = "quantize_config.json"
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
INT_STORAGE = ("I32",)
SCALE_STORAGE = ("F16", "BF16", "F32")
FP8_STORAGE = "F8_E4M3"
METHODS = ("gptq", "awq", "compressed-tensors", "fp8")
SUPPORTED = ("GPTQ 4/8-bit (group 32..128 or per channel, sym or asym, desc_act), AWQ 4-bit gemm, "
             "compressed-tensors pack-quantized / int-quantized W4A16 / W8A16 and float-quantized FP8, "
             "FP8 (per tensor or block scales)")

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One expected tensor of a quantized Linear: its shape and the safetensors dtypes it may have."""

    shape: Shape
    dtypes: tuple[str, ...]
    what: str  # for messages, e.g. "4-bit GPTQ qweight"


@dataclasses.dataclass(frozen=True)
class SourceQuantization:
    """What a checkpoint's quantization config says, checked against what jaxserve can import."""

    method: str  # gptq | awq | compressed-tensors | fp8
    origin: str  # where the config came from, for messages
    kind: str  # jaxserve storage: int8 | int4 | fp8
    bits: int
    group: int | None  # rows per scale along K; None: per output channel (or per tensor)
    zero_point: bool
    act_order: bool = False  # the config asks for it; the scheme keeps it only if some g_idx is not k // G
    gptq_v1: bool = False  # GPTQ zeros stored minus one
    layout: str = ""  # compressed-tensors format: pack-quantized | int-quantized | float-quantized
    block: tuple[int, int] | None = None  # FP8 [block_n, block_k] scales
    dropped_activations: str | None = None  # a float activation scheme jaxserve runs at 16 bits

    def scheme(self, act_order: bool) -> str:
        return schemes.format_name(self.kind, self.group, self.zero_point, act_order)

    def describe(self) -> str:
        if self.kind == "fp8":
            scales = "per-tensor or per-channel scales" if self.block is None else "block scales {}x{}".format(
                *self.block)
            return f"{self.method} FP8 e4m3 ({scales})"
        group = "per channel" if self.group is None else f"group {self.group}"
        return f"{self.method} {self.bits}-bit ({group}{', asymmetric' if self.zero_point else ''})"


def source_quantization(source: HFSource) -> SourceQuantization | None:
    """The checkpoint's quantization, or None for a float checkpoint; ConvertError names what is unsupported."""
    return _from_config(source.config, source.directory / "config.json")


def scheme_from_config(hf_config: dict, config_path: Path) -> tuple[str, str | None] | None:
    """(decoder scheme, LM head scheme) that importing would most likely give, from the config alone (for
    `jaxserve estimate`: act-order as desc_act says, the LM head quantized where the config says so)."""
    source = _from_config(hf_config, config_path)
    if source is None:
        return None
    config = hf_config.get("quantization_config") or {}
    ignored = config.get("ignore", ["lm_head"]) or []
    head = bool(config.get("lm_head")) or (source.method == "compressed-tensors"
                                           and not any("lm_head" in name for name in ignored))
    scheme = source.scheme(source.act_order and source.group is not None)
    return scheme, scheme if head and not hf_config.get("tie_word_embeddings") else None


def _from_config(hf_config: dict, config_path: Path) -> SourceQuantization | None:
    config, origin = hf_config.get("quantization_config"), f"{config_path} quantization_config"
    legacy = config_path.parent / QUANTIZE_CONFIG
    if config is None and legacy.exists():
        config, origin = json.loads(legacy.read_text()), str(legacy)
        config.setdefault("quant_method", "gptq")  # AutoGPTQ's file has no quant_method
    if config is None:
        return None
    method = str(config.get("quant_method", "")).lower()
    parsers = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors, "fp8": _fp8}
    if method not in parsers:
        raise ConvertError(f"{origin}: quant_method {method or None!r} is not one jaxserve imports; supported: "
                           f"{SUPPORTED}. Pass a float checkpoint, or convert this one to a supported format.")
    return parsers[method](config, origin)


def _refuse(origin: str, what: str) -> ConvertError:
    return ConvertError(f"{origin}: {what}; jaxserve imports {SUPPORTED}.")


def _bits(config: dict, origin: str, allowed: tuple[int, ...], key: str = "bits") -> int:
    bits = config.get(key)
    if bits not in allowed:
        raise _refuse(origin, f"{bits}-bit weights are not supported (only {' or '.join(map(str, allowed))}-bit)")
    return bits


def _group(config: dict, origin: str, key: str = "group_size") -> int | None:
    group = config.get(key, -1)
    if group in (-1, None):
        return None
    if not isinstance(group, int) or group <= 0 or group % schemes.MIN_GROUP_SIZE:
        raise _refuse(origin, f"{key} {group} is not supported (a multiple of {schemes.MIN_GROUP_SIZE}, or -1)")
    return group


def _gptq(config: dict, origin: str) -> SourceQuantization:
    layout = str(config.get("checkpoint_format") or config.get("format") or "gptq").lower()
    if config.get("is_marlin_format") or layout not in ("gptq", "gptq_v2"):
        raise _refuse(origin, f"GPTQ checkpoint_format {'marlin' if config.get('is_marlin_format') else layout!r} "
                              f"is a repacked kernel layout; re-export the model in the gptq (v1) or gptq_v2 format")
    if config.get("dynamic"):
        raise _refuse(origin, "GPTQ per-module overrides (dynamic) give layers different formats")
    bits = _bits(config, origin, (4, 8))
    return SourceQuantization("gptq", origin, f"int{bits}", bits, _group(config, origin),
                              zero_point=not config.get("sym", True), act_order=bool(config.get("desc_act")),
                              gptq_v1=layout == "gptq")


def _awq(config: dict, origin: str) -> SourceQuantization:
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(origin, f"AWQ version {version!r} is a kernel-specific layout (jaxserve reads the gemm one)")
    if not config.get("zero_point", True):
        raise _refuse(origin, "AWQ without zero points")
    bits = _bits(config, origin, (4,), "bits" if "bits" in config else "w_bit")
    group = _group(config, origin, "group_size" if "group_size" in config else "q_group_size")
    if group is None:
        raise _refuse(origin, "AWQ without groups (group_size -1)")
    return SourceQuantization("awq", origin, "int4", bits, group, zero_point=True)


def _compressed_tensors(config: dict, origin: str) -> SourceQuantization:
    groups = list((config.get("config_groups") or {}).values())
    if not groups:
        raise _refuse(origin, "compressed-tensors without config_groups")
    weights = [g.get("weights") for g in groups]
    if any(w != weights[0] for w in weights) or weights[0] is None:
        raise _refuse(origin, "compressed-tensors config_groups with different (or no) weight schemes per group")
    layout = str(groups[0].get("format") or config.get("format") or "").lower()
    w, activations = weights[0], groups[0].get("input_activations")
    if w.get("actorder") == "group":
        act_order = True
    elif w.get("actorder") in (None, "weight", "static", False):
        act_order = False
    else:
        raise _refuse(origin, f"compressed-tensors actorder {w.get('actorder')!r}")
    strategy = w.get("strategy")
    if w.get("type", "int") == "float":
        return _compressed_fp8(w, activations, layout, origin)
    if activations is not None:
        raise _refuse(origin, f"compressed-tensors {w.get('num_bits')}-bit weights with "
                              f"{activations.get('num_bits')}-bit integer activations (W{w.get('num_bits')}A"
                              f"{activations.get('num_bits')}) need integer activation kernels jaxserve has not")
    if layout not in ("pack-quantized", "int-quantized", "naive-quantized"):
        raise _refuse(origin, f"compressed-tensors format {layout!r}")
    bits = _bits(w, origin, (4, 8) if layout == "pack-quantized" else (8,), "num_bits")
    if strategy not in ("group", "channel"):
        raise _refuse(origin, f"compressed-tensors integer strategy {strategy!r} (group and channel are read)")
    group = _group(w, origin) if strategy == "group" else None
    return SourceQuantization("compressed-tensors", origin, f"int{bits}", bits, group,
                              zero_point=not w.get("symmetric", True), act_order=act_order,
                              layout="pack-quantized" if layout == "pack-quantized" else "int-quantized")


def _compressed_fp8(w: dict, activations: dict | None, layout: str, origin: str) -> SourceQuantization:
    if layout != "float-quantized" or w.get("num_bits") != 8:
        raise _refuse(origin, f"compressed-tensors {w.get('num_bits')}-bit float weights in format {layout!r}")
    if activations is not None and activations.get("type", "int") != "float":
        raise _refuse(origin, "FP8 weights with integer activations")
    strategy, block = w.get("strategy"), None
    if strategy == "block":
        block = tuple(w.get("block_structure") or ())
    elif strategy not in ("tensor", "channel"):
        raise _refuse(origin, f"compressed-tensors FP8 strategy {strategy!r} (tensor, channel and block are read)")
    return _fp8_source("compressed-tensors", origin, block, activations is not None, "float-quantized")


def _fp8(config: dict, origin: str) -> SourceQuantization:
    if str(config.get("fmt", "e4m3")).lower() != "e4m3":
        raise _refuse(origin, f"FP8 format {config.get('fmt')!r} (jaxserve reads e4m3)")
    block = config.get("weight_block_size")
    return _fp8_source("fp8", origin, tuple(block) if block else None, True, "")


def _fp8_source(method: str, origin: str, block, activations: bool, layout: str) -> SourceQuantization:
    if block is not None and (len(block) != 2 or block[0] < 1 or block[1] % schemes.TILE_ROWS["fp8"]):
        raise _refuse(origin, f"FP8 block scales {list(block)} (blocks of [rows, k] with k a multiple of 16)")
    return SourceQuantization(method, origin, "fp8", 8, None if block is None else block[1], False, layout=layout,
                              block=block, dropped_activations="FP8 activations" if activations else None)


# ---------------------------------------------------------------------------------------------- tensors


class ImportedTensors:
    """A TensorReader over a quantized checkpoint, seen as the float checkpoint it encodes: each quantized Linear
    `<prefix>` appears as one tensor `<prefix>.weight` [N, K] (dtype "F32"), its own tensors disappear.

    `linears` maps the HF names the converter expects (`<prefix>.weight`) to (N, K); those of them the
    checkpoint quantized are found by their tensors, checked (names, shapes, dtypes, g_idx) on construction,
    and read with `read_quantized` (jaxserve's matrix view arrays) or `read` (dequantized, float32). `as_float`
    (--dequantize): the converter reads every Linear with `read`."""

    def __init__(self, reader: TensorReader, source: SourceQuantization, linears: dict[str, Shape],
                 as_float: bool = False):
        self._reader, self.source, self.as_float = reader, source, as_float
        names = reader.names
        layouts = {name: _Linear.of(source, name.removesuffix(".weight"), *shape) for name, shape in linears.items()}
        self._layouts = {name: lin for name, lin in layouts.items() if lin.present(reader, names)}
        if not self._layouts:
            raise ConvertError(f"{source.origin} says the checkpoint is {source.describe()}, but no Linear has its "
                               f"tensors (e.g. {_Linear.of(source, 'model.layers.0.mlp.up_proj', 1, 1).marker}); "
                               f"check that quantization_config belongs to these weights.")
        owned = {t for lin in self._layouts.values() for t in lin.tensors}
        self._names = (names - owned) | set(self._layouts)
        for lin in self._layouts.values():
            lin.check(reader)
        self._perms = {name: lin.group_order(reader) for name, lin in self._layouts.items()}
        self.act_order = any(p is not None for p in self._perms.values())

    @property
    def names(self) -> set[str]:
        return self._names

    def is_quantized(self, name: str) -> bool:
        return name in self._layouts

    def stays_quantized(self, name: str) -> bool:
        """Whether the converter stores `name` as imported (read_quantized) rather than from `read`."""
        return not self.as_float and name in self._layouts

    @property
    def scheme(self) -> str:
        return self.source.scheme(self.act_order)

    def shard(self, name: str) -> Path:
        lin = self._layouts.get(name)
        return self._reader.shard(lin.marker if lin else name)

    def shape(self, name: str) -> Shape:
        lin = self._layouts.get(name)
        return (lin.n, lin.k) if lin else self._reader.shape(name)

    def dtype(self, name: str) -> str:
        return "F32" if name in self._layouts else self._reader.dtype(name)

    def read(self, name: str) -> np.ndarray:
        """A float tensor as stored, or a quantized Linear dequantized to float32 [N, K] (--dequantize)."""
        if name not in self._layouts:
            return self._reader.read(name)
        arrays = self.read_quantized(name)
        w = schemes.dequantize(arrays["values"], arrays["scales"], 1, self.scheme, zeros=arrays.get("zeros"),
                               perm=arrays.get("perm"))
        return np.asarray(w).T

    def read_quantized(self, name: str) -> dict[str, np.ndarray]:
        """The Linear in jaxserve's matrix view ([K (/ 2), N] values, scales, zeros, perm) for `self.scheme`."""
        lin, perm = self._layouts[name], self._perms[name]
        q, scales, zeros = lin.read(self._reader)  # q: integers [K, N] in the signed domain, or fp8
        if perm is not None:
            q = q[perm]
        elif self.act_order:
            perm = np.arange(lin.k, dtype=np.int32)
        values = schemes.pack_int4(q) if lin.source.kind == "int4" else q.astype(schemes.VALUE_DTYPES[lin.source.kind])
        out = {"values": np.asarray(values), "scales": scales.astype(np.float32)}
        if zeros is not None:
            out["zeros"] = zeros.astype(np.float32).astype(schemes.ZEROS_DTYPE)
        if perm is not None:
            out["perm"] = perm.astype(np.int32)
        return out


@dataclasses.dataclass
class _Linear:
    """One quantized Linear of a checkpoint: its tensors and how to unpack them. Subclasses per method."""

    source: SourceQuantization
    prefix: str
    n: int
    k: int

    @staticmethod
    def of(source: SourceQuantization, prefix: str, n: int, k: int) -> "_Linear":
        cls = {"gptq": _GPTQ, "awq": _AWQ, "fp8": _FP8}.get(source.method)
        if cls is None:
            cls = _PackQuantized if source.layout == "pack-quantized" else _FP8 if source.kind == "fp8" else _Naive
        return cls(source, prefix, n, k)

    @property
    def marker(self) -> str:
        """The tensor whose presence says this Linear is quantized."""
        raise NotImplementedError

    @property
    def tensors(self) -> dict[str, Tensor]:
        """Every tensor of this Linear the format writes (required and optional), by full name."""
        raise NotImplementedError

    optional: ClassVar[tuple[str, ...]] = ()  # suffixes that may be absent

    def present(self, reader: TensorReader, names: set[str]) -> bool:
        """Whether the checkpoint stores this Linear quantized."""
        return self.marker in names

    def read(self, reader: TensorReader) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(q [K, N] signed integers or fp8 values, scales [N] or [K / G, N], zeros like scales or None)."""
        raise NotImplementedError

    def g_idx(self, reader: TensorReader) -> np.ndarray | None:
        return None

    @property
    def groups(self) -> int:
        return 1 if self.source.group is None else self.k // self.source.group

    def name(self, suffix: str) -> str:
        return f"{self.prefix}.{suffix}"

    def check(self, reader: TensorReader) -> None:
        if self.source.group is not None and self.k % self.source.group:
            raise ConvertError(f"{self.prefix}: group size {self.source.group} ({self.source.origin}) does not "
                               f"divide its in_features {self.k}; check that the config belongs to these weights.")
        float_weight = self.name("weight")
        if float_weight in reader.names and float_weight not in self.tensors:
            raise ConvertError(f"{self.prefix} has both a float weight and {self.source.method} tensors; the "
                               f"checkpoint is inconsistent, download it again.")
        for name, want in self.tensors.items():
            if name not in reader.names:
                if any(name.endswith("." + s) for s in self.optional):
                    continue
                raise ConvertError(f"{self.prefix} lacks {name} ({want.what}); the checkpoint is incomplete or not "
                                   f"{self.source.describe()} as {self.source.origin} says.")
            shape, dtype = reader.shape(name), reader.dtype(name)
            if dtype not in want.dtypes:
                raise ConvertError(f"tensor {name} is stored as {dtype}; a {want.what} is "
                                   f"{' or '.join(want.dtypes)}.")
            if want.shape is not None and tuple(shape) != want.shape:
                raise ConvertError(
                    f"tensor {name} has shape {list(shape)}, but a {want.what} of a Linear with in_features "
                    f"{self.k} and out_features {self.n} is {list(want.shape)} ({self.source.describe()}, as "
                    f"{self.source.origin} says); the file is truncated or the config does not match it.")

    def group_order(self, reader: TensorReader) -> np.ndarray | None:
        """The act-order permutation (rows sorted by group) when g_idx is not k // G, else None."""
        g_idx = self.g_idx(reader)
        if g_idx is None or self.source.group is None:
            return None
        g = g_idx.astype(np.int64)
        trivial = np.arange(self.k) // self.source.group
        if np.array_equal(g, trivial):
            return None
        counts = np.bincount(np.clip(g, 0, self.groups), minlength=self.groups + 1)
        if g.min() < 0 or counts[self.groups] or np.any(counts[:self.groups] != self.source.group):
            raise ConvertError(f"{self.prefix}: its g_idx does not put {self.source.group} rows in each of its "
                               f"{self.groups} groups; the checkpoint is damaged or its group size is not "
                               f"{self.source.group}.")
        return np.argsort(g, kind="stable").astype(np.int32)


def unpack(packed: np.ndarray, bits: int, axis: int, count: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """int32 words packed along `axis` (value i of a word at bits [bits*i, bits*i + bits)) -> unsigned values
    (uint16) with `count` entries along `axis`; `order[i]` says where value i of a word goes within its word's
    span (AWQ), else in order."""
    per_word = 32 // bits
    words = np.ascontiguousarray(packed).view(np.uint32)
    if axis == 0:
        words = words.T
    shifts = np.arange(per_word, dtype=np.uint32) * bits
    values = ((words[:, :, None] >> shifts) & ((1 << bits) - 1)).astype(np.uint16)  # [rows, words, per_word]
    if order is not None:
        reordered = np.empty_like(values)
        reordered[:, :, list(order)] = values
        values = reordered
    values = values.reshape(words.shape[0], -1)[:, :count]
    return values.T if axis == 0 else values


def _float(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(np.float32)


class _GPTQ(_Linear):
    optional = ("g_idx",)

    @property
    def marker(self) -> str:
        return self.name("qweight")

    @property
    def tensors(self) -> dict[str, Tensor]:
        b, per = self.source.bits, 32 // self.source.bits
        what = f"{b}-bit GPTQ"
        return {self.name("qweight"): Tensor((self.k // per, self.n), INT_STORAGE, f"{what} qweight"),
                self.name("qzeros"): Tensor((self.groups, -(-self.n // per)), INT_STORAGE, f"{what} qzeros"),
                self.name("scales"): Tensor((self.groups, self.n), SCALE_STORAGE, f"{what} scales"),
                self.name("g_idx"): Tensor((self.k,), INT_STORAGE, f"{what} g_idx")}

    def g_idx(self, reader):
        name = self.name("g_idx")
        return reader.read(name) if name in reader.names else None

    def check(self, reader):
        super().check(reader)
        if not self.source.zero_point:  # sym: the (small) qzeros must hold the middle value; checked up front
            _check_symmetric(self, self._zeros(reader))

    def _zeros(self, reader) -> np.ndarray:
        """[groups, N] zero points in the signed domain (GPTQ v1 stores zero - 1)."""
        zeros = unpack(reader.read(self.name("qzeros")), self.source.bits, 1, self.n).astype(np.int32)
        return zeros + (1 if self.source.gptq_v1 else 0) - (1 << (self.source.bits - 1))

    def read(self, reader):
        bits, offset = self.source.bits, 1 << (self.source.bits - 1)
        q = unpack(reader.read(self.name("qweight")), bits, 0, self.k).astype(np.int32) - offset
        scales = _float(reader.read(self.name("scales")))
        return q, *_scales_and_zeros(self, scales, self._zeros(reader))


class _AWQ(_Linear):
    @property
    def marker(self) -> str:
        return self.name("qweight")

    @property
    def tensors(self) -> dict[str, Tensor]:
        return {self.name("qweight"): Tensor((self.k, self.n // 8), INT_STORAGE, "4-bit AWQ qweight"),
                self.name("qzeros"): Tensor((self.groups, self.n // 8), INT_STORAGE, "4-bit AWQ qzeros"),
                self.name("scales"): Tensor((self.groups, self.n), SCALE_STORAGE, "4-bit AWQ scales")}

    def check(self, reader):
        if self.n % 8:
            raise ConvertError(f"{self.prefix}: out_features {self.n} is not a multiple of 8, which AWQ's packing "
                               f"needs; the config does not match the weights.")
        super().check(reader)

    def read(self, reader):
        q = unpack(reader.read(self.name("qweight")), 4, 1, self.n, AWQ_ORDER).astype(np.int32) - 8
        zeros = unpack(reader.read(self.name("qzeros")), 4, 1, self.n, AWQ_ORDER).astype(np.int32) - 8
        return q, _float(reader.read(self.name("scales"))), zeros


class _PackQuantized(_Linear):
    optional = ("weight_g_idx",)

    @property
    def marker(self) -> str:
        return self.name("weight_packed")

    @property
    def tensors(self) -> dict[str, Tensor]:
        b = self.source.bits
        what = f"{b}-bit compressed-tensors pack-quantized"
        scale_cols = 1 if self.source.group is None else self.groups
        out = {self.name("weight_packed"): Tensor((self.n, -(-self.k * b // 32)), INT_STORAGE, f"{what} weight"),
               self.name("weight_scale"): Tensor((self.n, scale_cols), SCALE_STORAGE, f"{what} weight_scale"),
               self.name("weight_shape"): Tensor((2,), ("I32", "I64"), f"{what} weight_shape"),
               self.name("weight_g_idx"): Tensor((self.k,), INT_STORAGE, f"{what} weight_g_idx")}
        if self.source.zero_point:
            out[self.name("weight_zero_point")] = Tensor(None, ("I32", "I8"), f"{what} weight_zero_point")
        return out

    def check(self, reader):
        super().check(reader)
        shape = [int(d) for d in reader.read(self.name("weight_shape"))]
        if shape != [self.n, self.k]:
            raise ConvertError(f"{self.name('weight_shape')} says {shape}, but the model's config implies "
                               f"[{self.n}, {self.k}]; check that config.json belongs to these weights.")
        if self.source.zero_point:
            b, cols = self.source.bits, 1 if self.source.group is None else self.groups
            zp = self.name("weight_zero_point")
            want = (-(-self.n * b // 32), cols) if reader.dtype(zp) == "I32" else (self.n, cols)
            if tuple(reader.shape(zp)) != want:
                raise ConvertError(f"tensor {zp} has shape {list(reader.shape(zp))}, but the zero points of a Linear "
                                   f"with out_features {self.n} are {list(want)}; the file is truncated or the "
                                   f"config does not match it.")

    def g_idx(self, reader):
        name = self.name("weight_g_idx")
        return reader.read(name) if name in reader.names else None

    def read(self, reader):
        bits, offset = self.source.bits, 1 << (self.source.bits - 1)
        q = unpack(reader.read(self.name("weight_packed")), bits, 1, self.k).astype(np.int32).T - offset
        zeros = None
        if self.source.zero_point:
            zp = reader.read(self.name("weight_zero_point"))
            zeros = (unpack(zp, bits, 0, self.n).astype(np.int32) - offset if zp.dtype == np.int32
                     else zp.astype(np.int32)).T
        return q, *_scales_and_zeros(self, _float(reader.read(self.name("weight_scale"))).T, zeros)


class _Naive(_Linear):
    """compressed-tensors int-quantized: int8 `weight` [N, K] with weight_scale [N, 1 | K / G]."""

    @property
    def marker(self) -> str:
        return self.name("weight_scale")

    @property
    def tensors(self) -> dict[str, Tensor]:
        cols = 1 if self.source.group is None else self.groups
        out = {self.name("weight"): Tensor((self.n, self.k), ("I8",), "compressed-tensors int8 weight"),
               self.name("weight_scale"): Tensor((self.n, cols), SCALE_STORAGE, "compressed-tensors weight_scale")}
        if self.source.zero_point:
            out[self.name("weight_zero_point")] = Tensor((self.n, cols), ("I8", "I32"),
                                                         "compressed-tensors weight_zero_point")
        return out

    def read(self, reader):
        q = reader.read(self.name("weight")).astype(np.int32).T
        zeros = reader.read(self.name("weight_zero_point")).astype(np.int32).T if self.source.zero_point else None
        return q, *_scales_and_zeros(self, _float(reader.read(self.name("weight_scale"))).T, zeros)


class _FP8(_Linear):
    """FP8 e4m3 `weight` [N, K]: HF fp8 (`weight_scale_inv` blocks, or a per-tensor `weight_scale`) or
    compressed-tensors float-quantized (`weight_scale` per tensor, per channel [N, 1] or per block)."""

    optional = ("input_scale",)

    @property
    def marker(self) -> str:
        return self.name("weight")

    def present(self, reader, names):
        return self.marker in names and reader.dtype(self.marker) == FP8_STORAGE

    @property
    def scale_name(self) -> str:
        return self.name("weight_scale_inv" if self.source.method == "fp8" and self.source.block else "weight_scale")

    @property
    def tensors(self) -> dict[str, Tensor]:
        return {self.name("weight"): Tensor((self.n, self.k), (FP8_STORAGE,), "FP8 weight"),
                self.scale_name: Tensor(self._scale_shape(), SCALE_STORAGE, "FP8 weight scale"),
                self.name("input_scale"): Tensor(None, SCALE_STORAGE, "FP8 activation scale (unused)")}

    def _scale_shape(self) -> Shape | None:
        if self.source.block is not None:
            bn, bk = self.source.block
            return (-(-self.n // bn), -(-self.k // bk))
        return None  # per tensor ([] or [1]) or per channel ([N, 1]): checked in read

    def read(self, reader):
        q = read_fp8(reader, self.name("weight")).T
        s = _float(reader.read(self.scale_name))
        if self.source.block is not None:
            bn, _ = self.source.block
            return q, np.repeat(s.T, bn, axis=1)[:, :self.n], None  # [K / bk, N]: the block scale per column
        if s.size == 1:
            return q, np.full(self.n, s.reshape(()), np.float32), None
        if s.shape not in ((self.n, 1), (self.n,)):
            raise ConvertError(f"tensor {self.scale_name} has shape {list(s.shape)}; FP8 scales are per tensor "
                               f"([] or [1]), per channel ([{self.n}, 1]) or per block (weight_block_size).")
        return q, s.reshape(self.n), None


def _check_symmetric(lin: _Linear, zeros: np.ndarray) -> None:
    if np.any(zeros):
        raise ConvertError(f"{lin.prefix}: {lin.source.origin} says sym, but its zero points are not the "
                           f"symmetric ones; re-export the checkpoint or fix sym in the config.")


def _scales_and_zeros(lin: _Linear, scales: np.ndarray, zeros: np.ndarray | None):
    """[groups, N] scales / zeros -> [N] for per-channel formats; a symmetric format's zeros (0) are dropped."""
    if zeros is not None and not lin.source.zero_point:
        _check_symmetric(lin, zeros)
        zeros = None
    if lin.source.group is None:
        return scales.reshape(lin.n), None if zeros is None else zeros.reshape(lin.n)
    return scales, zeros


def read_fp8(reader: TensorReader, name: str) -> np.ndarray:
    """An F8_E4M3 tensor as float8_e4m3fn (safetensors' numpy reader has no fp8 type): read from the
    shard's header and data directly (memory-mapped)."""
    path = reader.shard(name)
    with open(path, "rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        entry = json.loads(f.read(header_len))[name]
    begin, end = entry["data_offsets"]
    data = np.memmap(path, np.uint8, "r", offset=8 + header_len + begin, shape=(end - begin,))
    return np.asarray(data).view(schemes.VALUE_DTYPES["fp8"]).reshape(entry["shape"])


def quantized_linears(targets: dict[str, Any]) -> dict[str, Shape]:
    """The HF `<prefix>.weight` names among the converter's targets that a checkpoint may quantize (every 2-D
    projection weight: [out, in]), with their HF shapes."""
    return {name: tuple(t.hf_shape) for name, t in targets.items()
            if name.endswith(".weight") and len(t.hf_shape) == 2 and not name.endswith("embed_tokens.weight")}

