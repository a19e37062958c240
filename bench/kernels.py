"""Each kernel's achieved memory bandwidth against the device's measured copy bandwidth.

    python bench/kernels.py                      # CUDA if present (Triton kernels), else CPU (the CPU ops)
    python bench/kernels.py --device cpu
    python bench/kernels.py --decode-graphs      # CUDA: decode steps of a random Llama, eager vs CUDA graphs

Every figure comes from this one run. The ceiling is a large device tensor copy (bytes read + bytes
written over the time). For each kernel, the bytes it must move at the least (what it reads and writes
once, K/V of every attended token for attention) over its median time. The ops are the ones the engine
selects for the device (`kernels.select_ops`): the Triton kernels on CUDA, the CPU path on CPU (our C
kernels where they build, else torch's library ops; oneDNN's linear is printed beside ours as the peer). Warm-up (Triton compilation) is excluded.
Target on CUDA: paged decode attention at large batch x context at >= 70 % of the copy bandwidth.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kernels import AttentionMetadata, select_ops  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def timer(device: torch.device):
    """median seconds of fn() over `repeats` calls, after `warmup` calls."""
    def measure(fn, repeats: int = 20, warmup: int = 3) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return statistics.median(times)
    return measure


def copy_bandwidth(device: torch.device, measure) -> float:
    """Bytes/s of a large tensor copy (read + write), well past the caches; `measure(fn)` -> seconds."""
    n = (1 << 28) if device.type == "cuda" else (64 << 20)  # 1 GiB / 256 MiB of float32
    a = torch.ones(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    return 2 * a.numel() * 4 / measure(lambda: b.copy_(a))


def decode_case(batch: int, ctx: int, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype, device):
    """A decode step's attention inputs: `batch` sequences of `ctx` tokens in a shuffled paged cache."""
    g = torch.Generator(device="cpu").manual_seed(0)
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = batch * blocks_per_seq + 1
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(device=device, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(device=device, dtype=dtype)
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).view(batch, blocks_per_seq).to(torch.int32)
    q = torch.randn(batch, heads, head_dim, generator=g).to(device=device, dtype=dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=device), block_tables=ids.to(device),
        query_lens_host=[1] * batch, seq_lens_host=[ctx] * batch, max_query_len=1, max_seq_len=ctx)
    return q, k_cache, v_cache, meta


