"""Every Triton kernel against its torch reference, under TRITON_INTERPRET=1 on CPU (set by conftest.py when
there is no GPU), on the shapes that break paged kernels: ragged lengths, a sequence of length 1, lengths
ending exactly on and one past a block boundary, chunked prefill over a cached prefix, GQA ratios 1/4/8,
head dims 64/128/256, block sizes 16/32, split-K decode, sliding windows; fp32 and bf16.

Tolerances: fp32 1e-5 (the kernels accumulate in fp32 like the references; only the order differs);
bf16 2e-2 absolute and relative: one bf16 rounding step. The kernels round where the references round,
but Triton's interpreter casts fp32 to bf16 by truncation where torch rounds to nearest, so on CPU a
bf16 element may sit one ulp away from the reference.
"""
from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

from kernels import AttentionMetadata, select_ops
from kernels.kv_cache import dequantize, quantize, write_kv_ref
from kernels.norm import rms_norm_ref
from kernels.cpu_native import native
from kernels.paged_attention import (_decode_buckets, paged_attention_invariant_cpu, paged_attention_ref,
                                     paged_attention_sdpa)
from kernels.rotary import rotary_ref

# Where the Triton kernels run: Triton's interpreter on CPU tensors (CI, any machine), or compiled on the
# GPU when scripts/gpu_check.sh sets KVSCALE_KERNEL_DEVICE=cuda. References always run on CPU.
DEVICE = torch.device("cuda" if os.environ.get("KVSCALE_KERNEL_DEVICE") == "cuda" else "cpu")


