#!/usr/bin/env python3
"""A small GPT trained with each half-precision stage as its attention, beside PyTorch's SDPA.

The kernel tests compare one call's outputs and gradients with a reference; this compares what
a user sees: a randomly initialised decoder-only GPT (no downloads) is trained for a few
hundred steps on a fixed synthetic corpus, once with torch SDPA for each of two model seeds and
once with each stage (model seed 0), and the loss curves must agree within the difference
between the two SDPA seeds (agreement(), below, says exactly how).

    python3 python/tests/gpt.py --steps 300 --tsv training.tsv     # train, print, exit 1 on FAIL
    python3 python/tests/gpt.py --plot training.tsv --png training.png   # gnuplot, no torch

As a module (python/tests/test_training.py does this):

    import gpt
    curves = gpt.run_comparison(steps=300)      # {"sdpa_seed0": [loss, ...], ...}
    gpt.write_tsv("training.tsv", curves)
    for stage, (deviation, noise, ok) in gpt.agreement(curves).items(): ...

The corpus: sequences drawn from a sparse order-2 Markov chain over VOCAB = 64 tokens. Each
pair of tokens (a, b) has three possible next tokens, fixed by CORPUS_SEED, so the best
possible loss is the entropy of SUCCESSOR_PROBS (0.94 nats) against ln 64 = 4.16 at the start.
The token before the current one matters, so the model can go below the bigram loss (3.80
nats on this corpus) only through attention: an attention that is wrong learns visibly
differently.
The corpus and the order of the batches are the same for every run; a run's seed changes only
the initial weights (there is no dropout).

Training uses torch.autocast(bfloat16) on CUDA, so the attention inputs are bf16, which the
stages 07-12 take; on the CPU (a smoke test without a GPU) it runs in float32 with SDPA only.
"""
import argparse
import datetime
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

# ---- the corpus --------------------------------------------------------------------------

VOCAB = 64
# The next-token distribution of every context (a, b): three successors, with these
# probabilities. Sparse enough that the chain is far from uniform (entropy 0.94 nats against
# 4.16), with a second and third choice so that the loss does not fall to zero.
SUCCESSOR_PROBS = (0.6, 0.25, 0.15)
# Fixed for the corpus and the batch order, apart from the model seeds (0 and 1).
CORPUS_SEED = 20240601
# 4096 sequences of CONTEXT + 1 tokens: about a million tokens. 300 steps of 32 sequences go
# over it a little more than twice, so the runs see repeated sequences but every context
# (a, b) hundreds of times.
CORPUS_SEQUENCES = 4096


def best_possible_loss():
    """The entropy of the chain's next token given the two before it, in nats."""
    return -sum(p * math.log(p) for p in SUCCESSOR_PROBS)


@dataclass(frozen=True)
class Config:
    """The model and its training. The default (3.2 M parameters, 8192 tokens a step) trains
    300 steps in seconds on a GPU while its attention is a real one: 4 heads of d = 64 over
    256 positions, a head dim every half-precision stage supports."""
    layers: int = 4
    d_model: int = 256
    heads: int = 4
    # Key/value heads: 0 means `heads` (multi-head attention); fewer is grouped-query
    # attention, each K/V head shared by heads / kv_heads query heads.
    kv_heads: int = 0
    context: int = 256
    batch: int = 32
    # AdamW as in GPT-2 and nanoGPT (betas, weight decay, clipping); a short linear warm-up,
    # then a cosine decay to a tenth over the run's own number of steps. The peak rate was
    # the faster of two tried on the CPU (2e-3, 4e-3): with it the loss's steep fall, from the
    # bigram plateau (3.8 nats) to about 1.5, is over by step 150, before the compared half.
    lr: float = 4e-3
    warmup_steps: int = 20
    min_lr_fraction: float = 0.1
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    grad_clip: float = 1.0

    @property
    def head_dim(self):
        return self.d_model // self.heads

    @property
    def kv_dim(self):
        return (self.kv_heads or self.heads) * self.head_dim


