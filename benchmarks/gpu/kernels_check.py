"""Step ``kernels``: every Triton kernel of kvtierd/kernels on CUDA against its torch reference.

Geometries: the test size (2 layers, 8 KV heads, 1000 tokens, head_dim 128, bf16; contiguous
and a vLLM flash paged cache with a shuffled block table) and the real one (32 layers, 8 KV
heads, head_dim 128, bf16, 8192 and 32768 tokens; 32 query heads for snapkv). Held to:

* scores (``_norm_score_kernel``, ``_unit_key_sum_kernel``, ``_row_stats``, ``_window_probs``):
  ``|triton - torch| <= 1e-5 + 1e-5 |torch|`` everywhere (float32; reductions run in another
  order), ``+inf`` marks equal;
* kept sets: ``_compact_kernel`` on the reference scores bit-equal to the stable-sort
  reference; each method's triton kept set equal to torch's except where a near-tie at the
  cut (within 1e-5) swaps positions;
* ``_gather_kernel``: bit-equal without rotation; with the RoPE delta within one ulp of bf16
  (``atol 1e-2, rtol 2**-7``, the tests' table);
* ``_quant_kernel``: codes, scales and zeros bit-equal (int8 and int4, keys per channel,
  values per token); ``_dequant_kernel`` within one ulp of the dtype.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "0")  # before triton is imported: compiled on CUDA

import torch

from benchmarks.gpu.record import Recorder, step_args
from kvtierd.kernels.base import gather_kv, select_kept, select_reference
from kvtierd.kernels.layout import KVSource
from kvtierd.kernels.quant import dequantize, dequantize_reference, quantize
from kvtierd.kernels.registry import METHODS, get_method
from kvtierd.kernels.rope import RopeSpec

SCORE_TOL = {"atol": 1e-5, "rtol": 1e-5}
TOL = {  # one unit in the last place of the output dtype (tests/kernels/_kernel_helpers.py)
    torch.float16: {"atol": 1e-3, "rtol": 2**-10},
    torch.bfloat16: {"atol": 1e-2, "rtol": 2**-7},
    torch.float32: {"atol": 1e-6, "rtol": 1e-5},
}
QUERY_HEADS, WINDOW = 32, 64


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_kv(
    layers: int, heads: int, tokens: int, dim: int, *, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device()).manual_seed(seed)
    shape = (layers, heads, tokens, dim)
    k = torch.randn(shape, generator=g, device=device()).to(dtype)
    v = torch.randn(shape, generator=g, device=device()).to(dtype)
    q = torch.randn(layers, QUERY_HEADS, WINDOW, dim, generator=g, device=device()).to(dtype)
    return k, v, q


def paged_flash(k: torch.Tensor, v: torch.Tensor, block_size: int = 16) -> KVSource:
    """The same KV scattered into vLLM's flash layout ``[2, nb, bs, H, D]`` per layer, through
    a shuffled block table (NaN in every slot no token owns)."""
    lyr, h, n, d = k.shape
    used = -(-n // block_size)
    total = used + 3
    order = torch.randperm(total, generator=torch.Generator().manual_seed(1))[:used]
    table = order.to(torch.int32).to(k.device)
    pad = used * block_size - n
    caches = []
    for layer in range(lyr):
        c = torch.full((2, total, block_size, h, d), float("nan"), dtype=k.dtype, device=k.device)
        for i, x in enumerate((k[layer], v[layer])):
            padded = torch.nn.functional.pad(x, (0, 0, 0, pad))  # [H, used*bs, D]
            c[i, table.long()] = padded.view(h, used, block_size, d).permute(1, 2, 0, 3)
        caches.append(c)
    return KVSource.from_vllm_paged(caches, table, n, kv_layout="flash")


def close(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> tuple[bool, str]:
    bad = int((~torch.isclose(got, want, rtol=rtol, atol=atol)).sum())
    finite = torch.isfinite(want) & torch.isfinite(got)
    err = float((got[finite].double() - want[finite].double()).abs().max()) if finite.any() else 0
    return (
        bad == 0,
        f"max |err| {err:.2e}, {bad} of {want.numel()} outside (atol {atol}, rtol {rtol:.1e})",
    )


def equal(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, str]:
    same = got.shape == want.shape and bool(torch.equal(got, want))
    if same:
        return True, f"bit-equal ({want.numel()} elements)"
    if got.shape != want.shape:
        return False, f"shapes differ: {tuple(got.shape)} vs {tuple(want.shape)}"
    bad = int((got != want).sum())
    return False, f"{bad} of {want.numel()} elements differ"


def kept_agree(got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor) -> tuple[bool, str]:
    """tests/kernels/_kernel_helpers.assert_same_kept as a verdict: rows may differ only in
    positions scoring within 1e-5 of the cut."""
    rows = (got != want).any(dim=-1)
    if not bool(rows.any()):
        return True, f"identical ({want.shape[0] * want.shape[1]} rows of {want.shape[-1]})"
    m, far = want.shape[-1], 0
    for idx in zip(*torch.nonzero(rows, as_tuple=True), strict=True):
        row = scores[idx].cpu()
        cut = float(torch.sort(row, descending=True, stable=True).values[m - 1])
        for p in set(got[idx].tolist()) ^ set(want[idx].tolist()):
            far += abs(float(row[p]) - cut) > 1e-5 * max(1.0, abs(cut))
    n_rows = int(rows.sum())
    return far == 0, f"{n_rows} rows differ by near-ties, {far} positions not near the cut"


def check_geometry(
    rec: Recorder, label: str, src: KVSource, kvq: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> None:
    """Every kernel on ``src`` (whose dense KV is ``kvq[:2]``; ``kvq[2]`` snapkv's queries)."""
    k, v, q = kvq
    dtype = k.dtype
    ref_scores: dict[str, torch.Tensor] = {}
    for name in METHODS.names():
        method = get_method(name)

        def scores(method=method, name=name) -> tuple[bool, str, str]:
            got = method.score(src, q, backend="triton")
            want = ref_scores[name] = method.score(src, q, backend="torch")
            ok, fig = close(got, want, **SCORE_TOL)
            return ok, fig, ""

        rec.run(f"{label} score {name}", scores)

        def kept(method=method, name=name) -> tuple[bool, str, str]:
            got = method.select(src, 0.3, queries=q, backend="triton")
            want = method.select(src, 0.3, queries=q, backend="torch")
            ok, fig = kept_agree(got, want, ref_scores[name])
            return ok, fig, ""

        rec.run(f"{label} kept {name}@0.3", kept)

    def compaction() -> tuple[bool, str, str]:
        s = ref_scores["knorm"]
        m = s.shape[-1] // 2
        ok, fig = equal(select_kept(s, m, "triton"), select_reference(s, m))
        return ok, fig, ""

    rec.run(f"{label} select _compact_kernel", compaction)
    kept_half = select_reference(ref_scores["knorm"], src.num_tokens // 2)
    rope = RopeSpec.standard(k.shape[-1], theta=500000.0)

    def gather(rotate: bool) -> tuple[bool, str, str]:
        delta = kept_half.shape[-1] - src.num_tokens if rotate else 0
        r = rope if rotate else None
        gk, gv = gather_kv(src, kept_half, rope=r, delta=delta, backend="triton")
        wk, wv = gather_kv(src, kept_half, rope=r, delta=delta, backend="torch")
        ok_v, fig_v = equal(gv, wv)
        ok_k, fig_k = close(gk.float(), wk.float(), **TOL[dtype]) if rotate else equal(gk, wk)
        return ok_k and ok_v, f"keys {fig_k}; values {fig_v}", ""

    rec.run(f"{label} gather", lambda: gather(False))
    rec.run(f"{label} gather+rope", lambda: gather(True))
    if src.block_size != src.num_tokens:
        return  # quantization reads contiguous [L, H, N, D] only (docs/kernels.md)
    for bits in (8, 4):
        for which, x, axis in (("keys", k, "channel"), ("values", v, "token")):

            def quant(bits=bits, x=x, axis=axis) -> tuple[bool, str, str]:
                got = quantize(x, bits, axis=axis, backend="triton")
                want = quantize(x, bits, axis=axis, backend="torch")
                parts = [
                    equal(got.codes, want.codes),
                    equal(got.scale, want.scale),
                    equal(got.zero, want.zero),
                ]
                ok_d, fig_d = close(
                    dequantize(got, "triton").float(),
                    dequantize_reference(got).float(),
                    **TOL[dtype],
                )
                figs = "; ".join(
                    f"{n} {f}"
                    for n, (_, f) in zip(("codes", "scales", "zeros"), parts, strict=True)
                )
                return all(o for o, _ in parts) and ok_d, f"{figs}; dequantized {fig_d}", ""

            rec.run(f"{label} int{bits} {which} ({axis})", quant)


def geometries(quick: bool) -> list[tuple[str, int, int, int]]:
    """``(label, layers, tokens, head_dim)``; ``quick``: sizes the interpreter runs in seconds."""
    if quick:
        return [("quick L2 N200", 2, 200, 64)]
    return [
        ("test L2 N1000", 2, 1000, 128),
        ("real L32 N8192", 32, 8192, 128),
        ("real L32 N32768", 32, 32768, 128),
    ]


def main() -> None:
    args = step_args(__doc__.split("\n\n")[0])
    rec = Recorder(args.result)
    for label, layers, tokens, dim in geometries(args.quick):
        k, v, q = make_kv(layers, 8, tokens, dim, dtype=torch.bfloat16)
        check_geometry(rec, f"{label} bf16", KVSource.from_contiguous(k, v), (k, v, q))
        if layers == 2:
            check_geometry(rec, f"{label} bf16 paged", paged_flash(k, v), (k, v, q))
        del k, v, q
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