def _to(x, dev: torch.device):
    if isinstance(x, torch.Tensor):
        return x.to(dev)
    if isinstance(x, AttentionMetadata):
        return dataclasses.replace(x, plans={}, **{f: getattr(x, f).to(dev) for f in
                                                   ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")})
    if isinstance(x, tuple):
        return tuple(_to(y, dev) for y in x)
    return x


class _KernelsOn:
    """kernels.triton_ops with every *_triton call run on DEVICE: inputs moved there, results moved back, and
    tensors a kernel updates in place (the KV write's caches) copied back. On CPU, the module itself."""

    def __init__(self, module) -> None:
        self._module = module

    def __getattr__(self, name: str):
        fn = getattr(self._module, name)
        if DEVICE.type == "cpu" or not name.endswith("_triton"):
            return fn

        def on_device(*args, **kwargs):
            moved = [_to(a, DEVICE) for a in args]
            out = fn(*moved, **{k: _to(v, DEVICE) for k, v in kwargs.items()})
            for a, m in zip(args, moved):
                if isinstance(a, torch.Tensor):
                    a.copy_(m.cpu())
            return _to(out, torch.device("cpu"))
        return on_device


triton_ops = _KernelsOn(pytest.importorskip("kernels.triton_ops", reason="triton is not installed"))  # it is, in CI

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def make_batch(query_lens, seq_lens, block_size, num_blocks, heads, kv_heads, head_dim, dtype, seed=0):
    """A paged cache filled with random K/V for each sequence's context, blocks scattered at random."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slots = []
    for b, (q_len, ctx) in enumerate(zip(query_lens, seq_lens)):
        ids = [free.pop() for _ in range(-(-ctx // block_size))]
        tables[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        slots += [ids[p // block_size] * block_size + p % block_size for p in range(ctx - q_len, ctx)]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables, query_lens_host=list(query_lens),
        seq_lens_host=list(seq_lens), max_query_len=max(query_lens), max_seq_len=max(seq_lens))
    q = torch.randn(sum(query_lens), heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, meta


def check(a, b, dtype):
    torch.testing.assert_close(a.float(), b.float(), **TOL[dtype])


# ---------------------------------------------------------------------------------------------- attention
DECODE_CASES = [  # (seq_lens, block_size): ragged; length 1; exactly on / one past a block boundary
    ([1, 17, 40, 16, 33], 16),
    ([32, 33, 1, 64, 65], 32),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1)])  # GQA ratios 1, 4, 8
@pytest.mark.parametrize("seq_lens,block_size", DECODE_CASES)
def test_decode_attention(seq_lens, block_size, heads, kv_heads, dtype):
    q, kc, vc, meta = make_batch([1] * len(seq_lens), seq_lens, block_size, 64, heads, kv_heads, 64, dtype)
    want = paged_attention_ref(q, kc, vc, meta, 0.125)
    check(triton_ops.paged_attention_triton(q, kc, vc, meta, 0.125), want, dtype)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_decode_attention_head_dims(head_dim):
    q, kc, vc, meta = make_batch([1, 1], [16, 23], 16, 8, 4, 2, head_dim, torch.float32)
    scale = head_dim ** -0.5
    check(triton_ops.paged_attention_triton(q, kc, vc, meta, scale), paged_attention_ref(q, kc, vc, meta, scale),
          torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [2, 4, 8])
def test_split_k_decode_matches_unsplit(splits, dtype):
    """Flash-decoding: a long context at batch 2 split over several programs, merged exactly."""
    q, kc, vc, meta = make_batch([1, 1], [300, 129], 16, 40, 8, 2, 64, dtype)
    want = paged_attention_ref(q, kc, vc, meta, 0.125)
    check(triton_ops.paged_attention_triton(q, kc, vc, meta, 0.125, num_splits=splits), want, dtype)
    assert triton_ops.choose_num_splits(2, 2, 19) > 1  # this shape is split by default, too
    assert triton_ops.choose_num_splits(512, 8, 19) == 1  # a large batch fills the device without


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1)])
def test_prefill_and_extend_attention(heads, kv_heads, dtype):
    """Varlen chunks: a whole prompt; a chunk after a cached prefix (chunked prefill or prefix hit) ending
    one past a block boundary; a one-token prompt; a decode in the same batch."""
    query_lens = [20, 7, 1, 1, 16]
    seq_lens = [20, 33, 1, 40, 48]
    q, kc, vc, meta = make_batch(query_lens, seq_lens, 16, 64, heads, kv_heads, 64, dtype)
    check(triton_ops.paged_attention_triton(q, kc, vc, meta, 0.125), paged_attention_ref(q, kc, vc, meta, 0.125),
          dtype)


@pytest.mark.parametrize("window", [None, 7, 40])
@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (8, 1)])
def test_long_chunks_span_several_query_and_key_tiles(heads, kv_heads, window):
    """Prefill tiles hold up to 64 // G tokens of one sequence and step through keys 64 at a time: chunks of
    70 and 33 tokens after cached prefixes, a whole prompt of 65 and a decode, with and without a window. Groups
    of 4 and 8 query heads on one KV head (several KV heads are covered above). Split over the keys too (a
    split whose keys a tile cannot see leaves an empty partial) with groups of 4: the merge runs a program per
    token and head, about 6 ms each in Triton's interpreter, and G=8's tiles differ from G=4's only in BLOCK_M,
    which the unsplit call covers."""
    query_lens, seq_lens = [70, 33, 65, 1], [100, 33, 65, 90]
    q, kc, vc, meta = make_batch(query_lens, seq_lens, 16, 64, heads, kv_heads, 64, torch.float32)
    want = paged_attention_ref(q, kc, vc, meta, 0.125, sliding_window=window)
    check(triton_ops.paged_attention_triton(q, kc, vc, meta, 0.125, sliding_window=window), want, torch.float32)
    if heads // kv_heads == 4:
        check(triton_ops.paged_attention_triton(q, kc, vc, meta, 0.125, sliding_window=window, num_splits=2), want,
              torch.float32)


@pytest.mark.parametrize("window", [1, 5, 16])
def test_sliding_window(window):
    q, kc, vc, meta = make_batch([9, 1, 1], [30, 17, 50], 16, 64, 8, 2, 64, torch.float32)
    want = paged_attention_ref(q, kc, vc, meta, 0.125, sliding_window=window)
    check(triton_ops.paged_attention_triton(q, kc, vc, meta, 0.125, sliding_window=window), want, torch.float32)
    check(triton_ops.paged_attention_triton(q, kc, vc, meta, 0.125, sliding_window=window, num_splits=2), want,
          torch.float32)


# ------------------------------------------------------------------- the CPU path: fused SDPA vs reference
SDPA_TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("query_lens,seq_lens,block_size", [
    ([1] * 5, [1, 17, 40, 16, 33], 16),  # ragged decode, length 1, on and one past a block boundary
    ([1] * 5, [32, 33, 1, 64, 65], 32),
    ([1] * 6, [300, 290, 120, 100, 7, 5], 16),  # several length groups
    ([20, 7, 1, 1, 16], [20, 33, 1, 40, 48], 16),  # whole prompt, chunk after a cached prefix, mixed decode
])
@pytest.mark.parametrize("window", [None, 5])
def test_cpu_sdpa_attention_matches_reference(query_lens, seq_lens, block_size, heads, kv_heads, dtype, window):
    q, kc, vc, meta = make_batch(query_lens, seq_lens, block_size, 64, heads, kv_heads, 64, dtype)
    got = paged_attention_sdpa(q, kc, vc, meta, 0.125, sliding_window=window)
    want = paged_attention_ref(q, kc, vc, meta, 0.125, sliding_window=window)
    torch.testing.assert_close(got.float(), want.float(), **SDPA_TOL[dtype])


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (6, 2, 96), (2, 1, 32)])
@pytest.mark.parametrize("query_lens,seq_lens", [
    ([300], [300]),  # a whole prompt over many key blocks, its rows not a multiple of the kernel's 8
    ([37, 1, 8], [100, 5, 8]),  # a chunk after a cached prefix, a decode, a short prompt
])
@pytest.mark.parametrize("window", [None, 5, 40])
def test_bf16_prefill_attention_is_as_exact_as_torchs_sdpa(query_lens, seq_lens, heads, kv_heads, head_dim, window):
    """bf16 prompts and chunks, with and without a sliding window: our C flash attention where the CPU has
    AVX512-BF16 (torch's SDPA elsewhere) lands as close to the fp32 reference as torch's own bf16 SDPA does."""
    q, kc, vc, meta = make_batch(query_lens, seq_lens, 16, 64, heads, kv_heads, head_dim, torch.bfloat16)
    got = paged_attention_sdpa(q, kc, vc, meta, head_dim ** -0.5, window).float()
    exact = paged_attention_ref(q.float(), kc.float(), vc.float(), meta, head_dim ** -0.5, window)
    sdpa_err, start = 0.0, 0
    for b, (q_len, ctx) in enumerate(zip(query_lens, seq_lens)):  # torch's bf16 SDPA on each sequence
        nb = -(-ctx // 16)
        k = kc[meta.block_tables[b, :nb].long()].reshape(-1, kv_heads, head_dim)[:ctx].transpose(0, 1)[None]
        v = vc[meta.block_tables[b, :nb].long()].reshape(-1, kv_heads, head_dim)[:ctx].transpose(0, 1)[None]
        qb = q[start : start + q_len].transpose(0, 1)[None]
        key_pos, q_pos = torch.arange(ctx)[None], torch.arange(ctx - q_len, ctx)[:, None]
        mask = (key_pos <= q_pos) & (key_pos > q_pos - (window or ctx))
        ref = torch.nn.functional.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=head_dim ** -0.5,
                                                               enable_gqa=True)[0].transpose(0, 1).float()
        sdpa_err = max(sdpa_err, float((ref - exact[start : start + q_len]).abs().max()))
        start += q_len
    err = float((got - exact).abs().max())
    assert err <= 1.25 * sdpa_err + 1e-3, (err, sdpa_err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("window", [None, 5])
def test_batch_invariant_attention_matches_reference(heads, kv_heads, dtype, window):
    """The batch-invariant attention (every query token its own row: the C decode kernel on CPU, one program per
    token and no context split in Triton) on whole prompts, a chunk over a cached prefix and decodes; and a
    token gets the same bits whatever else the step holds."""
    q, kc, vc, meta = make_batch([20, 7, 1, 1, 16], [20, 33, 1, 40, 48], 16, 64, heads, kv_heads, 64, dtype)
    want = paged_attention_ref(q, kc, vc, meta, 0.125, sliding_window=window)
    ops = [triton_ops.paged_attention_invariant_triton] + ([paged_attention_invariant_cpu] if native() else [])
    for op in ops:
        meta.plans.clear()
        got = op(q, kc, vc, meta, 0.125, sliding_window=window)
        check(got, want, dtype)
        # the second sequence's 7-token chunk alone in its step
        alone = dataclasses.replace(meta, query_start_loc=torch.tensor([0, 7], dtype=torch.int32),
                                    seq_lens=meta.seq_lens[1:2], block_tables=meta.block_tables[1:2],
                                    query_lens_host=[7], seq_lens_host=[33], max_query_len=7, max_seq_len=33,
                                    token_seq=None, token_pos=None, plans={})
        assert torch.equal(op(q[20:27].contiguous(), kc, vc, alone, 0.125, sliding_window=window), got[20:27])


def test_decode_buckets_cover_every_row_once_and_bound_padding():
    lengths = [random.Random(i).randint(1, 500) for i in range(100)]
    groups = _decode_buckets(lengths, max_waste=0.25)
    assert sorted(i for g in groups for i in g) == list(range(100))
    for g in groups:
        longest = lengths[g[0]]
        assert all(lengths[i] <= longest and lengths[i] >= 0.75 * longest for i in g)
    assert select_ops("auto", "cpu").paged_attention is paged_attention_sdpa


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 64, 300])
def test_cpu_linear_matches_f_linear(rows, dtype):
    from kernels.linear import linear_cpu, linear_ref

    g = torch.Generator().manual_seed(rows)
    x, w, b = (torch.randn(*shape, generator=g).to(dtype) for shape in ((rows, 96), (200, 96), (200,)))
    for bias in (None, b):
        torch.testing.assert_close(linear_cpu(x, w, bias).float(), linear_ref(x, w, bias).float(),
                                   **{torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: TOL[torch.bfloat16]}[dtype])
    assert select_ops("auto", "cpu").linear is linear_cpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_linear_packs_each_weight_once_and_follows_changes(dtype):
    """oneDNN's packed copy of a weight is made once and reused; a weight changed in place (storage or version)
    or dropped by its owner is packed again, so the output always follows the weight's current values."""
    from engine.model_runner import cpu_has_native_bf16
    from kernels.linear import _onednn_mode, drop_packed, linear_cpu, linear_ref, packed_weight

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(40, 96, generator=g).to(dtype), torch.randn(200, 96, generator=g).to(dtype)
    tol = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: TOL[torch.bfloat16]}[dtype]
    if dtype == torch.bfloat16 and not cpu_has_native_bf16():
        # oneDNN has no bf16 inner product on a CPU without AVX512-BF16 / AMX (seen on an AMD EPYC with AVX2):
        # linear_cpu must notice at its probe and take F.linear, never a oneDNN call that fails
        assert _onednn_mode(dtype) is None
        torch.testing.assert_close(linear_cpu(x, w).float(), linear_ref(x, w).float(), **tol)
        return
    assert _onednn_mode(dtype) == "packed", "torch 2.13's CPU build packs oneDNN linear weights"
    first = packed_weight(w)
    assert packed_weight(w) is first
    torch.testing.assert_close(linear_cpu(x, w).float(), linear_ref(x, w).float(), **tol)
    with torch.no_grad():
        w.mul_(-1)  # in place, as a weight push copies: the version counter moves
    assert packed_weight(w) is not first
    torch.testing.assert_close(linear_cpu(x, w).float(), linear_ref(x, w).float(), **tol)
    w.data[:] = 3.0  # through .data, which the version counter does not see: the owner drops the packed copy
    drop_packed([w])
    torch.testing.assert_close(linear_cpu(x, w).float(), linear_ref(x, w).float(), **tol)


def test_cpu_linear_pads_rows_to_a_bounded_set_of_shapes():
    from kernels.linear import row_bucket

    buckets = {row_bucket(m) for m in range(1, 4097)}
    assert len(buckets) <= 80  # oneDNN caches a primitive per shape: this bounds its memory (< its 1024)
    assert all(m <= row_bucket(m) <= m * 1.125 for m in range(1, 4097))


# ------------------------------------------------------- our C kernels for the CPU (kernels/cpu_native.c)
def _native_expected() -> bool:
    """Where they must build: x86-64 with AVX2 + FMA and a C compiler (CI's machine, this project's)."""
    import platform
    import shutil

    from kernels.cpu_native import _cpu_flags

    return (platform.machine() == "x86_64" and {"avx2", "fma"} <= _cpu_flags()[1]
            and (shutil.which("cc") or shutil.which("gcc")) is not None)


def test_native_cpu_kernels_build_where_they_can():
    from kernels.cpu_native import native

    assert (native() is not None) == _native_expected()


def test_native_cpu_kernels_never_see_device_tensors():
    """Should these ops ever be handed device tensors: tensors not in host memory must take the torch
    path, never a C pointer. (The meta device stands in for CUDA: it has no memory a kernel could touch.)"""
    from kernels.activation import silu_mul_cpu
    from kernels.linear import linear_native
    from kernels.norm import rms_norm_cpu

    x, w = torch.empty(1, 64, device="meta"), torch.empty(32, 64, device="meta")
    assert linear_native(x, w) is None
    assert rms_norm_cpu(x, torch.empty(64, device="meta"), 1e-6)[0].device.type == "meta"
    assert silu_mul_cpu(x).device.type == "meta"


@pytest.fixture(scope="session")
def avx2_only_build(tmp_path_factory):
    """Our C kernels built without the AVX-512 flags (None where they cannot build at all)."""
    from kernels.cpu_native import build_avx2_only

    return build_avx2_only(tmp_path_factory.mktemp("avx2_build"))


@pytest.fixture(params=["native", "avx2", "library"])
def cpu_kernels(request, monkeypatch):
    """Each CPU op three times: through our C kernels as built here, through a build without AVX-512 (what CPUs with
    AVX2 alone run: on this CPU the 8-lane loops the AVX-512 build reaches only in tails, and no AVX512-BF16
    kernels), and with them unavailable (the fallback users without a C compiler or AVX2 get)."""
    if request.param in ("library", "avx2"):
        import kernels.activation
        import kernels.kv_cache
        import kernels.linear
        import kernels.norm
        import kernels.paged_attention
        import kernels.rotary

        lib = request.getfixturevalue("avx2_only_build") if request.param == "avx2" else None
        if request.param == "avx2":
            assert (lib is not None) == _native_expected()
        for module in (kernels.activation, kernels.kv_cache, kernels.linear, kernels.norm, kernels.paged_attention,
                       kernels.rotary):
            monkeypatch.setattr(module, "native", lambda: lib)
    return request.param


NATIVE_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=1e-2)}


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (6, 2, 96), (8, 1, 32)])
@pytest.mark.parametrize("query_lens,seq_lens", [
    ([300], [300]),  # a whole prompt over many key blocks, its rows not a multiple of the kernel's 8
    ([37, 1, 8, 70], [100, 5, 8, 70]),  # a chunk after a cached prefix, a decode, short and longer prompts
])
@pytest.mark.parametrize("window", [None, 5, 40])
def test_fp32_prefill_attention_matches_the_reference(cpu_kernels, query_lens, seq_lens, heads, kv_heads, head_dim,
                                                      window):
    """fp32 prompts and chunks, with and without a sliding window: our C flash attention (AVX2 + FMA, tasks
    handed out dynamically) where the C kernels build, torch's SDPA where they do not; both as close to the
    reference as fp32 sums in another order get."""
    from kernels import paged_attention

    q, kc, vc, meta = make_batch(query_lens, seq_lens, 16, 64, heads, kv_heads, head_dim, torch.float32)
    got = paged_attention_sdpa(q, kc, vc, meta, head_dim ** -0.5, window)
    want = paged_attention_ref(q, kc, vc, meta, head_dim ** -0.5, sliding_window=window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    lib = paged_attention.native()
    assert (lib is not None) == (cpu_kernels != "library" and _native_expected())
    if lib is not None:  # the kernel takes this shape (it answers 0 where it would leave it to SDPA)
        k, v = kc[:1].transpose(1, 2).contiguous(), vc[:1].transpose(1, 2).contiguous()  # (1, Hkv, 16, D)
        out = torch.empty(16, heads, head_dim)
        qq = torch.randn(16, heads, head_dim)
        assert lib.kvs_prefill_attention_f32(qq.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), 16, 16, heads,
                                             kv_heads, head_dim, qq.stride(0), k.stride(2), k.stride(1), v.stride(2),
                                             v.stride(1), 0, 0.125, 2) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7])