def make_corpus(config, device="cpu"):
    """[CORPUS_SEQUENCES, context + 1] token ids, the same on every device and every call:
    drawn on the CPU from a generator of its own, seeded with CORPUS_SEED."""
    import torch
    gen = torch.Generator().manual_seed(CORPUS_SEED)
    contexts = VOCAB * VOCAB
    # Each context's successors: distinct tokens, the first few of a random permutation.
    successors = torch.rand(contexts, VOCAB, generator=gen).argsort(dim=1)
    successors = successors[:, :len(SUCCESSOR_PROBS)]
    cumulative = torch.tensor(SUCCESSOR_PROBS).cumsum(0)
    cumulative[-1] = 1.0  # so that a draw of 0.99999... never falls past the last choice
    n, length = CORPUS_SEQUENCES, config.context + 1
    tokens = torch.empty(n, length, dtype=torch.long)
    # A uniformly random start for every sequence, so no part of the chain is left unseen.
    tokens[:, :2] = torch.randint(0, VOCAB, (n, 2), generator=gen)
    for t in range(2, length):
        rank = torch.searchsorted(cumulative, torch.rand(n, generator=gen), right=True)
        context = tokens[:, t - 2] * VOCAB + tokens[:, t - 1]
        tokens[:, t] = successors[context, rank.clamp(max=len(SUCCESSOR_PROBS) - 1)]
    return tokens.to(device)


def batch_order(steps, batch):
    """The corpus rows of each step: shuffled epochs from a generator seeded with CORPUS_SEED,
    the same for every run."""
    import torch
    gen = torch.Generator().manual_seed(CORPUS_SEED + 1)
    rows = []
    while len(rows) < steps * batch:
        rows += torch.randperm(CORPUS_SEQUENCES, generator=gen).tolist()
    return torch.tensor(rows[:steps * batch]).view(steps, batch)


# ---- the model ---------------------------------------------------------------------------
# Written as functions of a dictionary of tensors rather than as nn.Modules, so that this file
# imports without torch (the plotting needs none) and every operation is in sight.


def init_params(config, seed, device):
    """GPT-2's initialisation (normal, std 0.02; the projections into the residual stream
    scaled by 1/sqrt(2 layers)), drawn on the CPU from `seed` so that the weights are the same
    on every device."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    d, hidden = config.d_model, 4 * config.d_model

    def normal(*shape, std=0.02):
        return torch.randn(*shape, generator=gen) * std

    residual_std = 0.02 / math.sqrt(2 * config.layers)
    p = {"embed": normal(VOCAB, d), "final_norm.w": torch.ones(d),
         "final_norm.b": torch.zeros(d)}
    for i in range(config.layers):
        p.update({f"{i}.attn_norm.w": torch.ones(d), f"{i}.attn_norm.b": torch.zeros(d),
                  f"{i}.qkv": normal(d, d + 2 * config.kv_dim), f"{i}.attn_out": normal(d, d, std=residual_std),
                  f"{i}.mlp_norm.w": torch.ones(d), f"{i}.mlp_norm.b": torch.zeros(d),
                  f"{i}.mlp_in": normal(d, hidden), f"{i}.mlp_in_bias": torch.zeros(hidden),
                  f"{i}.mlp_out": normal(hidden, d, std=residual_std)})
    return {k: v.to(device).requires_grad_() for k, v in p.items()}


def rotary_tables(config, t, device):
    """cos and sin [t, head_dim] of rotary position embeddings (RoPE, base 10000).

    Rotary rather than learned absolute positions: the corpus needs a head that looks at the
    previous token, and with learned positions (tried on the CPU) the loss sat on the bigram
    plateau for 150 steps before such a head formed, then fell steeply in the second half,
    where agreement() compares; with RoPE the offset is in q.k from the start."""
    import torch
    half = config.head_dim // 2
    freq = 10000.0 ** (-torch.arange(half, dtype=torch.float32, device=device) / half)
    angle = torch.arange(t, dtype=torch.float32, device=device)[:, None] * freq
    angle = torch.cat([angle, angle], dim=-1)
    return angle.cos(), angle.sin()


def rotate(x, cos, sin):
    """RoPE on [B, H, T, head_dim] (or [B, T, H, head_dim] with cos and sin [T, 1, head_dim]),
    computed in float32, returned in x's dtype."""
    import torch
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    return (x32 * cos + torch.cat([-second, first], dim=-1) * sin).to(x.dtype)