def prefill_case(q_len: int, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(1)
    nb = -(-q_len // block_size)
    k_cache = torch.randn(nb + 1, block_size, kv_heads, head_dim, generator=g).to(device=device, dtype=dtype)
    v_cache = torch.randn(nb + 1, block_size, kv_heads, head_dim, generator=g).to(device=device, dtype=dtype)
    q = torch.randn(q_len, heads, head_dim, generator=g).to(device=device, dtype=dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(q_len, dtype=torch.int64, device=device) + block_size,
        query_start_loc=torch.tensor([0, q_len], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([q_len], dtype=torch.int32, device=device),
        block_tables=torch.arange(1, nb + 1, dtype=torch.int32, device=device)[None],
        query_lens_host=[q_len], seq_lens_host=[q_len], max_query_len=q_len, max_seq_len=q_len)
    return q, k_cache, v_cache, meta


def kernel_rows(device: torch.device, dtype: torch.dtype, measure) -> list[dict]:
    ops = select_ops("auto", device.type)
    elem = torch.empty(0, dtype=dtype).element_size()
    cuda = device.type == "cuda"
    # Llama-3-8B-like attention on a GPU (32 query heads on 8 KV heads, head 128); SmolLM2-135M on a CPU.
    heads, kv_heads, head_dim, hidden = (32, 8, 128, 4096) if cuda else (9, 3, 64, 576)
    decode_shapes = [(256, 4096), (64, 8192), (8, 2048), (1, 32768)] if cuda else [(64, 1024), (8, 512), (1, 2048)]
    rows = []

    def add(name: str, seconds: float, nbytes: float, flops: float | None = None) -> None:
        rows.append({"kernel": name, "us": seconds * 1e6, "GBps": nbytes / seconds / 1e9,
                     "TFLOPs": flops / seconds / 1e12 if flops else None})

    for batch, ctx in decode_shapes:
        q, kc, vc, meta = decode_case(batch, ctx, heads, kv_heads, head_dim, 16, dtype, device)
        kv_bytes = 2 * batch * ctx * kv_heads * head_dim * elem
        t = measure(lambda: ops.paged_attention(q, kc, vc, meta, head_dim**-0.5))
        add(f"paged decode attention  batch {batch} x ctx {ctx}", t, kv_bytes + 2 * q.numel() * elem,
            4 * batch * ctx * heads * head_dim)
    q_len = 2048 if cuda else 512
    q, kc, vc, meta = prefill_case(q_len, heads, kv_heads, head_dim, 16, dtype, device)
    t = measure(lambda: ops.paged_attention(q, kc, vc, meta, head_dim**-0.5), repeats=10)
    add(f"paged prefill attention  one prompt of {q_len}", t,
        2 * q_len * kv_heads * head_dim * elem + 2 * q.numel() * elem, 2 * q_len * q_len * heads * head_dim)
    if not cuda:  # the library peer: torch's SDPA (a flash-attention kernel on CPU) on the same prompt, unpaged
        import torch.nn.functional as F

        nb = -(-q_len // 16)
        kq, vq = (c[meta.block_tables[0, :nb].long()].reshape(-1, kv_heads, head_dim)[:q_len].transpose(0, 1)[None]
                  for c in (kc, vc))
        qq = q.transpose(0, 1)[None]
        t = measure(lambda: F.scaled_dot_product_attention(qq, kq, vq, is_causal=True, scale=head_dim**-0.5,
                                                           enable_gqa=kv_heads != heads), repeats=10)
        add("  (torch's SDPA, same prompt unpaged)", t, 2 * q_len * kv_heads * head_dim * elem + 2 * q.numel() * elem,
            2 * q_len * q_len * heads * head_dim)

    # CUDA: 128 MiB activations, past the L2. CPU: the engine's default token budget, 4.5 MiB at hidden 576 (in
    # the L3, as in a prefill step; at 16k tokens every op here pays more in page faults than in copying)
    tokens = 16384 if cuda else 2048
    k = torch.randn(tokens, kv_heads, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    big_k = torch.zeros(-(-tokens // 16) * 2, 16, kv_heads, head_dim, device=device, dtype=dtype)
    big_v = torch.zeros_like(big_k)
    slots = torch.randperm(big_k.shape[0] * 16, device=device)[:tokens]
    t = measure(lambda: ops.write_kv(k, v, big_k, big_v, slots))
    add(f"KV write  {tokens} tokens", t, 4 * k.numel() * elem)

    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    res = torch.randn_like(x)
    w = torch.ones(hidden, device=device, dtype=dtype)
    t = measure(lambda: ops.rms_norm(x, w, 1e-6, None))
    add(f"RMSNorm  {tokens} x {hidden}", t, 2 * x.numel() * elem)
    t = measure(lambda: ops.rms_norm(x, w, 1e-6, res))
    add(f"RMSNorm + residual add  {tokens} x {hidden}", t, 4 * x.numel() * elem)
    inter = 4 * hidden if cuda else 1536  # the MLP's width (the default model's on a CPU)
    gate_up = torch.randn(tokens, 2 * inter, device=device, dtype=dtype)
    t = measure(lambda: ops.silu_mul(gate_up))
    add(f"SwiGLU gate  {tokens} x {inter}", t, 3 * tokens * inter * elem)

    # one decode row through a stack of weight matrices bigger than the caches, as a batch-1 step reads them
    n_out, n_in = (4 * hidden, hidden) if cuda else (3072, 576)
    stack = [torch.randn(n_out, n_in, device=device, dtype=dtype) for _ in range(8 if cuda else 24)]
    wbytes = sum(w.numel() for w in stack) * elem
    # CPU: our C GEMV serves up to kernels.cpu_native.NATIVE_MAX_ROWS = 5 rows, 6 go to oneDNN; the library
    # peer is printed beside each, since that is where the two cross
    for m in (1,) if cuda else (1, 5, 6):
        xr = torch.randn(m, n_in, device=device, dtype=dtype)
        t = measure(lambda: [ops.linear(xr, w) for w in stack], repeats=10)
        add(f"linear, {m} row(s) x {len(stack)} weights of {n_out} x {n_in}", t, wbytes, 2 * m * wbytes / elem)
        if not cuda:  # oneDNN, or F.linear where oneDNN has no linear in this dtype (bf16 without AVX512-BF16)
            from kernels.linear import library_linear, linear_onednn

            library = library_linear(dtype)
            name = "oneDNN's" if library is linear_onednn else "torch's"
            t = measure(lambda: [library(xr, w) for w in stack], repeats=10)
            add(f"  ({name} linear, same stack)", t, wbytes, 2 * m * wbytes / elem)

    if not cuda and dtype == torch.float32:  # many rows (prefill): our tiled linear against oneDNN's on the packed
        # weight, the MLP's up projection (the tiles' point shows beside another process: bench/contention.py)
        from kernels.linear import linear_onednn, linear_tiled, packed_weight

        w_up = torch.randn(2 * 1536, 576)
        for m in (64, 2048):
            xr = torch.randn(m, 576)
            ours = "tiled" if linear_tiled(xr, w_up) is not None else "linear_cpu"
            t = measure(lambda: ops.linear(xr, w_up), repeats=10)
            add(f"linear, {m} rows x 576 -> 3072 ({ours})", t, w_up.numel() * 4, 2 * m * w_up.numel())
            t = measure(lambda: linear_onednn(xr, packed_weight(w_up)), repeats=10)
            add("  (oneDNN's linear, packed weight)", t, w_up.numel() * 4, 2 * m * w_up.numel())

    if not cuda:  # sampling at temperature 1: our sampler (inverse CDF) against exponential noise + argmax
        from engine import SamplingParams
        from engine.sampler import Sampler
        from engine.sequence import Sequence

        rows_n, vocab = 36, 49152  # the default model's vocabulary, a decode step's batch
        logits = torch.randn(rows_n, vocab)
        sampler = Sampler(vocab, [], seed=0, device=device)
        seqs = [Sequence(f"r{i}", 0, [1], SamplingParams(temperature=1.0)) for i in range(rows_n)]
        t = measure(lambda: sampler(logits, seqs), repeats=10)
        add(f"sample {rows_n} rows x {vocab} tokens, temperature 1", t, logits.numel() * 4)
        t = measure(lambda: (logits.softmax(-1) / torch.empty_like(logits).exponential_()).argmax(-1), repeats=10)
        add("  (exponential noise + argmax, same rows)", t, logits.numel() * 4)

    from engine.models.rope import build_rope_cache
    from transformers import LlamaConfig

    cos, sin = build_rope_cache(LlamaConfig(head_dim=head_dim, max_position_embeddings=8192), head_dim, 8192)
    cos, sin = cos.to(device), sin.to(device)
    qr = torch.randn(tokens, heads, head_dim, device=device, dtype=dtype)
    kr = torch.randn(tokens, kv_heads, head_dim, device=device, dtype=dtype)
    pos = torch.randint(0, 8192, (tokens,), device=device)
    t = measure(lambda: ops.rotary(qr, kr, pos, cos, sin))
    add(f"rotary  {tokens} tokens, {heads}+{kv_heads} heads", t, 2 * (qr.numel() + kr.numel()) * elem)
    return rows


def attention_sweep_rows(dtype: torch.dtype, measure) -> list[dict]:
    """CUDA: the Triton attention's tile sizes, warps and pipeline stages, timed on the largest decode shape
    and on the prefill shape, so the defaults in kernels.triton_ops.attention_tiling rest on a measurement."""
    import itertools

    from kernels.triton_ops import paged_attention_triton

    device, elem = torch.device("cuda"), torch.empty(0, dtype=dtype).element_size()
    rows = []
    q, kc, vc, meta = decode_case(256, 4096, 32, 8, 128, 16, dtype, device)
    nbytes = 2 * 256 * 4096 * 8 * 128 * elem

    def timed(fn, **kw) -> float:
        try:
            return measure(fn, **kw)
        except Exception as e:  # a variant past the device's shared memory, say: say so, keep sweeping
            print(f"  variant failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            return float("inf")

    for block_n, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3)):
        t = timed(lambda: paged_attention_triton(q, kc, vc, meta, 0.088, block_n=block_n, num_warps=warps,
                                                 num_stages=stages))
        rows.append({"case": "decode 256 x 4096", "block_m": 1, "block_n": block_n, "warps": warps,
                     "stages": stages, "us": t * 1e6, "GBps": nbytes / t / 1e9})
    from kernels.triton_ops import choose_num_splits

    for batch, ctx in ((8, 2048), (1, 32768), (32, 1024)):  # too few (token, KV head) programs: split-K
        q, kc, vc, meta = decode_case(batch, ctx, 32, 8, 128, 16, dtype, device)
        nbytes = 2 * batch * ctx * 8 * 128 * elem
        default = choose_num_splits(batch, 8, ctx // 16)
        for splits in (1, 2, 4, 8, 16, 32, 64):
            t = timed(lambda: paged_attention_triton(q, kc, vc, meta, 0.088, num_splits=splits))
            rows.append({"case": f"decode {batch} x {ctx}, {splits} splits" + (" (default)" if splits == default
                         else ""), "block_m": 1, "block_n": 64, "warps": 4, "stages": 2, "us": t * 1e6,
                         "GBps": nbytes / t / 1e9})
    q, kc, vc, meta = prefill_case(2048, 32, 8, 128, 16, dtype, device)
    flops = 2 * 2048 * 2048 * 32 * 128
    for block_m, block_n, warps, stages in itertools.product((16, 32), (32, 64), (4, 8), (2, 3)):
        t = timed(lambda: paged_attention_triton(q, kc, vc, meta, 0.088, block_m=block_m, block_n=block_n,
                                                 num_warps=warps, num_stages=stages), repeats=10)
        rows.append({"case": "prefill 2048", "block_m": block_m, "block_n": block_n, "warps": warps,
                     "stages": stages, "us": t * 1e6, "TFLOPs": flops / t / 1e12})
    return rows


def decode_graph_rows(dtype: torch.dtype) -> list[dict]:
    """Decode tokens/s of a random 8-layer Llama at several batch sizes, eager and with CUDA graphs."""
    import tempfile

    from bench.models import random_llama
    from engine import LLM, SamplingParams

    path = random_llama(Path(tempfile.gettempdir()) / "kvscale-bench-llama-graphs", hidden_size=1024,
                        intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                        max_position_embeddings=2048)
    out = []
    for eager in (True, False):
        llm = LLM(model=path, dtype="bfloat16" if dtype == torch.bfloat16 else "float32", device="cuda",
                  max_model_len=1024, max_num_seqs=64, enforce_eager=eager, show_progress=False)
        for batch in (1, 8, 64):
            prompts = [[5 + i, 6, 7, 8] for i in range(batch)]
            params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
            torch.cuda.synchronize()
            t = time.perf_counter()
            llm.generate(prompts, params)
            torch.cuda.synchronize()
            out.append({"mode": "eager" if eager else "cuda graphs", "batch": batch,
                        "tok_s": batch * 128 / (time.perf_counter() - t)})
        del llm
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--decode-graphs", action="store_true", help="CUDA: also decode steps, eager vs CUDA graphs")
    ap.add_argument("--sweep", action="store_true", help="CUDA: also time the attention kernel's tile choices")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    measure = timer(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    bw = copy_bandwidth(device, measure)
    print(f"device: {name}; ops: {select_ops('auto', device.type).name}; {dtype}; "
          f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write of a large tensor); medians, warm-up excluded\n")
    rows = kernel_rows(device, dtype, measure)
    print("| kernel | time (us) | GB/s | of copy bandwidth | TFLOP/s |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        tf = f"{r['TFLOPs']:.2f}" if r["TFLOPs"] else "-"
        print(f"| {r['kernel']} | {r['us']:.0f} | {r['GBps']:.0f} | {r['GBps'] * 1e9 / bw:.0%} | {tf} |")
    big = rows[0]
    if device.type == "cuda":
        print(f"\npaged decode attention at {big['kernel'].split('attention')[1].strip()}: "
              f"{big['GBps'] * 1e9 / bw:.0%} of copy bandwidth (target >= 70 %)")
    figures = {"device": name, "dtype": str(dtype), "copy_bandwidth_GBps": bw / 1e9, "kernels": rows}
    if args.sweep:
        if device.type != "cuda":
            raise SystemExit("--sweep needs CUDA: it times the Triton kernel's compiled variants")
        sweep = attention_sweep_rows(dtype, measure)
        print("\n| attention sweep | BLOCK_M | BLOCK_N | warps | stages | us | GB/s or TFLOP/s |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for r in sweep:
            rate = f"{r['GBps']:.0f} GB/s ({r['GBps'] * 1e9 / bw:.0%})" if "GBps" in r else f"{r['TFLOPs']:.1f} TFLOP/s"
            print(f"| {r['case']} | {r['block_m']} | {r['block_n']} | {r['warps']} | {r['stages']} | "
                  f"{r['us']:.0f} | {rate} |")
        figures["attention_sweep"] = sweep
    if args.decode_graphs:
        if device.type != "cuda":
            raise SystemExit("--decode-graphs needs CUDA: CPU steps are always eager")
        graphs = decode_graph_rows(dtype)
        print("\n| decode, random 8-layer Llama (hidden 1024) | batch | tok/s |")
        print("|---|---:|---:|")
        for r in graphs:
            print(f"| {r['mode']} | {r['batch']} | {r['tok_s']:.0f} |")
        figures["decode_graphs"] = graphs
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
