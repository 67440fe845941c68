"""Three real workloads, each in a process of its own, natively or under torch_budget.install():

  llama_generate   HF transformers Llama (random weights, GQA, bf16): generate for three batches
                   of different prompt lengths, eager, dynamic KV cache;
  resnet_amp       torchvision ResNet-50 training with autocast (fp16) and a GradScaler;
  decode_graphs    a small decoder's decode step over a static KV cache under
                   torch.compile(mode="reduce-overhead") (CUDA graph trees), prefill eager.
and one that separates the GPU's side of the first from its CPU side:

  weights_graph    weights of llama_generate's sizes (allocated in a model's order) read
                   by a decode step's matmuls for a batch of 4, captured once in a CUDA graph
                   and replayed: GPU time over the allocator's memory alone, with no allocation
                   and next to no CPU work in the timed part. Equal natively and installed, a gap
                   in llama_generate is on the CPU's side; not equal, the memory itself differs.
                   Its result also names the kernels of one replay and one eager step, and
                   each weight's address alignment (cuBLAS picks kernels per call).

    python tools/workloads.py NAME [--install] [--record TRACE] [--steps N] [--repeats K] [--pin] [--lockstep]

prints `WORKLOAD {json}`: seconds of the timed part (the median of K timed runs after a warm one:
one run of a process is as noisy as its first steps), peak reserved and allocated bytes, and a
checksum of each timed run's outputs (equal natively and installed). With --pin the process
runs on the CPU cores beside the GPU and its main thread, once warm, on one of them, the same in
every process (torch_budget.replay.machine): where a process lands moved the timed part by up
to 2x between processes. With --record the allocations are
recorded with torch's own memory history and saved as a torch_budget trace (replay.trace).
With --lockstep the process, once warm, runs its timed part each time its parent asks (the protocol
of torch_budget.replay.lockstep: `run` answers {"seconds", "check"}, `result` the peaks), so a parent
can interleave it run by run with another process (tools/bench_e2e.py).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def llama_generate(torch, steps):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                      num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
    model = LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    batches = [(4, 96, 48), (2, 320, 32), (8, 40, 40)][:steps]

    def run():
        out = 0
        g = torch.Generator(device="cpu").manual_seed(1)
        for b, prompt, new in batches:
            ids = torch.randint(3, cfg.vocab_size, (b, prompt), generator=g).cuda()
            with torch.no_grad():
                seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                     min_new_tokens=new, do_sample=False, pad_token_id=0)
            out += int(seq.sum())
        return out

    return run


def resnet_amp(torch, steps):
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")
    g = torch.Generator(device="cpu").manual_seed(1)
    data = [(torch.randn(32, 3, 224, 224, generator=g), torch.randint(0, 1000, (32,), generator=g))
            for _ in range(2)]

    def run():
        losses = []
        for i in range(steps):
            x, y = data[i % 2]
            x = x.cuda(non_blocking=True).to(memory_format=torch.channels_last)
            y = y.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.detach())
        return float(torch.stack(losses).float().sum())

    return run


def decode_graphs(torch, steps):
    import torch.nn.functional as F

    torch.manual_seed(0)
    layers, heads, kv_heads, dim, vocab, batch, max_len = 4, 16, 4, 1024, 32000, 8, 512
    hd = dim // heads

    class Decoder(torch.nn.Module):
        """Weights are parameters and the KV cache buffers: graph trees treat both as static
        inputs, so the in-place cache update keeps the step in a CUDA graph."""

        def __init__(self):
            super().__init__()
            p = lambda *shape: torch.nn.Parameter(torch.randn(*shape, dtype=torch.bfloat16) * 0.02,
                                                  requires_grad=False)
            self.emb = p(vocab, dim)
            self.qkv = torch.nn.ParameterList([p(dim, dim + 2 * kv_heads * hd) for _ in range(layers)])
            self.out = torch.nn.ParameterList([p(dim, dim) for _ in range(layers)])
            self.up = torch.nn.ParameterList([p(dim, 4 * dim) for _ in range(layers)])
            self.down = torch.nn.ParameterList([p(4 * dim, dim) for _ in range(layers)])
            for i in range(layers):
                self.register_buffer(f"k{i}", torch.zeros(batch, kv_heads, max_len, hd, dtype=torch.bfloat16))
                self.register_buffer(f"v{i}", torch.zeros(batch, kv_heads, max_len, hd, dtype=torch.bfloat16))

        def forward(self, tokens, pos, mask):
            x = self.emb[tokens]
            b, t = x.shape[:2]
            for i in range(layers):
                q, k, v = (x @ self.qkv[i]).split([dim, kv_heads * hd, kv_heads * hd], dim=-1)
                q = q.view(b, t, heads, hd).transpose(1, 2)
                ck, cv = getattr(self, f"k{i}"), getattr(self, f"v{i}")
                ck.index_copy_(2, pos, k.view(b, t, kv_heads, hd).transpose(1, 2))
                cv.index_copy_(2, pos, v.view(b, t, kv_heads, hd).transpose(1, 2))
                a = F.scaled_dot_product_attention(q, ck, cv, attn_mask=mask, enable_gqa=True)
                x = x + a.transpose(1, 2).reshape(b, t, dim) @ self.out[i]
                x = x + F.gelu(x @ self.up[i]) @ self.down[i]
            return x[:, -1] @ self.emb.t()

    model = Decoder().cuda()
    step = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    prompt = 64
    g = torch.Generator(device="cpu").manual_seed(1)

    def run():
        tokens = torch.randint(0, vocab, (batch, prompt), generator=g).cuda()
        pos = torch.arange(prompt, device="cuda")
        mask = (torch.arange(max_len, device="cuda")[None, :] <= pos[:, None])[None, None]
        with torch.no_grad():
            nxt = model(tokens, pos, mask).argmax(-1, keepdim=True)
            total = 0
            for t in range(prompt, prompt + 16 * steps):
                p = torch.tensor([t], device="cuda")
                m = (torch.arange(max_len, device="cuda") <= t)[None, None, None, :]
                nxt = step(nxt, p, m).argmax(-1, keepdim=True).clone()
                total += int(nxt.sum())
        return total

    return run


def weights_graph(torch, steps):
    torch.manual_seed(0)
    dim, inter, layers, kv, vocab, batch = 1024, 2816, 8, 256, 32000, 4  # llama_generate's LlamaConfig
    w = lambda *shape: torch.randn(*shape, dtype=torch.bfloat16, device="cuda") * 0.02
    blocks = [(w(dim, dim + 2 * kv), w(dim, dim), w(dim, inter), w(dim, inter), w(inter, dim)) for _ in range(layers)]
    head = w(dim, vocab)
    x = torch.randn(batch, dim, dtype=torch.bfloat16, device="cuda")

    def norm(h):
        return (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)

    def step(h):
        for qkv, o, gate, up, down in blocks:
            h = norm(h + (h @ qkv)[:, :dim] @ o)
            h = norm(h + (torch.nn.functional.silu(h @ gate) * (h @ up)) @ down)
        return h @ head

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # cuBLAS's workspaces and handles, before the capture
        for _ in range(3):
            step(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(x)

    def run():
        for _ in range(100 * steps):
            graph.replay()
        return float(out.float().sum())

    def describe():
        """What could make the GPU's side differ under another allocator: the kernels one replay
        and one eager step launch (cuBLAS picks its kernels per call), and each weight's alignment."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            step(x)
            torch.cuda.synchronize()
        kernels = [e.name for e in sorted(prof.events(), key=lambda e: e.time_range.start)
                   if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()]
        return {"kernels": kernels, "align": [alignment(t.data_ptr()) for b in blocks for t in b] + [alignment(head.data_ptr())]}

    run.describe = describe
    return run