def forward(params, tokens, config, attention):
    """Logits [B, T, VOCAB] of a pre-LayerNorm GPT; attention(q, k, v) takes and returns
    [B, H, T, head_dim] (k and v with config.kv_heads heads), or [B, T, H, head_dim],
    FlashAttention's layout, where it has an attribute seq_major = True, and must be causal.
    The output embedding is the input one (tied)."""
    import torch.nn.functional as F
    p, (b, t), d = params, tokens.shape, config.d_model
    seq_major = getattr(attention, "seq_major", False)
    cos, sin = rotary_tables(config, t, tokens.device)
    if seq_major:  # positions are dim 1, heads dim 2
        cos, sin = cos[:, None], sin[:, None]
    kv_heads = config.kv_heads or config.heads
    x = p["embed"][tokens]
    for i in range(config.layers):
        h = F.layer_norm(x, (d,), p[f"{i}.attn_norm.w"], p[f"{i}.attn_norm.b"])
        q, k, v = (h @ p[f"{i}.qkv"]).split([d, config.kv_dim, config.kv_dim], dim=-1)
        q = q.view(b, t, config.heads, config.head_dim)
        k, v = (z.view(b, t, kv_heads, config.head_dim) for z in (k, v))
        if not seq_major:
            q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        o = attention(q, k, v)
        o = (o if seq_major else o.transpose(1, 2)).reshape(b, t, d)
        x = x + o @ p[f"{i}.attn_out"]
        h = F.layer_norm(x, (d,), p[f"{i}.mlp_norm.w"], p[f"{i}.mlp_norm.b"])
        x = x + F.gelu(h @ p[f"{i}.mlp_in"] + p[f"{i}.mlp_in_bias"]) @ p[f"{i}.mlp_out"]
    x = F.layer_norm(x, (d,), p["final_norm.w"], p["final_norm.b"])
    return x @ p["embed"].t()


def learning_rate(config, step, steps):
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, steps - config.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return config.lr * (config.min_lr_fraction + (1 - config.min_lr_fraction) * cosine)


def train(attention, seed, steps=300, config=Config(), device="cuda", autocast=None,
          name="run", corpus=None, log=sys.stderr):
    """Per-step training losses (floats, nats) of a run from the initial weights of `seed`.
    autocast: bf16 autocast, by default on CUDA only (the CPU smoke test runs float32)."""
    import torch
    import torch.nn.functional as F
    device = torch.device(device)
    autocast = device.type == "cuda" if autocast is None else autocast
    corpus = make_corpus(config, device) if corpus is None else corpus.to(device)
    order = batch_order(steps, config.batch)
    params = init_params(config, seed, device)
    # Weight decay on the matrices only, not on the norms and biases.
    matrices = [v for k, v in params.items() if v.dim() == 2]
    others = [v for k, v in params.items() if v.dim() != 2]
    opt = torch.optim.AdamW([{"params": matrices, "weight_decay": config.weight_decay},
                             {"params": others, "weight_decay": 0.0}],
                            lr=config.lr, betas=config.betas,
                            fused=device.type == "cuda")
    losses = []  # kept on the device: reading each one would wait for the GPU every step
    start = time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(config, step, steps)
        batch = corpus[order[step].to(device)]
        inputs, targets = batch[:, :-1], batch[:, 1:]
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = forward(params, inputs, config, attention)
        loss = F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), config.grad_clip)
        opt.step()
        losses.append(loss.detach())
        # Progress every PROGRESS_EVERY steps: a 300-step run is four lines.
        if log and ((step + 1) % PROGRESS_EVERY == 0 or step + 1 == steps):
            print(f"gpt: {name}: step {step + 1}/{steps}, loss {loss.item():.4f}, "
                  f"{time.perf_counter() - start:.1f} s", file=log, flush=True)
    return torch.stack(losses).float().cpu().tolist()


