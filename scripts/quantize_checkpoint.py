"""Write a GPTQ, AWQ or compressed-tensors checkpoint of a float model with servelab's own round-to-nearest
quantizer, in the exact on-disk format of AutoGPTQ/gptqmodel (v1), AutoAWQ (GEMM) or compressed-tensors
(``pack-quantized``); the folder then loads in servelab (``quant=`` detected) as such checkpoints from a hub do.

    .venv/bin/python scripts/quantize_checkpoint.py --model stories260K --out /tmp/s260k-gptq --format gptq \\
        --bits 4 --group-size 32 --desc-act --no-sym

Round-to-nearest (no calibration; GPTQ's error feedback and AWQ's activation scaling are not run): per group of
``group_size`` input columns (``-1``: the whole row) ``scale = (max - min) / (2**bits - 1)`` and
``zero = round(-min / scale)`` (``--no-sym``), or ``scale = 2 * max|w| / (2**bits - 1)`` and
``zero = 2**(bits - 1)`` (``--sym``), as GPTQ's ``Quantizer``; scales are rounded to their stored dtype
first. ``--desc-act`` orders the columns by decreasing weight norm (GPTQ orders by the Hessian diagonal) and
writes the resulting ``g_idx``. The GPTQ v1 format stores ``zero - 1``, so zero points are kept >= 1.
Decoder linears whose shapes the format cannot pack stay float and are listed (``modules_to_not_convert`` /
``ignore``). compressed-tensors is written ``pack-quantized`` (W4A16/W8A16) or, with ``--ct-format``,
``int-quantized`` (llm-compressor's W8A8 preset: int8 per-channel weights, dynamic per-token int8 inputs) or
``float-quantized`` (its FP8_DYNAMIC: e4m3 weights with ``scale = max|w_row| / 448``, dynamic per-token e4m3
inputs). With the ``compressed-tensors`` package installed each compressed-tensors layer is decompressed by the
library and checked equal to the quantizer's own dequantized weight.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from framework.model_executor.model_loader import resolve_model_path  # noqa: E402
from plugins.quant._packing import awq_pack, ct_pack, pack_int32  # noqa: E402

logger = logging.getLogger("quantize_checkpoint")
FORMATS = ("gptq", "awq", "compressed-tensors")
CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized")  # the last two with dynamic per-token inputs
DECODER_LINEAR = re.compile(r"^model\.layers\.\d+\..+\.weight$")


def rtn(w: torch.Tensor, bits: int, group_size: int, sym: bool, desc_act: bool, scale_dtype: torch.dtype,
        min_zero: int = 0) -> dict[str, torch.Tensor]:
    """Round-to-nearest quantization of ``w`` ``(out, in)``.

    Returns:
        ``codes`` ``(out, in)`` int64 in ``[0, 2**bits)``, ``zeros`` ``(out, groups)`` int64, ``scales``
        ``(out, groups)`` float32 (values exact in ``scale_dtype``), ``g_idx`` ``(in,)`` int64 and ``dequantized``
        ``(out, in)`` float32 ``= (codes - zeros[:, g_idx]) * scales[:, g_idx]``.
    """
    w = w.float()
    out_f, in_f = w.shape
    maxq = 2**bits - 1
    gs = in_f if group_size == -1 else group_size
    order = torch.argsort(w.norm(dim=0), descending=True, stable=True) if desc_act else torch.arange(in_f)
    g_idx = torch.empty(in_f, dtype=torch.int64)
    g_idx[order] = torch.arange(in_f) // gs
    groups = in_f // gs
    wg = w[:, order].view(out_f, groups, gs)  # groups of the (act-)ordered columns
    lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    if sym:
        hi = torch.maximum(lo.abs(), hi)
        lo = -hi
    span = torch.where(hi - lo == 0, torch.full_like(hi, 2.0), hi - lo)  # GPTQ: an all-zero group gets [-1, 1]
    scales = (span / maxq).to(scale_dtype).float()
    zeros = torch.full_like(scales, (maxq + 1) // 2) if sym else torch.round(-lo / scales)
    zeros = zeros.clamp(min_zero, maxq).to(torch.int64)
    codes = torch.round(w / scales[:, g_idx]) + zeros[:, g_idx]
    codes = codes.clamp(0, maxq).to(torch.int64)
    dequantized = (codes - zeros[:, g_idx]).to(torch.float32) * scales[:, g_idx]
    return {"codes": codes, "zeros": zeros, "scales": scales, "g_idx": g_idx, "dequantized": dequantized}


def packable(fmt: str, bits: int, group_size: int, out_f: int, in_f: int) -> str:
    """Why ``fmt`` cannot pack an ``(out_f, in_f)`` layer (empty: it can)."""
    if group_size != -1 and in_f % group_size:
        return f"group_size {group_size} does not divide in_features {in_f}"
    per_word = 32 // bits
    if fmt == "gptq" and (in_f % per_word or out_f % per_word):
        return f"in/out features {in_f}/{out_f} not multiples of {per_word}"
    if fmt == "awq" and out_f % 8:
        return f"out_features {out_f} not a multiple of 8"
    return ""


def layer_tensors(fmt: str, prefix: str, q: dict[str, torch.Tensor], bits: int) -> dict[str, torch.Tensor]:
    """The on-disk tensors of one quantized layer ``prefix`` in ``fmt``."""
    if fmt == "gptq":  # AutoGPTQ QuantLinear.pack (v1: zeros stored minus 1)
        return {f"{prefix}.qweight": pack_int32(q["codes"].t(), bits, dim=0),
                f"{prefix}.qzeros": pack_int32((q["zeros"] - 1).t(), bits, dim=1),
                f"{prefix}.scales": q["scales"].t().to(torch.float16).contiguous(),
                f"{prefix}.g_idx": q["g_idx"].to(torch.int32)}
    if fmt == "awq":  # AutoAWQ WQLinear_GEMM.from_linear
        return {f"{prefix}.qweight": awq_pack(q["codes"].t()), f"{prefix}.qzeros": awq_pack(q["zeros"].t()),
                f"{prefix}.scales": q["scales"].t().to(torch.float16).contiguous()}
    if "weight" in q:  # compressed-tensors int-/float-quantized (NaiveQuantizationCompressor): unpacked
        return {f"{prefix}.weight": q["weight"], f"{prefix}.weight_scale": q["scales"].to(q["scale_dtype"])}
    offset = 2 ** (bits - 1)  # compressed-tensors PackedQuantizationCompressor.compress
    out = {f"{prefix}.weight_packed": ct_pack(q["codes"] - offset, bits, dim=1),
           f"{prefix}.weight_scale": q["scales"].to(q["scale_dtype"]).contiguous(),
           f"{prefix}.weight_shape": torch.tensor(list(q["codes"].shape), dtype=torch.int64)}
    if not q["sym"]:
        out[f"{prefix}.weight_zero_point"] = ct_pack(q["zeros"] - offset, bits, dim=0)
    return out


def quantize_unpacked(w: torch.Tensor, ct_format: str, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """compressed-tensors ``int-quantized`` (int8, symmetric RTN) or ``float-quantized`` (e4m3, ``scale =
    max|w_row| / 448``) weights of ``w`` ``(out, in)`` with per-channel scales.

    Returns:
        ``weight`` ``(out, in)`` int8 or float8_e4m3fn, ``scales`` ``(out, 1)`` float32 (exact in
        ``scale_dtype``), ``dequantized`` ``(out, in)`` float32 ``= weight * scales``.
    """
    if ct_format == "int-quantized":
        q = rtn(w, 8, -1, True, False, scale_dtype)
        return {"weight": (q["codes"] - 128).to(torch.int8), "scales": q["scales"], "dequantized": q["dequantized"]}
    top = float(torch.finfo(torch.float8_e4m3fn).max)
    scales = (w.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / top).to(scale_dtype).float()
    weight = (w.float() / scales).clamp(-top, top).to(torch.float8_e4m3fn)
    return {"weight": weight, "scales": scales, "dequantized": weight.float() * scales}


def quantization_config(fmt: str, bits: int, group_size: int, desc_act: bool, sym: bool,
                        skipped: list[str], ct_format: str = "pack-quantized") -> dict:
    """``config.json``'s ``quantization_config`` as the format's own tools write it."""
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
                "damp_percent": 0.01, "true_sequential": True, "static_groups": False, "checkpoint_format": "gptq",
                "meta": {"quantizer": ["servelab-rtn"]}}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": skipped or None}
    kind = "float" if ct_format == "float-quantized" else "int"
    weights = {"num_bits": bits, "type": kind, "symmetric": sym, "group_size": None if group_size == -1 else group_size,
               "strategy": "channel" if group_size == -1 else "group", "dynamic": False, "actorder": None}
    inputs = None if ct_format == "pack-quantized" else {  # llm-compressor's W8A8 / FP8_DYNAMIC presets
        "num_bits": 8, "type": kind, "symmetric": True, "strategy": "token", "dynamic": True}
    return {"quant_method": "compressed-tensors", "format": ct_format, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                          "output_activations": None, "format": ct_format}},
            "ignore": ["lm_head", *skipped], "kv_cache_scheme": None}


def check_options(fmt: str, bits: int, group_size: int, desc_act: bool, sym: bool, ct_format: str) -> None:
    """Raise ``ValueError`` for an option the format does not have."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if ct_format not in CT_FORMATS:
        raise ValueError(f"ct_format must be one of {CT_FORMATS}, got {ct_format!r}")
    if ct_format != "pack-quantized" and (fmt != "compressed-tensors" or bits != 8 or group_size != -1 or not sym):
        raise ValueError(f"ct_format={ct_format} is compressed-tensors, 8-bit, symmetric, group_size -1 (per channel)")
    if bits not in ((4,) if fmt == "awq" else (4, 8)):
        raise ValueError(f"{fmt}: bits={bits} not written (gptq and compressed-tensors: 4 or 8; awq: 4)")
    if desc_act and fmt != "gptq":
        raise ValueError(f"{fmt}: desc_act is a GPTQ option")
    if group_size != -1 and group_size <= 0:
        raise ValueError(f"group_size must be -1 or positive, got {group_size}")