@pytest.mark.parametrize("in_features,out_features", [(96, 200), (50, 37), (576, 1536), (1536, 64)])
def test_cpu_linear_native_rows(cpu_kernels, rows, in_features, out_features, dtype):
    """Up to NATIVE_MAX_ROWS(_BF16) rows go to the C GEMV, more to oneDNN (tails: inputs not a multiple of 128, 32
    or 8, outputs of any count); bf16 through vdpbf16ps where the CPU has AVX512-BF16. In bf16 both sides sum
    exact products in fp32 and round once, so they differ by at most one bf16 step."""
    from kernels.linear import linear_cpu

    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype)
    for bias in (None, b):
        torch.testing.assert_close(linear_cpu(x, w, bias), torch.nn.functional.linear(x, w, bias), **NATIVE_TOL[dtype])
    strided = torch.randn(rows, 2 * in_features, generator=g).to(dtype)[:, ::2]  # not contiguous: copied first
    torch.testing.assert_close(linear_cpu(strided, w), torch.nn.functional.linear(strided, w), **NATIVE_TOL[dtype])


@pytest.mark.parametrize("rows", [6, 64, 128, 300])
@pytest.mark.parametrize("in_features,out_features", [(96, 200), (576, 1536), (50, 1100)])
def test_fp32_linear_in_dynamically_scheduled_tiles_is_the_librarys_gemm(cpu_kernels, rows, in_features,
                                                                        out_features):
    """From TILED_MIN_ROWS rows, fp32 goes to the tiled linear: tiles of TILE_ROWS x about TILE_COLS (ragged last ones:
    rows and outputs not multiples of them) through the library's own sgemm, taken by the threads one at a time.
    Each output element is that sgemm's dot product, with the bias first as torch's addmm puts it, so the results
    are F.linear's; where the C kernels are unavailable linear_cpu goes on without it."""
    from kernels.linear import TILE_COLS, TILED_MIN_ROWS, _tile_cols, linear_cpu, linear_tiled

    g = torch.Generator().manual_seed(rows + out_features)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g)
    tiled = linear_tiled(x, w, b)
    assert (tiled is None) == (cpu_kernels == "library" or not _native_expected() or rows < TILED_MIN_ROWS)
    for bias in (None, b):
        torch.testing.assert_close(linear_cpu(x, w, bias), torch.nn.functional.linear(x, w, bias),
                                   **NATIVE_TOL[torch.float32])
    if tiled is not None:  # the library's own sums: as close as the same GEMM on another row count gets
        torch.testing.assert_close(tiled, torch.nn.functional.linear(x, w, b), atol=1e-5, rtol=1e-5)
        cols, parts = _tile_cols(out_features), -(-out_features // TILE_COLS)
        assert cols % 16 == 0 and (parts - 1) * cols < out_features <= parts * cols  # even tiles, none empty
        assert linear_tiled(x.bfloat16(), w.bfloat16()) is None  # fp32 only: bf16 keeps oneDNN


@pytest.mark.parametrize("in_features", [576, 100, 37])
def test_fp32_gemv_reads_a_bf16_valued_weight_from_its_bf16_copy_to_the_same_bits(cpu_kernels, in_features):
    """An fp32 weight whose values are all bf16 values (a bf16 checkpoint run in fp32) is read by the GEMV from
    its bf16 copy: half the bytes, and the same bits as the fp32 GEMV over the fp32 weight (the same products, the
    same sums in the same order). A weight that is not bf16-exact keeps the fp32 path, and the copy follows an
    in-place change of the weight and is dropped with the packed copies."""
    from kernels.linear import bf16_copy, drop_packed, linear_cpu, linear_native

    g = torch.Generator().manual_seed(in_features)
    x, b = torch.randn(3, in_features, generator=g), torch.randn(200, generator=g)
    w = torch.randn(200, in_features, generator=g).bfloat16().float()
    got = linear_cpu(x, w, b)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), **NATIVE_TOL[torch.float32])
    if cpu_kernels == "library" or linear_native(x, w, b) is None:
        return  # no C GEMV here: F.linear, and no copy was made for it
    copy = bf16_copy(w)
    assert copy is not None and copy.dtype == torch.bfloat16 and torch.equal(copy.float(), w)
    w_plain = w.clone()  # the same values, made not bf16-exact in its last element: the fp32 GEMV
    w_plain[-1, -1] += 2.0**-20
    assert bf16_copy(w_plain) is None
    same = linear_cpu(x, w_plain, b)
    assert torch.equal(got[:, :-1], same[:, :-1])  # the rows both read in full precision: bit for bit
    before = linear_cpu(x, w)
    with torch.no_grad():
        w.mul_(-1)  # in place, as a weight push copies: the copy is remade from the new values
    assert torch.equal(linear_cpu(x, w), -before) and torch.equal(bf16_copy(w).float(), w)
    drop_packed([w])
    assert not hasattr(w, "_kvscale_bf16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_cpu_rms_norm_and_rotary(cpu_kernels, rows, dtype):
    """RMSNorm (alone and with the residual add) on a strided view, and rotary read in place from a fused
    qkv row: the reference's arithmetic, rounded to bf16 where its ops round; the residual sum and rotary to
    the bit, the norm within one bf16 step (its fp32 statistics are summed in another order)."""
    from kernels.norm import rms_norm_cpu
    from kernels.rotary import rotary_cpu

    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2 * 589, generator=g).to(dtype)[:, :589]  # 36 x 16 + 8 + 5: every loop and its tails
    res, w = torch.randn(rows, 589, generator=g).to(dtype), torch.randn(589, generator=g).to(dtype)
    for residual in (None, res):
        got, want = rms_norm_cpu(x, w, 1e-5, residual), rms_norm_ref(x, w, 1e-5, residual)
        assert got[0].dtype == dtype
        torch.testing.assert_close(got[0], want[0], **({torch.float32: dict(atol=1e-5, rtol=1e-5)} | NATIVE_TOL)[dtype])
        if residual is not None:
            assert torch.equal(got[1], want[1])
    heads, kv_heads, head_dim = 9, 3, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
    pos = torch.randint(0, 100, (rows,), generator=g)
    cos, sin = torch.randn(100, head_dim, generator=g), torch.randn(100, head_dim, generator=g)
    for got, want in zip(rotary_cpu(q, k, pos, cos, sin), rotary_ref(q, k, pos, cos, sin)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_cpu_write_kv_and_silu_mul(cpu_kernels, rows, dtype):
    """The KV write from a strided V (a view of the fused qkv output), padding slots skipped; SwiGLU's gate
    on the fused gate|up output, including odd widths (vector tails) and large |x| (exp's range)."""
    from kernels.activation import silu_mul_cpu, silu_mul_ref
    from kernels.kv_cache import write_kv_cpu

    g = torch.Generator().manual_seed(rows)
    k_ref = torch.randn(8, 16, 3, 64, generator=g).to(dtype)
    v_ref = torch.randn(8, 16, 3, 64, generator=g).to(dtype)
    k_got, v_got = k_ref.clone(), v_ref.clone()
    kv = torch.randn(rows, 2 * 3 * 64 + 5, generator=g).to(dtype)
    key, value = kv[:, :192].view(rows, 3, 64), kv[:, 192:384].view(rows, 3, 64)
    slots = torch.randperm(8 * 16, generator=g)[:rows]
    slots[::2] = -1
    write_kv_ref(key, value, k_ref, v_ref, slots)
    write_kv_cpu(key, value, k_got, v_got, slots)
    assert torch.equal(k_got, k_ref) and torch.equal(v_got, v_ref)
    for inter in (1536, 13):
        gate_up = (torch.randn(rows, 2 * inter + 3, generator=g) * 30).to(dtype)[:, : 2 * inter]
        got = silu_mul_cpu(gate_up)
        assert got.dtype == dtype
        torch.testing.assert_close(got, silu_mul_ref(gate_up), **({torch.float32: dict(atol=1e-5, rtol=1e-5)}
                                                                  | NATIVE_TOL)[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (9, 3)])
@pytest.mark.parametrize("window", [None, 5, 100])
def test_cpu_decode_attention_reads_pages_in_place(cpu_kernels, head_dim, heads, kv_heads, window, dtype):
    """The C decode kernel (fp32 and bf16 pages) against the reference: ragged contexts of 1 to 300 keys
    (softmax tails not a multiple of 8), a block boundary, a head_dim that is not a multiple of 16 (80) or of 8
    (the scalar path), windows, GQA 1/3/4."""
    seq_lens = [1, 7, 16, 17, 300, 129]
    q, kc, vc, meta = make_batch([1] * len(seq_lens), seq_lens, 16, 64, heads, kv_heads, head_dim, dtype)
    scale = head_dim**-0.5
    got = paged_attention_sdpa(q, kc, vc, meta, scale, sliding_window=window)
    torch.testing.assert_close(got, paged_attention_ref(q, kc, vc, meta, scale, sliding_window=window),
                               **SDPA_TOL[dtype])


# ---------------------------------------------------------------------------------------------- the rest
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_skips_padding(block_size, dtype):
    g = torch.Generator().manual_seed(1)
    k_ref = torch.randn(6, block_size, 2, 64, generator=g).to(dtype)
    v_ref = torch.randn(6, block_size, 2, 64, generator=g).to(dtype)
    k_tri, v_tri = k_ref.clone(), v_ref.clone()
    slots = torch.tensor([0, block_size - 1, block_size, -1, 5 * block_size + 3, -1], dtype=torch.int64)
    key = torch.randn(6, 2, 64, generator=g).to(dtype)
    value = torch.randn(6, 2, 64, generator=g).to(dtype)
    write_kv_ref(key, value, k_ref, v_ref, slots)
    triton_ops.write_kv_triton(key, value, k_tri, v_tri, slots)
    assert torch.equal(k_tri, k_ref) and torch.equal(v_tri, v_ref)  # a copy is exact, padding untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(with_residual, dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 96, generator=g).to(dtype)  # hidden not a power of two
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    res = torch.randn(7, 96, generator=g).to(dtype) if with_residual else None
    want, want_res = rms_norm_ref(x, w, 1e-6, res)
    got, got_res = triton_ops.rms_norm_triton(x, w, 1e-6, res)
    check(got, want, dtype)
    if with_residual:  # fp32: the same sum; bf16: one rounding apart at most (see the module docstring)
        check(got_res, want_res, dtype)
        if dtype == torch.float32:
            assert torch.equal(got_res, want_res)
    else:
        assert got_res is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary(head_dim, dtype):
    g = torch.Generator().manual_seed(3)
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(512).float(), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    q = torch.randn(9, 8, head_dim, generator=g).to(dtype)
    k = torch.randn(9, 3, head_dim, generator=g).to(dtype)  # a head count not a power of two: masked heads
    pos = torch.tensor([0, 1, 2, 15, 16, 17, 300, 301, 511])
    want_q, want_k = rotary_ref(q, k, pos, cos, sin)
    got_q, got_k = triton_ops.rotary_triton(q, k, pos, cos, sin)
    check(got_q, want_q, dtype)
    check(got_k, want_k, dtype)


def test_rms_norm_per_head_on_a_strided_view():
    """Qwen3 normalizes q and k per head: a (T, H, D) view into the fused qkv projection."""
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(5, 3 * 4 * 32, generator=g)
    q = qkv[:, : 4 * 32].view(5, 4, 32)
    w = 1 + 0.1 * torch.randn(32, generator=g)
    check(triton_ops.rms_norm_triton(q, w, 1e-6)[0], rms_norm_ref(q, w, 1e-6)[0], torch.float32)


def test_select_ops_is_the_one_switch():
    from kernels import REFERENCE_OPS

    assert select_ops("auto", "cpu").name == "cpu"
    assert select_ops("reference", "cpu") is REFERENCE_OPS and select_ops("reference", "cuda") is REFERENCE_OPS
    assert select_ops("triton", "cpu").name == "triton"
    assert select_ops("auto", "cuda").name == "triton"
    with pytest.raises(ValueError, match="host memory"):
        select_ops("cpu", "cuda")
    with pytest.raises(ValueError, match="'torch' is now 'cpu'"):
        select_ops("torch", "cpu")


def test_cpu_ops_are_bound_once_for_the_dtype(monkeypatch):
    """fp32 and bf16 (the default dtype on CPUs with native bf16) bind our C kernels where they build; other
    dtypes, or no C kernels, bind the library ops directly rather than checking and falling back every call."""
    import kernels
    from kernels.norm import rms_norm_cpu

    for dtype in (torch.float32, torch.bfloat16):
        ops = select_ops("cpu", "cpu", dtype)
        assert (ops.rms_norm is rms_norm_cpu) == _native_expected() and ops.paged_attention is paged_attention_sdpa
    half = select_ops("cpu", "cpu", torch.float16)
    assert half.rms_norm is rms_norm_ref and half.rotary is rotary_ref and half.write_kv is write_kv_ref
    assert "no C kernels for torch.float16" in half.description
    monkeypatch.setattr(kernels, "native", lambda: None)
    assert select_ops("cpu", "cpu", torch.bfloat16).rms_norm is rms_norm_ref


# ---------------------------------------------------------------------------------------------- fp8 KV cache
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
K_SCALE, V_SCALE = 0.02, 0.005  # randn K/V up to ~4.5: K/k_scale ~ 225 and V/v_scale ~ 900 (e4m3 clamps V at 448)


def _fp8_batch(query_lens, seq_lens, kv_dtype, dtype, heads=8, kv_heads=2, head_dim=64, block_size=16):
    """make_batch's K/V stored in fp8; and the dequantized cache the references attend over."""
    q, kc, vc, meta = make_batch(query_lens, seq_lens, block_size, 64, heads, kv_heads, head_dim, dtype)
    k8, v8 = quantize(kc, K_SCALE, kv_dtype), quantize(vc, V_SCALE, kv_dtype)
    return q, k8, v8, meta, dequantize(k8, K_SCALE, dtype), dequantize(v8, V_SCALE, dtype)


def _fp8_writes(kv_dtype, dtype):
    g = torch.Generator().manual_seed(3)
    key = (torch.randn(7, 2, 64, generator=g) * 3).to(dtype)
    value = (torch.randn(7, 2, 64, generator=g) * 3).to(dtype)
    slots = torch.tensor([0, 15, 16, -1, 83, 40, -1], dtype=torch.int64)
    return key, value, slots


def _same_codes(triton_cache: torch.Tensor, ref: torch.Tensor) -> None:
    """Triton's fp8 codes against the reference's: equal, or neighbours. Triton's CPU interpreter (not the GPU)
    also drops the carry when rounding up reaches a power of two (torch 8.0, interpreter 4.0): there, that
    one case is allowed too."""
    x, y = triton_cache.view(torch.uint8).int(), ref.view(torch.uint8).int()
    ok = (x - y).abs() <= 1
    if DEVICE.type == "cpu":
        got, want = triton_cache.float(), ref.float()
        power_of_two = want.abs().log2().frac() == 0
        ok |= power_of_two & (got == want / 2)
    assert (x == y).float().mean() > 0.98 and bool(ok.all())


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_kv_write_every_backend_stores_the_references_codes(cpu_kernels, kv_dtype, dtype):
    key, value, slots = _fp8_writes(kv_dtype, dtype)
    caches = {name: (torch.zeros(6, 16, 2, 64, dtype=kv_dtype), torch.zeros(6, 16, 2, 64, dtype=kv_dtype))
              for name in ("ref", "cpu", "triton")}
    write_kv_ref(key, value, *caches["ref"], slots, K_SCALE, V_SCALE)
    select_ops("cpu", "cpu", dtype).write_kv(key, value, *caches["cpu"], slots, K_SCALE, V_SCALE)
    triton_ops.write_kv_triton(key, value, *caches["triton"], slots, K_SCALE, V_SCALE)
    k_ref, v_ref = caches["ref"]
    assert torch.equal(caches["cpu"][0].view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(caches["cpu"][1].view(torch.uint8), v_ref.view(torch.uint8))
    _same_codes(caches["triton"][0], k_ref)
    _same_codes(caches["triton"][1], v_ref)
    # what was stored is K / k_scale to fp8's precision (values past the format's range clamp), padding untouched
    written = slots[slots >= 0]
    stored = dequantize(k_ref, K_SCALE, torch.float32).view(-1, 2, 64)[written]
    limit = torch.finfo(kv_dtype).max * K_SCALE
    torch.testing.assert_close(stored, key[slots >= 0].float().clamp(-limit, limit), rtol=0.13, atol=K_SCALE * 2**-6)
    untouched = torch.ones(6 * 16, dtype=torch.bool)
    untouched[written] = False
    assert not k_ref.view(-1, 2, 64)[untouched].float().any()


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (6, 3, 128), (4, 4, 40)])
def test_fp8_decode_is_the_same_arithmetic_as_a_cache_holding_its_values(cpu_kernels, kv_dtype, dtype, heads,
                                                                         kv_heads, head_dim):
    """Every fp8 code is exactly a bf16 (and fp32) value, so decode over an fp8 cache at scale 1 gives, bit for
    bit, what decode over a cache of the query's dtype holding those values gives: one arithmetic for both, so
    an fp8 cache changes answers only through its values, never through a kernel of its own."""
    q, kc, vc, meta = make_batch([1, 1, 1, 1, 1], [1, 17, 40, 300, 129], 16, 64, heads, kv_heads, head_dim, dtype)
    k8, v8 = quantize(kc, 1.0, kv_dtype), quantize(vc, 1.0, kv_dtype)
    kd, vd = dequantize(k8, 1.0, dtype), dequantize(v8, 1.0, dtype)
    got = paged_attention_sdpa(q, k8, v8, meta, 0.125, None, 1.0, 1.0)
    meta.plans.clear()
    want = paged_attention_sdpa(q, kd, vd, meta, 0.125, None)
    assert torch.equal(got, want)
    torch.testing.assert_close(got, paged_attention_ref(q, kd, vd, meta, 0.125), **FP8_TOL[dtype])