PROGRESS_EVERY = 50

# ---- the comparison ----------------------------------------------------------------------

SDPA_RUNS = ("sdpa_seed0", "sdpa_seed1")


def sdpa_attention(q, k, v):
    import torch.nn.functional as F
    return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                          enable_gqa=k.shape[1] != q.shape[1])


def flash_attn_func_attention(q, k, v):
    """FlashAttention's call on [B, T, H, head_dim], the package's default stage."""
    import flash_stages
    return flash_stages.flash_attn_func(q, k, v, causal=True)


flash_attn_func_attention.seq_major = True


def stage_attention(stage):
    import flash_stages

    def attention(q, k, v):
        return flash_stages.scaled_dot_product_attention(q, k, v, is_causal=True, stage=stage)
    return attention


def default_stages():
    """The half-precision stages whose libraries loaded."""
    import flash_stages
    loaded = set(flash_stages.stages())
    return [s for s in flash_stages.HALF_STAGES if s in loaded]


# The grouped-query model: 4 query heads sharing 2 key/value heads, trained through
# flash_attn_func on [B, T, H, head_dim] beside SDPA (enable_gqa) on [B, H, T, head_dim].
GQA_CONFIG = Config(kv_heads=2)
GQA_RUN = "flash_attn_func"


def run_comparison(steps=300, stages=None, device="cuda", config=Config(), log=sys.stderr,
                   flash_attn_func=False):
    """{"sdpa_seed0": losses, "sdpa_seed1": losses, stage: losses, ...}: SDPA with model seeds
    0 and 1, then each stage (default: the half-precision stages that loaded) with seed 0;
    with flash_attn_func=True, one run through flash_stages.flash_attn_func (named GQA_RUN)
    in place of the stages."""
    stages = default_stages() if stages is None else list(stages)
    corpus = make_corpus(config, device)
    runs = [("sdpa_seed0", sdpa_attention, 0), ("sdpa_seed1", sdpa_attention, 1)]
    if flash_attn_func:
        runs.append((GQA_RUN, flash_attn_func_attention, 0))
    else:
        runs += [(s, stage_attention(s), 0) for s in stages]
    curves = {}
    for name, attention, seed in runs:
        if log:
            print(f"gpt: {name}: {steps} steps, model seed {seed}", file=log, flush=True)
        curves[name] = train(attention, seed, steps, config, device, name=name, corpus=corpus,
                             log=log)
    return curves


# ---- the agreement criterion -------------------------------------------------------------
# Every run sees the same batches in the same order, so the step-to-step ups and downs of the
# loss (an easy batch, a hard one) are common to all curves; what differs between two curves
# is how fast the two models learned. The moving mean takes out what is left of the per-step
# jitter. The comparison is over the second half of training: in the first half the curves fall
# steeply, and a step's difference there is mostly how early the fall began, which the seed
# moves and which says little about the kernel.
#
# What was seen on the CPU (float32, the default Config, 300 steps): the two SDPA seeds differ
# by up to 0.06 nats at step 100 and 0.025 over the second half (the noise), shrinking to
# 0.004 at the end. An attention that rounds q, k, v, P and O to bf16 as the half-precision
# kernels do (a stand-in for a correct stage) left seed 0's curve by 0.004: six times inside
# the noise. Wrong attentions, same seed: no causal mask, loss 0.02 by step 100 (it reads the
# answer); no 1/sqrt(d) scale, up to 0.58 nats above in the second half; no gradient through
# q, 0.26 above at step 200; an attention that returns v (no mixing), 3.83 at step 200, on the
# bigram plateau (the last two runs stopped there). On an H100 (bf16 autocast,
# python/README.md): the seeds 0.027 apart over the second half, stages 07-09 within
# 0.003-0.006 of seed 0, and SDPA at scale 1 instead of 1/8 0.42 away, refused.

