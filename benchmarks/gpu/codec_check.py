"""Step ``codec``: the chunk codec's int8 / int4 on CUDA (the serving path's quantize and
dequantize, ``kvtierd/kernels/chunk_codec.py``) against the CPU torch reference.

Chunks: LMCache ``KV_2LTD`` ``[2, L, T, H*D]`` bf16 at the test size (2 layers, 16 tokens,
2 heads of 128) and the deployment's (32 layers, 256 tokens, 8 heads of 128). Held to: the
encoded bytes bit-equal to the reference's (codes, scales, zeros in the stored order), the
decoded chunk within one bf16 ulp of the CPU decode (``atol 1e-2, rtol 2**-7``); ``none``
round-trips bit-exact.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "0")

import torch

from benchmarks.gpu.kernels_check import close, equal
from benchmarks.gpu.record import Recorder, step_args
from kvtierd.kernels.api import to_kv_2ltd
from kvtierd.kernels.chunk_codec import ChunkFormat, chunk_format, decode_chunk, encode_chunk
from kvtierd.kernels.quant import dequantize_reference, quantize_kv

BF16_TOL = {"atol": 1e-2, "rtol": 2**-7}


def reference_bytes(kv: torch.Tensor, fmt: ChunkFormat) -> torch.Tensor:
    """What encode_chunk stores, computed on the CPU with the torch reference."""
    _, lyr, t, hd = kv.shape
    h = fmt.num_kv_heads
    k = kv[0].reshape(lyr, t, h, hd // h).permute(0, 2, 1, 3).contiguous().cpu()
    v = kv[1].reshape(lyr, t, h, hd // h).permute(0, 2, 1, 3).contiguous().cpu()
    qk, qv = quantize_kv(k, v, fmt.bits, fmt.group_size, backend="torch")
    parts = [qk.codes, qk.scale, qk.zero, qv.codes, qv.scale, qv.zero]
    return torch.cat([p.contiguous().view(torch.uint8).reshape(-1) for p in parts])


def reference_decode(kv: torch.Tensor, fmt: ChunkFormat) -> torch.Tensor:
    _, lyr, t, hd = kv.shape
    h = fmt.num_kv_heads
    k = kv[0].reshape(lyr, t, h, hd // h).permute(0, 2, 1, 3).contiguous().cpu()
    v = kv[1].reshape(lyr, t, h, hd // h).permute(0, 2, 1, 3).contiguous().cpu()
    qk, qv = quantize_kv(k, v, fmt.bits, fmt.group_size, backend="torch")
    return to_kv_2ltd(dequantize_reference(qk), dequantize_reference(qv))


def main() -> None:
    args = step_args(__doc__.split("\n\n")[0])
    rec = Recorder(args.result)
    sizes = [(2, 16, 2)] if args.quick else [(2, 16, 2), (32, 256, 8)]
    on = "cuda" if torch.cuda.is_available() else "cpu (no CUDA: reference against itself)"
    rec.figures["device"] = on
    for layers, tokens, heads in sizes:
        g = torch.Generator().manual_seed(layers)
        kv = torch.randn(2, layers, tokens, heads * 128, generator=g).to(torch.bfloat16)
        label = f"L{layers} T{tokens} H{heads}"

        def none(kv=kv, heads=heads) -> tuple[bool, str, str]:
            fmt = chunk_format(kv, heads, "none")
            out = torch.empty_like(kv)
            decode_chunk(encode_chunk(kv, fmt).view(torch.uint8).reshape(-1), fmt, out)
            ok, fig = equal(out, kv)
            return ok, fig, ""

        rec.run(f"{label} none round trip", none)
        for variant in ("int8", "int4"):

            def quant(kv=kv, heads=heads, variant=variant) -> tuple[bool, str, str]:
                fmt = chunk_format(kv, heads, variant)
                stored = encode_chunk(kv, fmt)  # on CUDA when there is one (the codec's rule)
                ok_b, fig_b = equal(stored, reference_bytes(kv, fmt))
                out = torch.empty_like(kv)
                decode_chunk(stored, fmt, out)
                ok_d, fig_d = close(out.float(), reference_decode(kv, fmt).float(), **BF16_TOL)
                return ok_b and ok_d, f"encoded {fig_b}; decoded {fig_d}", f"on {on}"

            rec.run(f"{label} {variant} encode/decode", quant)


if __name__ == "__main__":
    main()