def alignment(address, most=2 << 20):
    """The largest power of two up to `most` that divides `address`."""
    return min(address & -address, most) if address else most


WORKLOADS = {"llama_generate": (llama_generate, 3), "resnet_amp": (resnet_amp, 6), "decode_graphs": (decode_graphs, 6),
             "weights_graph": (weights_graph, 5)}


def serve(torch, run):
    """Lockstep (torch_budget.replay.lockstep): `run` times the timed part once, `result` the peaks."""
    from torch_budget.replay import lockstep

    def timed():
        lockstep.turn_starts()
        t0 = time.perf_counter()
        check = run()
        torch.cuda.synchronize()
        return json.dumps({"seconds": time.perf_counter() - t0, "check": check})

    def peaks():
        return json.dumps({"peak_reserved": torch.cuda.max_memory_reserved(),
                           "peak_allocated": torch.cuda.max_memory_allocated(), **described(run)})

    lockstep.serve({"run": timed, "result": peaks})
    return 0


def described(run):
    """A workload's own description of its GPU side (weights_graph's kernels and alignments), after
    its timed runs; {} for the others."""
    describe = getattr(run, "describe", None)
    return {"describe": describe()} if describe else {}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("name", choices=sorted(WORKLOADS))
    ap.add_argument("--install", action="store_true")
    ap.add_argument("--record", metavar="TRACE")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs; their median is reported")
    ap.add_argument("--pin", action="store_true", help="run beside the GPU, timed on one core")
    ap.add_argument("--lockstep", action="store_true", help="once warm, run as the parent asks on stdin")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.pin:
        from torch_budget.replay.machine import pin_near_gpu

        pin_near_gpu()  # before torch: what it touches first lands on the GPU's node
    import torch

    if args.install:
        import torch_budget

        torch_budget.install()
    make, default_steps = WORKLOADS[args.name]
    if args.record:
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, context=None, stacks="python")
    run = make(torch, args.steps or default_steps)
    torch.cuda.synchronize()
    warm = run()  # compiles, captures and fills caches; its allocations are part of the trace
    torch.cuda.synchronize()
    if args.pin:
        from torch_budget.replay.machine import pin_to_one_core

        pin_to_one_core()  # the thread that launches the timed part (compiling had every local core)
    if args.lockstep:
        return serve(torch, run)
    times, checks = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        checks.append(run())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out = {"workload": args.name, "installed": args.install, "seconds": sorted(times)[len(times) // 2],
           "times": times, "check": checks, "warm_check": warm,
           "peak_reserved": torch.cuda.max_memory_reserved(), "peak_allocated": torch.cuda.max_memory_allocated(),
           **described(run)}
    if args.record:
        from torch_budget.replay.trace import from_snapshot

        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = from_snapshot(snap, args.name)
        trace.comments.insert(0, f"{args.name}: tools/workloads.py, torch {torch.__version__}, "
                                 f"{torch.cuda.get_device_name()}")
        trace.check().save(args.record)
        out["trace_ops"] = len(trace)
        out["trace_peak_live"] = trace.peak_live()
    print("WORKLOAD " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