SMOOTH_WINDOW = 20  # steps: long against the per-step jitter, short against the curve's bends
# The seed noise is never taken below this (nats): should the two SDPA seeds happen to end up
# almost on top of each other, a stage's run is allowed this much before it is called
# different. Chosen as 1% of a loss near the corpus's best (0.94 nats): below the seed noise
# seen on the CPU (0.025), so it rarely decides, and 2.5 times what the bf16 stand-in deviated
# (0.004), so a correct stage does not fail on a lucky pair of seeds; a wrong attention costs
# tenths of a nat.
NOISE_FLOOR = 0.01
# A run has learned when its smoothed final loss is below this fraction of its first step's
# loss (about ln 64 = 4.16 at the start, so below 3.12): the bigram loss (3.80), all that a
# model whose attention carries no word of the previous token can reach, is above it, and the
# comparison is not between flat curves. SDPA's runs end near 1.06.
LEARNED_FRACTION = 0.75


def smooth(losses, window=SMOOTH_WINDOW):
    """Trailing moving mean: entry i is the mean of losses[i - window + 1 .. i] (entries
    before window - 1 are left out, so entry i of the result is step i + window - 1)."""
    out, total = [], 0.0
    for i, x in enumerate(losses):
        total += x
        if i >= window:
            total -= losses[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out


def compared_steps(steps):
    """The steps the agreement is judged on: the second half."""
    if steps < 2 * SMOOTH_WINDOW:
        raise ValueError(f"{steps} steps are too few to compare: at least {2 * SMOOTH_WINDOW}")
    return range(steps // 2, steps)


def learned(losses):
    """(first loss, smoothed final loss, ok): ok when the run learned (LEARNED_FRACTION)."""
    first, final = losses[0], smooth(losses)[-1]
    ok = math.isfinite(first) and math.isfinite(final) and final < LEARNED_FRACTION * first
    return first, final, ok


def max_difference(a, b, steps):
    """The largest |a - b| of the smoothed curves over `steps`; NaN if either has a NaN."""
    sa, sb = smooth(a), smooth(b)
    diffs = [abs(sa[i - SMOOTH_WINDOW + 1] - sb[i - SMOOTH_WINDOW + 1]) for i in steps]
    return math.nan if any(math.isnan(x) for x in diffs) else max(diffs)


def seed_noise(curves):
    """The largest |sdpa_seed1 - sdpa_seed0| of the smoothed curves over the second half of
    training, or NOISE_FLOOR if larger."""
    base, other = curves[SDPA_RUNS[0]], curves[SDPA_RUNS[1]]
    return max(max_difference(base, other, compared_steps(len(base))), NOISE_FLOOR)


def agreement(curves):
    """{stage: (max deviation, noise, ok)} for every run in `curves` that is not an SDPA run.

    max deviation: the largest |stage - sdpa_seed0| of the smoothed curves (the same seed, so
    the same initial weights and batches: only the attention differs) over the second half of
    training. noise: the largest |sdpa_seed1 - sdpa_seed0| over the same steps, or NOISE_FLOOR
    if larger. ok: deviation <= noise and the stage's run learned (learned()).

    It can fail: an attention that computes something else (a wrong mask, a wrong scale, wrong
    gradients) trains another model, whose curve leaves the SDPA ones by much more than a
    change of initial weights does; one whose values are garbage cannot learn the order-2
    chain at all and fails the learned() test as well."""
    base = curves[SDPA_RUNS[0]]
    steps = compared_steps(len(base))
    noise = seed_noise(curves)
    out = {}
    for name, losses in curves.items():
        if name in SDPA_RUNS:
            continue
        deviation = max_difference(base, losses, steps)
        out[name] = (deviation, noise, deviation <= noise and learned(losses)[2])
    return out


# ---- the TSV -----------------------------------------------------------------------------


def stamp_line(device):
    """'# <device>, CUDA <version>, torch <version>, <YYYY-MM-DD>'."""
    import torch
    device = torch.device(device)
    if device.type == "cuda":
        name, cuda = torch.cuda.get_device_name(device), torch.version.cuda
    else:
        import platform
        name, cuda = platform.processor() or platform.machine() or "CPU", None
    parts = [name] + ([f"CUDA {cuda}"] if cuda else []) + [
        f"torch {torch.__version__}", datetime.date.today().isoformat()]
    return "# " + ", ".join(parts)


def config_line(config, steps):
    fields = ", ".join(f"{k} {v}" for k, v in asdict(config).items())
    return (f"# {steps} steps, {fields}; corpus: order-2 Markov chain over {VOCAB} tokens, "
            f"successor probabilities {SUCCESSOR_PROBS}, seed {CORPUS_SEED}")


def write_tsv(path, curves, device="cuda", config=Config()):
    names = list(curves)
    steps = len(curves[names[0]])
    with open(path, "w") as f:
        f.write(stamp_line(device) + "\n" + config_line(config, steps) + "\n")
        f.write("\t".join(["step"] + names) + "\n")
        for i in range(steps):
            f.write("\t".join([str(i)] + [f"{curves[n][i]:.6f}" for n in names]) + "\n")


def read_tsv(path):
    """(stamp text without '# ', {run: losses})."""
    stamp, header, rows = "", None, []
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith("#"):
                stamp = stamp or line.lstrip("# ")
            elif header is None:
                header = line.split("\t")
            elif line:
                rows.append([float(x) for x in line.split("\t")])
    return stamp, {name: [r[k] for r in rows] for k, name in enumerate(header) if k > 0}


# ---- the plot ----------------------------------------------------------------------------


def plot(tsv, png):
    """Two panels from the TSV: the smoothed loss of every run against the step, and below it
    each run's difference from sdpa_seed0, the quantity agreement() judges: its steps shaded,
    the seed noise as dotted lines at +-noise. The data go to gnuplot inline: nothing is
    written but the PNG."""
    # The project's one palette, so that a stage has the colour it has in every other plot.
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "scripts"))
    from plots import COLORS
    if not shutil.which("gnuplot"):
        print("gpt: gnuplot not found, no plot drawn (Debian/Ubuntu: apt-get install "
              "gnuplot-nox)")
        return 0
    stamp, curves = read_tsv(tsv)
    names = list(curves)
    steps = len(curves[names[0]])
    smoothed = {n: smooth(c) for n, c in curves.items()}
    first = SMOOTH_WINDOW - 1  # the first step that has a smoothed value
    base = smoothed[SDPA_RUNS[0]]
    data = ["$curves << EOD"]
    for j in range(len(base)):
        data.append("\t".join([str(j + first)] + [f"{smoothed[n][j]:.6f}" for n in names] +
                              [f"{smoothed[n][j] - base[j]:.6f}" for n in names]))
    data.append("EOD")
    lines = []
    for k, name in enumerate(names):
        style = "dt 2 " if name == SDPA_RUNS[1] else ""
        lines.append((k, f"lw 2 {style}lc rgb '{COLORS[k % len(COLORS)]}' title '{name}'"))
    compared = compared_steps(steps)
    noise = seed_noise(curves)
    n = len(names)
    differences = [x - y for name in names for x, y in zip(smoothed[name], base)
                   if math.isfinite(x)]
    low, high = min(differences + [-noise]), max(differences + [noise])
    pad = 0.08 * (high - low)
    # The stamp is shown in gnuplot's enhanced text (for its smaller font): its own
    # characters must not be read as markup.
    for c in "_^{}@&~":
        stamp = stamp.replace(c, "\\\\" + c)
    title = ("A small grouped-query GPT trained with SDPA and through flash_attn_func"
             if GQA_RUN in curves else
             "A small GPT trained with SDPA and with the half-precision stages")
    gp = data + [
        "set terminal pngcairo size 900,560 font 'sans,10'",
        f"set output '{png}'",
        "set multiplot",
        "set grid", "set key top right noenhanced",
        f"set xrange [0:{steps}]",
        # Top: the curves.
        "set lmargin 10", "set size 1,0.64", "set origin 0,0.36",
        f"set title \"{title}\\n{{/*0.8 {stamp}}}\"",
        f"set ylabel 'loss (nats, mean of {SMOOTH_WINDOW} steps)'",
        "set format x ''",
        "plot " + ", ".join(f"$curves using 1:{k + 2} with lines {style}"
                            for k, style in lines),
        # Bottom: the differences, over the compared steps.
        "unset title", "set format x '%g'", "set size 1,0.38", "set origin 0,0",
        "set xlabel 'step'", "set ylabel 'run - sdpa\\_seed0 (nats)'", "unset key",
        # Room for the +-noise lines, which autoscaling would not see (arrows, not data).
        f"set yrange [{low - pad}:{high + pad}]",
        f"set object 1 rect from {compared[0]},graph 0 to {steps},graph 1 behind "
        "fc rgb '#eeeeee' fs solid noborder",
        f"set label 1 'compared (dotted: seed noise {noise:.3f})' at {compared[0]},graph 0.88 "
        "offset 1,0 tc rgb '#666666'",
        *(f"set arrow {k + 1} from {compared[0]},{y} to {steps},{y} nohead dt 3 lw 1.5 "
          "lc rgb '#444444' front" for k, y in enumerate((noise, -noise))),
        "plot " + ", ".join(f"$curves using 1:{n + k + 2} with lines {style}"
                            for k, style in lines),
        "unset multiplot",
    ]
    subprocess.run(["gnuplot"], input="\n".join(gp) + "\n", text=True, check=True)
    print(f"gpt: wrote {png}")
    return 0