def quantize_checkpoint(model: str, out_dir: str | Path, fmt: str, bits: int = 4, group_size: int = 128,
                        desc_act: bool = False, sym: bool = True, ct_format: str = "pack-quantized",
                        ) -> dict[str, torch.Tensor]:
    """Write ``model`` (a folder or servelab alias) quantized in ``fmt`` to ``out_dir`` (compressed-tensors in
    ``ct_format``: ``int-quantized`` is llm-compressor's W8A8, ``float-quantized`` its FP8_DYNAMIC).

    Returns:
        Layer name (``model.layers.0.self_attn.q_proj``) -> its dequantized ``(out, in)`` float32 weight, for
        every layer written quantized (the others are copied float).

    Raises:
        ValueError: an option the format does not have; a compressed-tensors layer the library decompresses
            differently.
    """
    from safetensors.torch import load_file, save_file

    check_options(fmt, bits, group_size, desc_act, sym, ct_format)
    src, out = Path(resolve_model_path(model)), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():  # tokenizer, generation config...
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json" and not f.name.startswith("."):
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    float_dtype = getattr(torch, str(config.get("dtype") or config.get("torch_dtype") or "float32"))
    state = load_file(str(src / "model.safetensors"))
    tensors, dequantized, skipped = {}, {}, []
    for key, w in state.items():
        prefix = key.removesuffix(".weight")
        why = packable(fmt, bits, group_size, *w.shape) if DECODER_LINEAR.match(key) and w.dim() == 2 else "-"
        if why:
            tensors[key] = w
            if why != "-":
                skipped.append(prefix)
                logger.info("%s kept float: %s", prefix, why)
            continue
        scale_dtype = float_dtype if fmt == "compressed-tensors" else torch.float16
        if ct_format != "pack-quantized":
            q = quantize_unpacked(w, ct_format, scale_dtype)
        else:
            q = rtn(w, bits, group_size, sym, desc_act, scale_dtype, min_zero=1 if fmt == "gptq" else 0)
        tensors.update(layer_tensors(fmt, prefix, {**q, "scale_dtype": scale_dtype, "sym": sym}, bits))
        dequantized[prefix] = q["dequantized"]
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config["quantization_config"] = quantization_config(fmt, bits, group_size, desc_act, sym, skipped, ct_format)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if fmt == "gptq":  # AutoGPTQ reads this file too
        (out / "quantize_config.json").write_text(json.dumps(config["quantization_config"], indent=2) + "\n")
    if fmt == "compressed-tensors":
        check_with_compressed_tensors(out, dequantized)
    return dequantized


