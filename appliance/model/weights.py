"""Checkpoint reading: safetensors shards (single file or with an index), memory-mapped, addressed by
DeepSeek's official tensor names.

Other spellings load through TRANSFORMERS_TO_OFFICIAL, one ordered table of renames (the names of
transformers' in-memory modules, of its `save_pretrained` output, and of exporters that prefix `model.`
or use `weight_scale_inv`), plus the one structural change: transformers stacks routed experts into
`experts.gate_up_proj [E, 2I, D]` and `experts.down_proj [E, D, I]`, which are sliced back into the
official per-expert `w1`, `w3`, `w2`.

Loading is declarative: the model asks for each tensor by official name and expected shape; problems are
collected, and `Checkpoint.finish()` raises one WeightsError listing every missing, mis-shaped and
unexpected tensor at once.
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from appliance.errors import WeightsError
from kernels.linear import PackedWeight

# Applied in order to every stored name that is not already official. Left: regex on the stored name;
# right: replacement. Covers transformers' module names and its save_pretrained output, whose reverse
# mapping leaves `model.` prefixes and turns the attention's `kv_norm` into `attn.norm`.
TRANSFORMERS_TO_OFFICIAL: tuple[tuple[str, str], ...] = (
    (r"^model\.", ""),
    (r"^embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.sinks$", ".attn_sink"),
    (r"\.compressor\.indexer\.scorer\.weights_proj\.", ".indexer.weights_proj."),
    (r"\.compressor\.indexer\.q_b_proj\.", ".indexer.wq_b."),
    (r"\.compressor\.indexer\.", ".indexer.compressor."),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.attn\.norm\.weight$", ".attn.kv_norm.weight"),
    (r"\.position_bias$", ".ape"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.weight_scale_inv$", ".scale"),
)
_RULES = tuple((re.compile(p), r) for p, r in TRANSFORMERS_TO_OFFICIAL)
_STACKED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")

# the first entry is the official storage dtype (what a shape-only checkpoint counts)
_FLOAT_DTYPES = (torch.bfloat16, torch.float32, torch.float16)


def official_name(stored: str) -> str:
    name = stored
    for pattern, repl in _RULES:
        name = pattern.sub(repl, name)
    return name


@dataclass(frozen=True)
class _Ref:
    """Where an official tensor lives: file, stored key, and an optional slice of a stacked tensor."""

    file: str
    key: str
    index: tuple | None = None


class Checkpoint:
    """A model directory's safetensors, memory-mapped. Tensors are fetched by official name."""

    def __init__(self, model_dir):
        self.dir = Path(model_dir)
        files = self._shard_files()
        self._handles = {f: safe_open(str(self.dir / f), framework="pt") for f in files}
        self._refs: dict[str, _Ref] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}
        for f, h in self._handles.items():
            for key in h.keys():
                self._add(f, key, h.get_slice(key))
        self.consumed: set[str] = set()
        self.problems: list[str] = []

    def _shard_files(self) -> list[str]:
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise WeightsError(f"{index}: not a safetensors index ({e})", field="weight_map") from None
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.dir / f).is_file()]
            if missing:
                raise WeightsError(f"{index}: shards named in the index are missing: {', '.join(missing)}",
                                   field="weight_map", value=missing)
            return files
        if (self.dir / "model.safetensors").is_file():
            return ["model.safetensors"]
        files = sorted(p.name for p in self.dir.glob("*.safetensors"))
        if not files:
            raise WeightsError(f"{self.dir}: no *.safetensors files (and no model.safetensors.index.json)",
                               field="model")
        return files

    def _add(self, file: str, key: str, view) -> None:
        shape = tuple(view.get_shape())
        dtype = view.get_dtype()
        m = _STACKED.match(key)
        if m:
            prefix = official_name(m.group(1))
            n_experts = shape[0]
            if m.group(2) == "gate_up_proj":
                inter = shape[1] // 2
                for e in range(n_experts):
                    self._put(f"{prefix}.{e}.w1.weight", _Ref(file, key, (e, slice(0, inter))), shape[1:], dtype,
                              inter_rows=inter)
                    self._put(f"{prefix}.{e}.w3.weight", _Ref(file, key, (e, slice(inter, 2 * inter))), shape[1:],
                              dtype, inter_rows=inter)
            else:
                for e in range(n_experts):
                    self._put(f"{prefix}.{e}.w2.weight", _Ref(file, key, (e,)), shape[1:], dtype)
            return
        self._put(official_name(key), _Ref(file, key), shape, dtype)

    def _put(self, name, ref, shape, dtype, inter_rows=None):
        if inter_rows is not None:
            shape = (inter_rows, *shape[1:])
        if name in self._refs:
            raise WeightsError(f"{self.dir}: tensor {name} is stored twice ({self._refs[name].key} and {ref.key})",
                               field=name)
        self._refs[name] = ref
        self._shapes[name] = tuple(shape)
        self._dtypes[name] = dtype

    # --- queries -------------------------------------------------------------------------------------

    def names(self) -> list[str]:
        return sorted(self._refs)

    def has(self, name: str) -> bool:
        return name in self._refs

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def dtype(self, name: str) -> str:
        return self._dtypes[name]

    def nbytes(self, name: str) -> int:
        size = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2}.get(self._dtypes[name], 1)
        n = 1
        for d in self._shapes[name]:
            n *= d
        return n * size

    def read(self, name: str) -> torch.Tensor:
        ref = self._refs[name]
        h = self._handles[ref.file]
        self.consumed.add(name)
        if ref.index is None:
            return h.get_tensor(ref.key)
        return h.get_slice(ref.key)[ref.index]

    # --- declarative loading -------------------------------------------------------------------------

    def tensor(self, name: str, shape: tuple[int, ...], dtypes=_FLOAT_DTYPES) -> torch.Tensor | None:
        """A plain tensor (norm weights, biases, mHC parameters...). Records a problem and returns None
        when it is missing or mis-shaped."""
        if name not in self._refs:
            self.problems.append(f"missing {name} {list(shape)}")
            return None
        if self._shapes[name] != tuple(shape):
            self.problems.append(f"mis-shaped {name}: stored {list(self._shapes[name])}, expected {list(shape)}")
            self.consumed.add(name)
            return None
        t = self.read(name)
        if t.dtype not in dtypes:
            self.problems.append(f"wrong dtype {name}: stored {t.dtype}, expected one of {list(dtypes)}")
            return None
        return t

    def linear(self, name: str, out_features: int, in_features: int, block: tuple[int, int] | None,
               kind: str = "fp8") -> PackedWeight | None:
        """A linear weight `name` ([out, in]), stored FP8 (+ `.scale` E8M0 by `block`), FP4 (int8
        [out, in/2] + `.scale` E8M0 [out, in/32]) or dense float, whatever the checkpoint holds. `kind`
        is the official storage ("fp8", "expert" = the config's expert dtype, "dense" = BF16), used only
        by shape-only checkpoints."""
        scale_name = name.replace(".weight", ".scale") if name.endswith(".weight") else name + ".scale"
        if name not in self._refs:
            self.problems.append(f"missing {name} [{out_features}, {in_features}]")
            self.consumed.add(scale_name)  # an orphan scale is part of the same problem
            return None
        dtype = self._dtypes[name]
        stored = self._shapes[name]
        if dtype == "I8":
            want, want_scale = (out_features, in_features // 2), (out_features, in_features // 32)
            fmt, blk = "fp4", (1, 32)
        elif dtype == "F8_E4M3":
            bo, bi = block or (128, 128)
            want, want_scale = (out_features, in_features), (-(-out_features // bo), -(-in_features // bi))
            fmt, blk = "fp8", (bo, bi)
        else:
            want, want_scale, fmt, blk = (out_features, in_features), None, "dense", None
        if stored != want:
            self.problems.append(f"mis-shaped {name}: stored {list(stored)} ({dtype}), expected {list(want)}")
            self.consumed.add(name)
            return None
        scale = None
        if want_scale is not None:
            if scale_name not in self._refs:
                self.problems.append(f"missing {scale_name} {list(want_scale)} (scale of {dtype} {name})")
                self.consumed.add(name)
                return None
            if self._shapes[scale_name] != want_scale:
                self.problems.append(f"mis-shaped {scale_name}: stored {list(self._shapes[scale_name])}, "
                                     f"expected {list(want_scale)}")
                self.consumed.add(scale_name)
                return None
            scale = self.read(scale_name)
        data = self.read(name)
        if fmt == "dense" and data.dtype not in _FLOAT_DTYPES:
            self.problems.append(f"wrong dtype {name}: {data.dtype}")
            return None
        return PackedWeight(name, (out_features, in_features), fmt, data, scale, blk)

    def finish(self, ignore: tuple[str, ...] = ()) -> None:
        """Raise one WeightsError listing every problem and every stored tensor nobody asked for
        (except names matching the `ignore` regexes)."""
        patterns = [re.compile(p) for p in ignore]
        unexpected = [n for n in self.names()
                      if n not in self.consumed and not any(p.search(n) for p in patterns)]
        problems = self.problems + [f"unexpected {n} {list(self._shapes[n])}" for n in unexpected]
        if problems:
            shown = problems[:40]
            more = f"\n  ... and {len(problems) - 40} more" if len(problems) > 40 else ""
            raise WeightsError(f"{self.dir}: {len(problems)} checkpoint problem(s):\n  " + "\n  ".join(shown) + more,
                               field="weights", value=problems)


_DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16", torch.int64: "I64",
                torch.int32: "I32", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e8m0fnu: "F8_E8M0"}
_DTYPE_BYTES = {"BF16": 2, "F32": 4, "F16": 2, "I64": 8, "I32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1}


class ShapeCheckpoint:
    """A checkpoint that holds no data: building a model on it records every tensor the model would
    read (official name, dtype, shape) from the config alone, so weight bytes and memory plans can be
    computed without the weights."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.tensors: dict[str, tuple[str, tuple[int, ...]]] = {}

    def tensor(self, name, shape, dtypes=_FLOAT_DTYPES):
        self.tensors[name] = (_DTYPE_NAMES[dtypes[0]], tuple(shape))
        return None

    def linear(self, name, out_features, in_features, block, kind="fp8"):
        scale = name.replace(".weight", ".scale")
        quantized = self.cfg.weight_block is not None
        fmt = "dense" if kind == "dense" or not quantized else (
            self.cfg.expert_dtype if kind == "expert" else "fp8")
        if fmt == "fp4":
            self.tensors[name] = ("I8", (out_features, in_features // 2))
            self.tensors[scale] = ("F8_E8M0", (out_features, in_features // 32))
        elif fmt == "fp8":
            bo, bi = block or self.cfg.weight_block
            self.tensors[name] = ("F8_E4M3", (out_features, in_features))
            self.tensors[scale] = ("F8_E8M0", (-(-out_features // bo), -(-in_features // bi)))
        else:
            self.tensors[name] = ("BF16", (out_features, in_features))
        return None

    def finish(self, ignore=()):
        pass

    def nbytes(self, name: str) -> int:
        dtype, shape = self.tensors[name]
        n = _DTYPE_BYTES[dtype]
        for d in shape:
            n *= d
        return n