# ---- the command line --------------------------------------------------------------------


def report(curves, out=sys.stdout):
    """The table: every run's smoothed final loss, each stage's deviation against the noise.
    True when every run learned and every stage agrees."""
    verdicts = agreement(curves)
    base = curves[SDPA_RUNS[0]]
    all_ok = True
    print(f"{'run':<22}{'first':>8}{'final':>8}{'max |run - sdpa_seed0|':>25}"
          f"{'noise':>9}  verdict", file=out)
    for name, losses in curves.items():
        first, final, learned_ok = learned(losses)
        if name in SDPA_RUNS:
            difference = max_difference(base, losses, compared_steps(len(losses)))
            deviation = "-" if name == SDPA_RUNS[0] else f"{difference:.4f}"
            noise, ok = "", learned_ok
        else:
            dev, noise_value, ok = verdicts[name]
            deviation, noise = f"{dev:.4f}", f"{noise_value:.4f}"
        verdict = "ok" if ok else ("FAIL" if learned_ok else "FAIL (did not learn)")
        all_ok &= ok
        print(f"{name:<22}{first:>8.4f}{final:>8.4f}{deviation:>25}{noise:>9}  {verdict}",
              file=out)
    return all_ok


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--tsv", help="write the loss curves here")
    ap.add_argument("--stages", nargs="*", help="default: the half-precision stages loaded")
    ap.add_argument("--device", default="cuda",
                    help="cuda (default); cpu runs the two SDPA runs only, in float32")
    ap.add_argument("--plot", metavar="TSV", help="draw the curves of this TSV (no training)")
    ap.add_argument("--png", help="with --plot: the PNG to write (default: beside the TSV)")
    a = ap.parse_args()
    if a.plot:
        return plot(a.plot, a.png or os.path.splitext(a.plot)[0] + ".png")
    stages = a.stages
    if a.device == "cpu" and stages is None:
        stages = []  # the stages are CUDA kernels
    curves = run_comparison(a.steps, stages, a.device)
    if a.tsv:
        write_tsv(a.tsv, curves, a.device)
        print(f"gpt: wrote {a.tsv}", file=sys.stderr)
    return 0 if report(curves) else 1


if __name__ == "__main__":
    sys.exit(main())