def check_with_compressed_tensors(folder: Path, dequantized: dict[str, torch.Tensor]) -> int:
    """Decompress every quantized layer of a compressed-tensors checkpoint with the ``compressed-tensors``
    library (``PackedQuantizationCompressor.decompress``) and check it equals ``dequantized``.

    Returns:
        Layers checked (0 when the library is not installed).

    Raises:
        ValueError: a layer the library decompresses to another weight (names it).
    """
    try:
        from compressed_tensors.compressors import NaiveQuantizationCompressor, PackedQuantizationCompressor
        from compressed_tensors.quantization import QuantizationScheme
    except ImportError:
        logger.info("compressed-tensors not installed: the library check is skipped")
        return 0
    from safetensors.torch import load_file

    state = load_file(str(folder / "model.safetensors"))
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme(**qc["config_groups"]["group_0"])
    for prefix, expected in dequantized.items():
        local = {k.removeprefix(prefix + "."): v.float() if k.endswith("weight_scale") else v
                 for k, v in state.items() if k.startswith(prefix + ".")}
        compressor = PackedQuantizationCompressor if qc["format"] == "pack-quantized" else NaiveQuantizationCompressor
        weight = compressor.decompress(local, scheme)["weight"]
        if not torch.equal(weight.float(), expected):
            raise ValueError(f"{prefix}: compressed-tensors decompresses another weight (max diff "
                             f"{(weight.float() - expected).abs().max():.3g})")
    logger.info("compressed-tensors library check: %d layers decompress to the quantizer's weights", len(dequantized))
    return len(dequantized)


def main(argv: list[str] | None = None) -> None:
    """Command line: see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="stories260K", help="float model folder or servelab alias (smollm2, stories260K)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--format", choices=FORMATS, default="gptq")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128, help="input columns per group; -1: per output channel")
    p.add_argument("--desc-act", action="store_true", help="GPTQ act-order: write a permuting g_idx")
    p.add_argument("--sym", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--ct-format", choices=CT_FORMATS, default="pack-quantized",
                   help="compressed-tensors: int-quantized = W8A8, float-quantized = FP8 (dynamic per-token inputs)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    layers = quantize_checkpoint(args.model, args.out, args.format, args.bits, args.group_size, args.desc_act, args.sym,
                                 args.ct_format)
    logger.info("wrote %s: %d quantized layers (%s, %d-bit, group_size %d)", args.out, len(layers), args.format,
                args.bits, args.group_size)


if __name__ == "__main__":
    main()