FP8_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("query_lens,seq_lens", [
    ([1, 1, 1, 1], [1, 17, 40, 300]),  # decode: ragged, a block boundary, a long context
    ([3, 1, 9], [3, 20, 41]),  # a whole prompt, a decode, a chunk over a cached prefix
])
@pytest.mark.parametrize("own", [False, True])
def test_fp8_attention_every_backend_matches_the_reference_on_the_dequantized_cache(
        cpu_kernels, query_lens, seq_lens, window, kv_dtype, dtype, own):
    """Over the dequantized cache; with `own`, this step's tokens (the query tokens' own K/V, passed as
    written) replace what the fp8 pages hold at their slots."""
    q, k8, v8, meta, k_deq, v_deq = _fp8_batch(query_lens, seq_lens, kv_dtype, dtype)
    g = torch.Generator().manual_seed(7)
    key = torch.randn(q.shape[0], k8.shape[2], k8.shape[3], generator=g).to(dtype) if own else None
    value = torch.randn(q.shape[0], k8.shape[2], k8.shape[3], generator=g).to(dtype) if own else None
    if own:  # as written: the pages hold their quantized form, the references see them exact
        write_kv_ref(key, value, k8, v8, meta.slot_mapping, K_SCALE, V_SCALE)
        k_deq, v_deq = dequantize(k8, K_SCALE, dtype), dequantize(v8, V_SCALE, dtype)
        write_kv_ref(key, value, k_deq, v_deq, meta.slot_mapping)
    want = paged_attention_ref(q, k_deq, v_deq, meta, 0.125, sliding_window=window)
    check_ref = paged_attention_ref(q, k8, v8, meta, 0.125, window, K_SCALE, V_SCALE, key, value)
    torch.testing.assert_close(check_ref, want, atol=0, rtol=0)  # the reference reads them exactly so
    meta.plans.clear()
    got = paged_attention_sdpa(q, k8, v8, meta, 0.125, window, K_SCALE, V_SCALE, key, value)  # C decode or SDPA
    torch.testing.assert_close(got, want, **FP8_TOL[dtype])
    if cpu_kernels != "native":  # the Triton kernels do not use the C build: checked once, with the "native" case
        return
    for splits in (None, 2):
        got = triton_ops.paged_attention_triton(q, k8, v8, meta, 0.125, window, K_SCALE, V_SCALE, key, value,
                                                num_splits=splits)
        torch.testing.assert_close(got, want, **FP8_TOL[dtype])
    if not own:  # batch-invariant mode: own tokens are read as written only by the query token itself, which a
        # chunk's other tokens see from the pages; without `own` the pages are all there is, as in the reference
        invariant = [triton_ops.paged_attention_invariant_triton] + ([paged_attention_invariant_cpu] if native() else [])
        for op in invariant:
            meta.plans.clear()
            torch.testing.assert_close(op(q, k8, v8, meta, 0.125, window, K_SCALE, V_SCALE), want,
                                       **FP8_TOL[dtype])
